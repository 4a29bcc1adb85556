"""Placement over hosts and links: four stages on two "machines" joined by a slow link.

Two network namespaces (bench/netns.py) stand for two hosts, two stages in each (loopback between
them), the namespaces joined by a veth pair that tbf limits to --rate-mbit each way. The broker runs
here and is told the hosts and the link (BrokerConfig.network, as a cluster file's hosts/[[links]]
give them to `layerbus plan`), or with `--links measured` is told nothing: the stages time the links
between them when they register (broker/link_probing.py) and the planner uses that matrix. Stage names interleave the hosts (s0a, s1b, s2a, s3b), so keeping
the name order is the worst order: every hop crosses the slow link. Two runs of the same dense job
(story prompts that run to their token limit), side by side:

  planner   the planner free to order the chain (it should keep each host's stages together: one
            crossing instead of three)
  worst     the name order kept (allow_reorder=False), spans planned for it

Printed: tokens/s of each, their ratio (target >= 1.5x), the plan's prediction against the
measured figure (target within 15%), the chains and spans.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_topology.py     # about 5 minutes
    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_topology.py --links measured
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import tokenized_stories  # noqa: E402
from bench.netns import StageNamespaces, run_ip, stop_stages, unavailable_reason  # noqa: E402
from layerbus.broker.broker import Broker, BrokerConfig  # noqa: E402
from layerbus.broker.link_probing import LinkProbeConfig  # noqa: E402
from layerbus.planner.network import BROKER, HostLinks, Link  # noqa: E402
from layerbus.planner.placement import PlanOptions  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.planner.workload import Workload  # noqa: E402
from layerbus.wire.curve import ClusterKeys, make_keypair, read_keypair  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
NAMESPACES = ["lb5-topo-a", "lb5-topo-b"]
STAGES = [("s0a", 0), ("s1b", 1), ("s2a", 0), ("s3b", 1)]  # (name, namespace): the name order interleaves
PORT_BASE = 47100


def routes(net: StageNamespaces) -> None:
    """Each namespace's slow-link address reachable from here (the broker sends stage 0 its tokens,
    whichever host it is on), and the broker's results address from both namespaces."""
    for i in range(len(NAMESPACES)):
        run_ip("ip", "route", "add", f"{slow_address(i)}/32", "via", net.stage_address(i))
        other = 1 - i
        run_ip("ip", "route", "add", f"{net.host_address(other)}/32", "via", net.host_address(i),
            namespace=NAMESPACES[i])


def slow_address(i: int) -> str:
    """Namespace i's address on the link between the two namespaces (what its stages advertise)."""
    return f"10.77.100.{i + 1}"


