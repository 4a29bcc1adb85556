"""Constrained decoding's cost: decode tokens/s with a JSON schema against unconstrained, on the same
items, and where the mask's time goes; then an extraction job of per-item schemas, choices and regexes, checked.

    .venv/bin/python bench/bench_constrained.py [--items 48] [--stages 2] [--max-new-tokens 64]

Throughput: the same summarization prompts twice, greedy, on local stage processes: unconstrained, then with
a JSON schema whose free-text fields let the output run to max_new_tokens, so both runs generate about the same
tokens and prefill the same prompts (a short schema would finish early and compare less work, not slower work).
Mask time: the broker's grammar work (mask, advance, packing; timed in this process, where the broker runs)
against the run's wall time, and the last stage's unpacking and masking (timed here per row on the same
vocabulary, times the masked rows) against that stage's busy time.
Extraction: 100 items of tests/cluster/test_constrained.py's job (three schemas, a choice, a regex), counted by
finish_reason, every "stop" output checked (jsonschema, the choice list, re.fullmatch).
Writes bench/results/bench_constrained.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from layerbus.models.openmp_waits import prefer_passive_waits  # noqa: E402

prefer_passive_waits()  # before torch loads: this process is the broker (bench/__init__.py)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import tokenized_prompts  # noqa: E402
from layerbus.broker import grammar as grammar_module  # noqa: E402
from layerbus.broker import pipeline as pipeline_module  # noqa: E402
from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.planner.placement import PlanOptions  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.broker.run_state import ListSource  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.models.default_model import default_model_dir  # noqa: E402
from layerbus.stages.sampling import allowed_tokens  # noqa: E402
from layerbus.wire.constraint import Constraint, pack_mask  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_constrained.json"
SUMMARY = {"type": "object", "properties": {"title": {"type": "string"}, "summary": {"type": "string"},
                                            "keywords": {"type": "array", "items": {"type": "string"}}},
           "required": ["title", "summary", "keywords"], "additionalProperties": False}


class Collect:
    """A sink that keeps every result."""

    def __init__(self):
        self.results = []

    def deliver(self, results) -> None:
        self.results.extend(results)


class Timer:
    """Seconds spent in the wrapped functions, and how many calls."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def wrap(self, function):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1
        return timed


def run(model_dir: Path, requests: list[GenerationRequest], stages: int, threads: int) -> tuple[dict, object]:
    config = BrokerConfig(str(model_dir), stages, batching=BatchingConfig(num_slots=16, max_step_tokens=256),
                          plan_options=PlanOptions(allow_drop=False))
    with LocalCluster(config, LocalStageOptions(threads_per_stage=threads)) as cluster:
        sink = Collect()
        stats = cluster.broker.run(ListSource(requests), sink)
    return {r.request_id: r for r in sink.results}, stats


def stage_apply_seconds(vocab: int, bitmasks: list[bytes], threads: int, repeats: int = 7) -> float:
    """The last stage's mean cost of one masked row over masks the run sent: unpack the row's mask and mask its
    logits, on the stage's thread count; the fastest of several repeats, since other work on a shared machine
    only ever adds time."""
    packed, logits = [pack_mask(bitmask) for bitmask in bitmasks], torch.randn(vocab)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    best = float("inf")
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            for mask in packed:
                logits.masked_fill(~allowed_tokens(mask, vocab), float("-inf"))
            best = min(best, (time.perf_counter() - started) / len(packed))
    finally:
        torch.set_num_threads(before)
    return best


