"""Plans as people read them: the placement table beside the equal split, why each device leaves
memory unused (`--explain`), and predicted against measured step times once a job has run."""

from __future__ import annotations

from layerbus.planner.network import BROKER, LinkMatrix
from layerbus.planner.placement import Plan, SplitEstimate, StagePlacement
from layerbus.planner.weight_choice import AUTO_FALLBACKS, BUILT_IN_QUALITY, QualityTable, quality_note
from layerbus.wire.spans import format_chain


def size(value: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{int(value)} B"


def format_split(title: str, split: SplitEstimate) -> list[str]:
    lines = [f"{title}: {split.tokens_per_s:.1f} tok/s predicted, bubble {split.bubble:.0%}, "
             f"pace {1000 * split.step_s:.2f} ms/step" + ("" if split.fits else "  (DOES NOT FIT in memory)"),
             f"  {'stage':<14} {'layers':<10} {'n':>3}  {'ends':<10} {'format':<6} {'weights':>10} {'KV cache':>10} "
             f"{'ms/step':>8}  {'memory used / budget':>24}"]
    for s in split.stages:
        ends = "+".join(part for part, held in (("embed", s.is_first), ("head", s.is_last)) if held) or "-"
        over = "" if s.fits else f"  over by {size(-s.free_bytes)}"
        lines.append(f"  {s.name:<14} {str(s.layers):<10} {len(s.layers):>3}  {ends:<10} {s.weights:<6} {size(s.weight_bytes):>10} "
                     f"{size(s.kv_bytes):>10} {1000 * s.step_s:>8.2f}  "
                     f"{size(s.used_bytes):>11} / {size(s.memory_budget):<10}{over}")
    return lines


def format_plan(plan: Plan) -> str:
    shapes = plan.shapes
    if plan.job is not None:
        total = plan.job.total
        workload = (f"the job's {total.steps:.0f} steps ({total.prefill_tokens:.0f} prompt tokens, "
                    f"{plan.job.new_tokens:.0f} new tokens) priced in {len(plan.job.windows)} windows: "
                    f"{plan.chosen.job_s:.1f} s predicted")
    else:
        workload = f"{plan.options.prompt_tokens_per_new_token:g} prompt tokens per new token"
    lines = [f"placement for {shapes.num_slots} slots x {shapes.max_context} tokens, micro-batches of "
             f"{shapes.micro_batch_size} ({shapes.num_micro_batches} in flight), {shapes.max_step_tokens} tokens "
             f"per step at most, {workload}"]
    lines.append(f"chain: {format_chain(plan.order, plan.spans)}")
    lines += format_split("planned", plan.chosen)
    if plan.left_out:
        lines.append(f"  left out (would only slow the chain): {', '.join(plan.left_out)}")
    if plan.equal is not None:
        lines += format_split("equal split", plan.equal)
        if plan.equal.tokens_per_s > 0:
            lines.append(f"planned / equal: {plan.tokens_per_s / plan.equal.tokens_per_s:.2f}x predicted tokens/s")
    return "\n".join(lines)


def format_chains(plan) -> str:
    """The grouping of the stages into chains (a planner.chain_plan.ChainsPlan) beside one chain of all:
    the best grouping found for each number of chains, its predicted tokens/s, and the choice."""
    lines = ["chains (each holds the whole model; chains work the job side by side):"]
    for grouping in plan.best_by_count:
        mark = "*" if grouping is plan.chosen else " "
        groups = " | ".join(" -> ".join(group) for group in grouping.groups)
        lines.append(f" {mark} {grouping.chains} chain(s): {grouping.tokens_per_s:8.1f} tok/s predicted   {groups}")
    if plan.gain is not None and plan.chosen.chains > 1:
        lines.append(f"chosen: {plan.chosen.chains} chains, {plan.gain:.2f}x one chain of all stages predicted; "
                     f"`layerbus run --chains {plan.chosen.chains}` deals local stages into that many chains in order")
    else:
        lines.append(f"chosen: {plan.chosen.chains} chain(s)")
    if plan.search != "every grouping":
        lines.append(f"search: {plan.search}")
    return "\n".join(lines)


def explain_stage(stage: StagePlacement, plan: Plan, quality: QualityTable = BUILT_IN_QUALITY) -> str:
    """Why this stage holds what it holds and leaves the rest of its memory unused."""
    parts = (f"{stage.name}: budget {size(stage.memory_budget)} = weights {size(stage.weight_bytes)} in "
             f"{stage.weights} + KV cache{'' if stage.is_last else ' and kept sends'} "
             f"{size(stage.kv_bytes)} + workspace {size(stage.workspace_bytes)} + reserve "
             f"{size(stage.reserve_bytes)} + free {size(stage.free_bytes)}")
    if stage.free_bytes < stage.layer_bytes:
        why = (f"memory-bound: one more layer needs {size(stage.layer_bytes)} (weights + its KV cache for "
               f"{plan.shapes.num_slots} slots x {plan.shapes.max_context} tokens), {size(stage.free_bytes)} is free")
    elif stage.step_s + stage.layer_s > plan.step_s:
        why = (f"compute-bound: one more layer would take it to {1000 * (stage.step_s + stage.layer_s):.2f} ms/step, "
               f"past the pace of {1000 * plan.step_s:.2f} ms")
    else:
        why = "could hold more: the contiguous split gives the extra layers to a stage where they cost no more"
    return f"{parts}\n    {why}\n    {weights_reason(stage, quality)}"


def weights_reason(stage: StagePlacement, quality: QualityTable = BUILT_IN_QUALITY) -> str:
    """Why it holds its weights in the format it does, and what that format costs in quality."""
    if stage.requested_weights != "auto":
        reason = f"weights {stage.weights}: asked for with --weights {stage.requested_weights}"
    elif stage.weights in AUTO_FALLBACKS:
        reason = (f"weights {stage.weights} (--weights auto): its span does not fit in full precision"
                  + ("" if stage.weights == AUTO_FALLBACKS[0] else f" nor in {AUTO_FALLBACKS[0]}"))
    else:
        reason = f"weights {stage.weights} (--weights auto): full precision fits"
    if stage.faster_format is not None:
        name, speed = stage.faster_format
        reason += (f"; {name} measured {speed:.2f}x its time on this stage: --weights {name} would trade quality "
                   f"for that speed, auto does not")
    if stage.format_speed is not None:
        reason += f"; its layers' decode step measured {stage.format_speed:.2f}x full precision's time on this stage"
    note = quality_note(stage.weights, quality)
    return reason + (f"; {note}" if note else "")


def format_explain(plan: Plan, quality: QualityTable = BUILT_IN_QUALITY) -> str:
    """`quality`: each format's cost against float32 (`plan --quality`: the model's own, measured)."""
    lines = ["why each stage leaves memory unused:"]
    lines += ["  " + explain_stage(stage, plan, quality) for stage in plan.stages]
    for name in plan.left_out:
        lines.append(f"  {name}: left out: any layers on it would make it slower than the chosen chain's pace")
    return "\n".join(lines + format_links(plan))


def format_links(plan: Plan) -> list[str]:
    """The chain with each stage's host and the link each step crosses: bandwidth, ms per step
    sending on it, latency; with a link matrix, what the best chain ignoring it would cost."""
    network = plan.network
    source = "the cluster's link matrix" if network is not None else "each stage's own link"
    lines = [f"the chain over hosts and links ({source}; order searched: {plan.search}):"]
    stages = plan.stages
    broker = network.host(BROKER) if network is not None else ""
    if network is not None:
        first = network.link(BROKER, stages[0].name)
        latency = f", latency {1000 * first.latency_s:.2f} ms" if first is not None else ""
        lines.append(f"  broker{_at(broker)} -> {stages[0].name}{_at(stages[0].host)}: token ids{latency}")
    for k, stage in enumerate(stages):
        if k + 1 < len(stages):
            after = stages[k + 1]
            where = f"within {stage.host}" if stage.host and stage.host == after.host else "crosses hosts"
            lines.append(f"  {stage.name}{_at(stage.host)} -> {after.name}{_at(after.host)}: {where}, "
                         f"{rate(stage.link_bandwidth)}, {1000 * stage.send_s:.2f} ms/step sending, "
                         f"latency {1000 * stage.latency_s:.2f} ms{_source(network, stage.name, after.name)}")
        else:
            lines.append(f"  {stage.name}{_at(stage.host)} -> broker{_at(broker)}: token ids, latency "
                         f"{1000 * stage.latency_s:.2f} ms")
    hosts = {stage.host for stage in stages}
    if len(hosts) == 1 and network is None:
        lines.append(f"  every stage runs on {stages[0].host or 'one machine'}: links cost what each stage measured")
    blind = plan.blind
    if blind is not None and blind.tokens_per_s > 0:
        same = " (the same chain)" if blind.order == plan.order and blind.spans == plan.spans else ""
        lines.append(f"ignoring the network the planner would choose {format_chain(blind.order, blind.spans)}{same}: "
                     f"{blind.tokens_per_s:.1f} tok/s on it, pace {1000 * blind.step_s:.2f} ms/step; planned "
                     f"{plan.tokens_per_s:.1f} tok/s ({plan.tokens_per_s / blind.tokens_per_s:.2f}x)")
    return lines


def format_link_matrix(matrix: LinkMatrix, names: list[str]) -> str:
    """Every ordered pair of `names` (and the broker's links) with its bandwidth, round trip and where
    the figures came from, for the job's events and the log."""
    lines = [f"links between {len(names)} stages (sender -> receiver: bandwidth, round trip, source):"]
    for sender in [BROKER, *names]:
        for receiver in [*names, BROKER]:
            link = matrix.link(sender, receiver)
            if sender == receiver or link is None:
                continue
            lines.append(f"  {sender}{_at(matrix.host(sender))} -> {receiver}{_at(matrix.host(receiver))}: "
                         f"{rate(link.bandwidth)}, round trip {2000 * link.latency_s:.2f} ms ({matrix.source(sender, receiver)})")
    missing = [f"{a} -> {b}" for a in names for b in names if a != b and matrix.link(a, b) is None]
    if missing:
        lines.append(f"  not timed, priced by the sender's own link: {', '.join(missing)}")
    return "\n".join(lines)


def rate(bytes_per_s: float) -> str:
    """Bytes/s as people write link speeds: "125.0 MB/s (1000 Mbit/s)"; inf as unlimited."""
    if bytes_per_s == float("inf"):
        return "unlimited"
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.1f} {unit} ({bytes_per_s * 8 / 1e6:g} Mbit/s)"
    return f"{bytes_per_s:.0f} B/s"