def run_chain(model_dir: Path, prompts, max_new_tokens: int, rate_mbit: float, reorder: bool,
              micro_batch_size: int, profile_cache: str, measured: bool = False, probe_burst_s: float = 2.0) -> dict:
    requests = [GenerationRequest(pid, ids, max_new_tokens=max_new_tokens) for pid, ids in prompts]
    key_dir = tempfile.TemporaryDirectory(prefix="layerbus-bench-keys-")
    keys = ClusterKeys(read_keypair(make_keypair(Path(key_dir.name), "bench")[1]))
    key_args = ["--keys", str(keys.keypair.path), "--broker-key", str(keys.keypair.path)]
    # What the broker is told: the hosts, the slow link between them (as tbf shapes it), fast elsewhere.
    network = HostLinks({**{name: NAMESPACES[ns] for name, ns in STAGES}, BROKER: "bench-host"},
                        {frozenset(NAMESPACES): Link(bandwidth=rate_mbit * 1e6 / 8, latency_s=0.0002)},
                        default=Link(bandwidth=1e9, latency_s=0.00005), within_host=Link(bandwidth=5e9))
    # Measured: no description at all; the stages time every pair (bursts of probe_burst_s: tbf lets its
    # 32 KB bucket through at line speed, which a shorter burst would take for the link's rate).
    link_probe = LinkProbeConfig(burst_s=probe_burst_s) if measured else LinkProbeConfig(enabled=False)
    log_dir = Path(tempfile.mkdtemp(prefix=f"layerbus-bench-topology-{'planner' if reorder else 'worst'}-"))
    print(f"stage logs: {log_dir}", file=sys.stderr)
    with key_dir, StageNamespaces(NAMESPACES, rate_mbit) as net:
        routes(net)
        config = BrokerConfig(str(model_dir), len(STAGES), control_bind="tcp://0.0.0.0:*",
                              results_bind="tcp://0.0.0.0:*", advertise_host=net.host_address(0), keys=keys,
                              plan_options=PlanOptions(allow_reorder=reorder, allow_drop=False),
                              batching=BatchingConfig(micro_batch_size=micro_batch_size, max_context=1024),
                              workload=Workload.of_prompts([ids for _, ids in prompts], max_new_tokens),
                              network=None if measured else network, link_probe=link_probe)
        broker = Broker(config)
        port = broker.control.address.rsplit(":", 1)[1]
        env = dict(os.environ, PYTHONPATH=str(REPO), LAYERBUS_PROFILE_CACHE=profile_cache)
        processes = []
        try:
            for k, (name, ns) in enumerate(STAGES):
                data_port = PORT_BASE + k
                argv = [sys.executable, "-m", "layerbus.stages", "--broker", f"tcp://{net.host_address(ns)}:{port}",
                        "--name", name, "--bind", f"tcp://0.0.0.0:{data_port}",
                        "--advertise", f"tcp://{slow_address(ns)}:{data_port}", "--threads", "1", *key_args]
                with open(log_dir / f"{name}.log", "wb") as log:
                    processes.append(subprocess.Popen(net.command(NAMESPACES[ns], argv), env=env,
                                                      stdout=subprocess.DEVNULL, stderr=log))
            broker.start()
            results, stats = broker.generate(requests)
            plan, prediction = broker.plan, broker.last_prediction
            profiles = {p.name: {"layer_decode_ms": p.layer_decode_s * 1e3, "head_ms": p.head_s * 1e3,
                                 "corun_factor": p.corun_factor, "link_mbit_per_s": p.link_bandwidth * 8 / 1e6}
                        for p in broker.profiles}
            links = {f"{a} -> {b}": {"mbit_per_s": m.bytes_per_s * 8 / 1e6, "round_trip_ms": m.round_trip_s * 1e3}
                     for (a, b), m in sorted(broker.measured_links.items())}
        finally:
            broker.close()
            stop_stages(processes)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    new_tokens = sum(len(r.token_ids) for r in results)
    crossings = sum(dict(STAGES)[a] != dict(STAGES)[b] for a, b in zip(plan.order, plan.order[1:]))
    return {"order": list(plan.order), "spans": [str(span) for span in plan.spans], "slow_crossings": crossings,
            "new_tokens": new_tokens, "wall_s": stats.wall_s, "tokens_per_s": new_tokens / stats.wall_s,
            "predicted_tokens_per_s": plan.tokens_per_s,
            "predicted_for_produced_lengths": (prediction or {}).get("tok_s_for_produced_lengths"),
            "profiles": profiles, "measured_links": links, "token_ids": [r.token_ids for r in results],
            # per stage, busy ms per step predicted against measured (planner.plan_report.prediction_report)
            "stages_predicted_measured": (prediction or {}).get("stages")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the default model)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--rate-mbit", type=float, default=1.0, help="the slow link, each way (default 1 Mbit/s)")
    parser.add_argument("--links", choices=("described", "measured"), default="described",
                        help="described: the broker is told the hosts and links (a network file); measured: the "
                             "stages time the links between them, nothing is described (default: described)")
    parser.add_argument("--probe-burst-s", type=float, default=2.0,
                        help="measured: each pair's bandwidth from a burst at least this long (default 2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/bench_topology.json (described) or bench_topology_measured.json")
    args = parser.parse_args()
    measured = args.links == "measured"
    args.out = args.out or RESULTS_DIR / ("bench_topology_measured.json" if measured else "bench_topology.json")
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"bench_topology needs network namespaces: {reason}")
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer

    model_dir = args.model or default_model_dir()
    prompts = tokenized_stories(load_tokenizer(model_dir), args.prompts)
    with tempfile.TemporaryDirectory(prefix="layerbus-bench-profiles-") as profile_cache:  # both runs, one profile
        runs = {label: run_chain(model_dir, prompts, args.max_new_tokens, args.rate_mbit, reorder,
                                 args.micro_batch_size, profile_cache, measured, args.probe_burst_s)
                for label, reorder in (("planner", True), ("worst", False))}
    same = runs["planner"].pop("token_ids") == runs["worst"].pop("token_ids")
    ratio = runs["planner"]["tokens_per_s"] / runs["worst"]["tokens_per_s"]
    print(f"\n4 stages on 2 namespaces, slow link tbf {args.rate_mbit} Mbit/s each way, {len(prompts)} story prompts, "
          f"{args.max_new_tokens} new tokens, micro-batches of {args.micro_batch_size}, links {args.links}"
          + (f" (bursts of {args.probe_burst_s:g} s)" if measured else ""))
    if measured:
        print("links the stages timed (planner's run):")
        for pair, link in runs["planner"]["measured_links"].items():
            print(f"  {pair}: {link['mbit_per_s']:.2f} Mbit/s, round trip {link['round_trip_ms']:.2f} ms")
    print("| chain | order | spans | slow crossings | tok/s | predicted | error |\n|---|---|---|---|---|---|---|")
    for label, run in runs.items():
        error = run["predicted_tokens_per_s"] / run["tokens_per_s"] - 1
        run["prediction_error"] = error
        print(f"| {label} | {' '.join(run['order'])} | {' '.join(run['spans'])} | {run['slow_crossings']} | "
              f"{run['tokens_per_s']:.1f} | {run['predicted_tokens_per_s']:.1f} | {error:+.0%} |")
    print("\n| chain | stage | layers | busy ms/step predicted | measured |\n|---|---|---|---|---|")
    for label, run in runs.items():
        for name, stage in (run["stages_predicted_measured"] or {}).items():
            measured_ms = stage["measured_ms_per_step"]
            print(f"| {label} | {name} | {stage['layers']} | {stage['predicted_ms_per_step']:.1f} | "
                  f"{'-' if measured_ms is None else f'{measured_ms:.1f}'} |")
    print(f"\nplanner / worst: {ratio:.2f}x (target >= 1.5x); outputs identical: {same}; "
          f"prediction error of the planner's chain {runs['planner']['prediction_error']:+.0%} (target within 15%)")
    report = {"links": args.links, "probe_burst_s": args.probe_burst_s if measured else None,
              "rate_mbit": args.rate_mbit, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "micro_batch_size": args.micro_batch_size, "cores": os.cpu_count(), "ratio": ratio,
              "same_outputs": same, **runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