def throughput(model_dir: Path, tokenizer, args) -> dict:
    prompts = tokenized_prompts(tokenizer, args.items)
    plain = [GenerationRequest(name, ids, max_new_tokens=args.max_new_tokens) for name, ids in prompts]
    schema = Constraint.json_schema(SUMMARY)
    constrained = [GenerationRequest(name, ids, max_new_tokens=args.max_new_tokens, constraint=schema)
                   for name, ids in prompts]
    plain_results, plain_stats = run(model_dir, plain, args.stages, args.threads)
    mask_timer, advance_timer, pack_timer = Timer(), Timer(), Timer()
    token_grammar = grammar_module.TokenGrammar
    originals = (token_grammar.mask, token_grammar.advance, pipeline_module.pack_mask)
    token_grammar.mask, token_grammar.advance = mask_timer.wrap(originals[0]), advance_timer.wrap(originals[1])
    sampled: list[bytes] = []  # every 7th mask the run sends, for the stage's side
    pipeline_module.pack_mask = pack_timer.wrap(lambda bitmask: (sampled.append(bitmask) if pack_timer.calls % 7 == 0
                                                                 else None, originals[2](bitmask))[1])
    try:
        constrained_results, constrained_stats = run(model_dir, constrained, args.stages, args.threads)
    finally:
        token_grammar.mask, token_grammar.advance, pipeline_module.pack_mask = originals
    valid = sum(_valid(schema, r.text) for r in constrained_results.values() if r.finish_reason == "stop")
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    per_row = stage_apply_seconds(vocab, sampled, args.threads)
    last = constrained_stats.stage_stats[max(constrained_stats.stage_stats)]
    broker_s = mask_timer.seconds + advance_timer.seconds + pack_timer.seconds
    rate = {name: stats.new_tokens / stats.wall_s for name, stats in
            (("unconstrained", plain_stats), ("json_schema", constrained_stats))}
    return {
        "items": args.items, "stages": args.stages, "max_new_tokens": args.max_new_tokens,
        "tokens": {"unconstrained": plain_stats.new_tokens, "json_schema": constrained_stats.new_tokens},
        "wall_s": {"unconstrained": round(plain_stats.wall_s, 2), "json_schema": round(constrained_stats.wall_s, 2)},
        "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
        "ratio": round(rate["json_schema"] / rate["unconstrained"], 3),
        "json_schema_finish": _reasons(constrained_results), "json_schema_stop_valid": valid,
        "broker_mask_s": round(mask_timer.seconds, 3), "broker_advance_s": round(advance_timer.seconds, 3),
        "broker_pack_s": round(pack_timer.seconds, 3), "masks": mask_timer.calls,
        "broker_grammar_share_of_wall": round(broker_s / constrained_stats.wall_s, 4),
        "stage_apply_us_per_row": round(per_row * 1e6, 1), "mask_bytes_sent_mean": round(
            sum(len(pack_mask(m)) for m in sampled) / len(sampled)),
        "last_stage_busy_s": round(last["busy_s"], 2),
        "stage_apply_share_of_last_stage": round(per_row * pack_timer.calls / last["busy_s"], 4),
    }


def extraction(model_dir: Path, tokenizer, args) -> dict:
    from tests.helpers.constrained_items import check_output, extraction_items

    items = extraction_items(100)
    requests = [GenerationRequest(f"r{i}", tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                          add_generation_prompt=True, tokenize=True,
                                                                          return_dict=False),
                                  max_new_tokens=48, constraint=constraint) for i, (text, constraint) in enumerate(items)]
    results, stats = run(model_dir, requests, args.stages, args.threads)
    counts: dict[str, dict[str, int]] = {}
    for i, (_, constraint) in enumerate(items):
        result = results[f"r{i}"]
        entry = counts.setdefault(constraint.kind, {"items": 0, "stop": 0, "valid": 0, "length": 0})
        entry["items"] += 1
        if result.finish_reason == "stop":
            entry["stop"] += 1
            check_output(constraint, result.text)  # raises on an invalid output
            entry["valid"] += 1
        elif result.finish_reason == "length":
            entry["length"] += 1
    examples = {constraint.kind: results[f"r{i}"].text for i, (_, constraint) in enumerate(items[:5])}
    return {"by_kind": counts, "wall_s": round(stats.wall_s, 2), "examples": examples}


def _valid(constraint: Constraint, text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), constraint.schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _reasons(results: dict) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for result in results.values():
        reasons[result.finish_reason] = reasons.get(result.finish_reason, 0) + 1
    return reasons


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per stage")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--skip-extraction", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = Path(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    report = {"throughput": throughput(model_dir, tokenizer, args)}
    print(json.dumps(report["throughput"], indent=1), flush=True)
    if not args.skip_extraction:
        report["extraction"] = extraction(model_dir, tokenizer, args)
        print(json.dumps(report["extraction"], indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