def _source(network: LinkMatrix | None, sender: str, receiver: str) -> str:
    """" (measured)", " (network file)", ...: where a live matrix's figure came from; "" for a cluster file's."""
    source = network.source(sender, receiver) if network is not None else ""
    return f" ({source})" if source else ""


def _at(host: str) -> str:
    return f" [{host}]" if host else ""


def prediction_report(plan: Plan, before: dict[str, dict], after: dict[str, dict], new_tokens: int, wall_s: float,
                      produced: SplitEstimate | None = None, finished: int = 0, prompt_tokens: int = 0) -> dict:
    """Predicted against measured for a run: tokens/s of the whole run and, per stage, busy time per
    step (from the stages' busy_s/steps stats) and the tokens/s its busy time alone would allow.
    `produced`: the same plan priced for the output lengths the run really produced. A run that generated
    nothing but finished items scored them (an eval): the plan counts one new token per scored item, so
    its tokens/s are documents/s, reported as such with the tokens scored (`scored`)."""
    stages = {}
    for stage in plan.stages:
        start, end = before.get(stage.name, {}), after.get(stage.name, {})
        steps = end.get("steps", 0) - start.get("steps", 0)
        busy = end.get("busy_s", 0.0) - start.get("busy_s", 0.0)
        predicted_busy = stage.step_s * plan.chosen.steps
        stages[stage.name] = {
            "layers": str(stage.layers), "steps": steps,
            "predicted_ms_per_step": 1000 * stage.step_s,
            "measured_ms_per_step": 1000 * busy / steps if steps > 0 else None,
            "predicted_tok_s": plan.chosen.new_tokens / predicted_busy if predicted_busy > 0 else None,
            "measured_tok_s": new_tokens / busy if busy > 0 else None}
    if new_tokens == 0 and finished > 0:
        return {"tok_s": plan.tokens_per_s, "measured_tok_s": finished / wall_s if wall_s > 0 else None,
                "tok_s_for_produced_lengths": None, "predicted_steps": plan.chosen.steps,
                "predicted_new_tokens": plan.chosen.new_tokens, "new_tokens": 0, "wall_s": wall_s, "stages": stages,
                "scored": {"documents": finished, "tokens": prompt_tokens}}
    return {"tok_s": plan.tokens_per_s, "measured_tok_s": new_tokens / wall_s if wall_s > 0 else None,
            "tok_s_for_produced_lengths": produced.tokens_per_s if produced is not None else None,
            "predicted_steps": plan.chosen.steps, "predicted_new_tokens": plan.chosen.new_tokens,
            "new_tokens": new_tokens, "wall_s": wall_s, "stages": stages}


def format_prediction(report: dict) -> list[str]:
    """One line per stage, then the run's line: predicted against measured."""
    lines = [f"{'stage':<12} {'layers':<10} {'busy ms/step predicted':>22} {'measured':>9} {'steps':>6} "
             f"{'tok/s at its busy time predicted':>33} {'measured':>9}"]
    for name, s in report["stages"].items():
        lines.append(f"{name:<12} {s['layers']:<10} {_num(s['predicted_ms_per_step']):>22} "
                     f"{_num(s['measured_ms_per_step']):>9} {s['steps']:>6} {_num(s['predicted_tok_s']):>33} "
                     f"{_num(s['measured_tok_s']):>9}")
    produced = report["tok_s_for_produced_lengths"]
    measured = report["measured_tok_s"]
    scored = report.get("scored")
    unit = "documents/s" if scored else "tok/s"
    line = f"run: {_num(report['tok_s'])} {unit} predicted, {_num(measured)} measured"
    if measured and report["tok_s"]:
        line += f" ({measured / report['tok_s'] - 1:+.0%})"
    if scored:
        lines.append(line + f"; {scored['tokens']} tokens scored for {scored['documents']} documents in "
                            f"{report['wall_s']:.1f} s")
        return lines
    if produced:
        line += f"; {_num(produced)} predicted for the output lengths produced ({measured / produced - 1:+.0%})"
    lines.append(line + f"; {report['new_tokens']} new tokens in {report['wall_s']:.1f} s")
    return lines


def _num(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"
