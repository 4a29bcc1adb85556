"""Wire codecs, fewer bytes between machines: bytes per hop, quality, and speed on a slow link.

  1. Bytes per hop of each codec against float32 (SmolLM2's hidden size, scales and outliers counted).
  2. Quality on SmolLM2-135M-Instruct, teacher-forced over the sample corpus (as `layerbus
     wire-quality`), every codec on both cuts of the 3-stage plan ([0,13) [13,26) [26,30)).
  3. Two stages in separate network namespaces (bench/netns.py). First without a rate limit: tokens/s
     and the share of each stage's busy time spent in the codec. Then with the stage-to-stage link
     limited by tbf to a rate that makes the float16 run network-bound (the rate is derived from the
     unlimited float16 run: its hop bytes/s times --compute-to-transfer), float16 against int8.

  4. CurveZMQ: the same two-stage runs with every link secured against unsecured, on the
     unlimited link and on the limited one (float16), and the handshake's time on loopback.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_wire.py          # about 5 minutes
    .venv/bin/python bench/bench_wire.py --documents 8 --prompts 12               # a quick look
    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_wire.py --curve-only   # part 4 alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.netns import StageNamespaces, stop_stages, unavailable_reason  # noqa: E402
from layerbus.broker.broker import Broker, BrokerConfig  # noqa: E402
from layerbus.planner.placement import PlanOptions  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.jobs.corpus import SAMPLE_CORPUS, corpus_prompts  # noqa: E402
from layerbus.stages.wire_quality import quality_report  # noqa: E402
from layerbus.wire.codecs import CODEC_NAMES, wire_bytes  # noqa: E402
from layerbus.wire.curve import ClusterKeys, make_keypair, read_keypair, secure_client, secure_server  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
NAMESPACES = ["lb5-bench-a", "lb5-bench-b"]


def short_prompts(tokenizer, count: int) -> list[tuple[str, list[int]]]:
    """Each sample document's first paragraph as a one-sentence summary request: short prompts,
    so a run on a slow link stays within a minute."""
    documents = sorted(SAMPLE_CORPUS.glob("*.txt"))
    prompts = []
    for i in range(count):
        path = documents[i % len(documents)]
        text = path.read_text().strip().split("\n\n")[0]
        chat = tokenizer.apply_chat_template([{"role": "user", "content": f"Summarize in one sentence:\n\n{text}"}],
                                             add_generation_prompt=True, tokenize=False)
        prompts.append((f"{path.stem}-{i}", tokenizer(chat, add_special_tokens=False).input_ids))
    return prompts


def run_in_namespaces(model_dir: Path, prompts, codec: str, rate_mbit: float | None, max_new_tokens: int,
                      micro_batch_size: int, secure: bool = True) -> dict:
    """Broker here, stage i in namespace i; the stage-0 -> stage-1 hop crosses the (limited) link. Every link
    CurveZMQ (one throwaway keypair, as a local cluster's), or none (`secure=False`: the stages' --insecure)."""
    requests = [GenerationRequest(pid, ids, max_new_tokens=max_new_tokens) for pid, ids in prompts]
    key_dir = tempfile.TemporaryDirectory(prefix="layerbus-bench-keys-")
    keys = ClusterKeys(read_keypair(make_keypair(Path(key_dir.name), "bench")[1])) if secure else None
    key_args = ["--keys", str(keys.keypair.path), "--broker-key", str(keys.keypair.path)] if keys else ["--insecure"]
    with key_dir, StageNamespaces(NAMESPACES, rate_mbit) as net:
        # Equal halves: the bench measures the link, not placement. A profiled plan on this shared machine
        # once gave stage-0 a single layer (co-run factors measured under load), which shrank the hop's
        # bytes/s, hence the derived rate, until one prefill step's transfer outlasted the resend timeout.
        config = BrokerConfig(str(model_dir), 2, partition="equal",
                              control_bind="tcp://0.0.0.0:*", results_bind="tcp://0.0.0.0:*",
                              advertise_host=net.host_address(1), wire=codec, keys=keys,
                              # stage-0 first: only its data port is reachable from here, only stage-1 reaches
                              # the advertised results address (a reordered plan left every step unanswered)
                              plan_options=PlanOptions(allow_reorder=False, allow_drop=False),
                              batching=BatchingConfig(micro_batch_size=micro_batch_size, max_context=2048))
        broker = Broker(config)
        port = broker.control.address.rsplit(":", 1)[1]
        binds = [net.stage_address(0), net.chain_address(1)]  # stage 1 receives over the limited link
        env = dict(os.environ, PYTHONPATH=str(REPO))
        processes = []
        # Kept after the run: a stalled or failed run is read from its stages' logs.
        log_dir = Path(tempfile.mkdtemp(prefix=f"layerbus-bench-wire-{codec}-{'curve' if secure else 'plain'}-"))
        print(f"stage logs: {log_dir}", file=sys.stderr)
        try:
            for i, name in enumerate(NAMESPACES):
                argv = [sys.executable, "-m", "layerbus.stages", "--broker", f"tcp://{net.host_address(i)}:{port}",
                        "--name", f"stage-{i}", "--bind", f"tcp://{binds[i]}:*", "--threads", "1", *key_args]
                with open(log_dir / f"stage-{i}.log", "wb") as log:
                    processes.append(subprocess.Popen(net.command(name, argv), env=env, stdout=subprocess.DEVNULL,
                                                      stderr=log))
            broker.start()
            results, stats = broker.generate(requests)
            steps_before = {s.name: s.stats.get("steps") for s in broker.chain}
            deadline = time.monotonic() + 5  # the stats of the last steps ride on the next heartbeat
            while time.monotonic() < deadline and any(s.stats.get("steps") == steps_before[s.name]
                                                      for s in broker.chain):
                broker.control.poll(100)
            stage_stats = {s.name: dict(s.stats) for s in broker.chain}
        finally:
            broker.close()
            stop_stages(processes)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    new_tokens = sum(len(r.token_ids) for r in results)
    sent = stage_stats["stage-0"]["bytes_out"]
    return {"codec": codec, "secure": secure, "rate_mbit": rate_mbit, "wall_s": stats.wall_s, "new_tokens": new_tokens,
            "tokens_per_s": new_tokens / stats.wall_s, "hop_bytes": sent, "hop_bytes_per_s": sent / stats.wall_s,
            "codec_share": {name: s["codec_s"] / s["busy_s"] for name, s in stage_stats.items() if s.get("busy_s")},
            "busy_s": {name: s["busy_s"] for name, s in stage_stats.items()},
            "token_ids": [r.token_ids for r in results]}


def handshake_ms(secure: bool, connections: int = 50) -> float:
    """Median time from connect to a first message received, over tcp loopback, CURVE or not (no ZAP)."""
    context = zmq.Context()
    server_keys = read_keypair(make_keypair(Path(tempfile.mkdtemp()), "server")[1]) if secure else None
    client_keys = read_keypair(make_keypair(Path(tempfile.mkdtemp()), "client")[1]) if secure else None
    server = context.socket(zmq.ROUTER)
    if secure:
        secure_server(server, server_keys)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    times = []
    for _ in range(connections):
        client = context.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        if secure:
            secure_client(client, client_keys, server_keys.public)
        started = time.perf_counter()
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hello")
        server.recv_multipart()
        times.append((time.perf_counter() - started) * 1e3)
        client.close(linger=0)
    server.close(linger=0)
    context.term()
    return statistics.median(times)


def curve_comparison(model_dir: Path, prompts, args) -> dict:
    """Secured against unsecured, unlimited and limited link (float16, the rate as part 3 derives it)."""
    run = lambda rate, secure: run_in_namespaces(model_dir, prompts, "float16", rate, args.max_new_tokens,  # noqa: E731
                                                 args.micro_batch_size, secure)
    unlimited = {"insecure": run(None, False), "curve": run(None, True)}
    rate = unlimited["insecure"]["hop_bytes_per_s"] * 8 / 1e6 * args.compute_to_transfer
    limited = {"insecure": run(rate, False), "curve": run(rate, True)}
    report = {"handshake_ms": {"null": handshake_ms(False), "curve": handshake_ms(True)}, "rate_mbit": rate}
    print("\nCurveZMQ: 2 stages in namespaces, float16 wire")
    print("| link | links | tok/s | wall s | tok/s change |\n|---|---|---|---|---|")
    for label, runs in (("no limit", unlimited), (f"tbf {rate:.2f} Mbit/s", limited)):
        plain, curve = runs["insecure"], runs["curve"]
        change = curve["tokens_per_s"] / plain["tokens_per_s"] - 1
        report[label] = {"change": change, "same_outputs": curve["token_ids"] == plain["token_ids"],
                         **{name: {"tokens_per_s": r["tokens_per_s"], "wall_s": r["wall_s"]}
                            for name, r in runs.items()}}
        print(f"| {label} | unsecured | {plain['tokens_per_s']:.1f} | {plain['wall_s']:.1f} | |")
        print(f"| {label} | CurveZMQ | {curve['tokens_per_s']:.1f} | {curve['wall_s']:.1f} | {change:+.1%} |")
    shakes = report["handshake_ms"]
    print(f"handshake (connect to first message received, tcp loopback, median of 50): NULL {shakes['null']:.2f} ms, "
          f"CURVE {shakes['curve']:.2f} ms; outputs equal: no limit {report['no limit']['same_outputs']}, "
          f"limited {report[f'tbf {rate:.2f} Mbit/s']['same_outputs']}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: the default model)")
    parser.add_argument("--documents", type=int, default=0, help="quality: first N documents (0 = all 40)")
    parser.add_argument("--prompts", type=int, default=24, help="speed runs: prompts (default 24)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--compute-to-transfer", type=float, default=0.15,
                        help="float16 compute time / transfer time on the limited link (default 0.15)")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--curve-only", action="store_true",
                        help="only part 4, CurveZMQ against unsecured links (written to bench_wire_curve.json)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_wire.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer, read_model_info

    model_dir = args.model or default_model_dir()
    if args.curve_only:
        reason = unavailable_reason()
        if reason is not None:
            raise SystemExit(f"CurveZMQ comparison skipped: {reason}")
        report = curve_comparison(model_dir, short_prompts(load_tokenizer(model_dir), args.prompts), args)
        out = args.out.with_name("bench_wire_curve.json")
        out.write_text(json.dumps(report, indent=2))
        print(f"\nwritten to {out}")
        return
    hidden = read_model_info(model_dir).files.config.hidden_size
    report: dict = {"model": str(model_dir), "hidden_size": hidden, "cores": os.cpu_count()}

    report["bytes_per_hop"] = {c: wire_bytes(c, 32, hidden) / wire_bytes("float32", 32, hidden) for c in CODEC_NAMES}
    print("| codec | bytes per hop vs float32 |\n|---|---|")
    for codec, ratio in report["bytes_per_hop"].items():
        print(f"| {codec} | {ratio:.3f}x |")

    if not args.skip_quality:
        prompts = corpus_prompts(load_tokenizer(model_dir))
        prompts = prompts[:args.documents] if args.documents else prompts
        quality = quality_report(model_dir, prompts, str(SAMPLE_CORPUS), [13, 26])
        report["quality"] = quality
        first = next(iter(quality["codecs"].values()))
        print(f"\nquality: {quality['prompts']} prompts, {first['positions']} positions, cuts {quality['cuts']}, "
              f"{quality['seconds']:.0f} s; float32 wire perplexity {first['ppl_float32']:.3f}")
        print("| codec | mean KL | max KL | same top | PPL change |\n|---|---|---|---|---|")
        for name, q in quality["codecs"].items():
            print(f"| {name} | {q['mean_kl']:.2e} | {q['max_kl']:.2e} | {q['same_top']:.2%} | {q['ppl_change']:+.3%} |")

    reason = unavailable_reason()
    if reason is not None:
        print(f"\nspeed runs skipped: {reason}")
        report["speed_skipped"] = reason
    else:
        prompts = short_prompts(load_tokenizer(model_dir), args.prompts)
        run = lambda codec, rate: run_in_namespaces(model_dir, prompts, codec, rate, args.max_new_tokens,  # noqa: E731
                                                    args.micro_batch_size)
        unlimited = {codec: run(codec, None) for codec in ("float16", "int8", "int4")}
        # The rate at which float16's transfer takes 1 / ratio of its compute-bound run's time.
        rate = unlimited["float16"]["hop_bytes_per_s"] * 8 / 1e6 * args.compute_to_transfer
        limited = {codec: run(codec, rate) for codec in ("float16", "int8")}
        speedup = limited["int8"]["tokens_per_s"] / limited["float16"]["tokens_per_s"]
        report.update(prompts=len(prompts), prompt_tokens=sum(len(ids) for _, ids in prompts),
                      unlimited=unlimited, limited=limited, rate_mbit=rate, int8_speedup=speedup,
                      compute_to_transfer=args.compute_to_transfer)
        print(f"\nspeed: 2 stages in namespaces, {len(prompts)} prompts ({report['prompt_tokens']} prompt tokens), "
              f"{args.max_new_tokens} new tokens each")
        print("| link | codec | tok/s | wall s | hop MB | codec share of busy time (stage-0, stage-1) |")
        print("|---|---|---|---|---|---|")
        for label, runs in (("no limit", unlimited), (f"tbf {rate:.2f} Mbit/s", limited)):
            for codec, row in runs.items():
                share = ", ".join(f"{v:.1%}" for v in row["codec_share"].values())
                print(f"| {label} | {codec} | {row['tokens_per_s']:.1f} | {row['wall_s']:.1f} | "
                      f"{row['hop_bytes'] / 1e6:.2f} | {share} |")
        print(f"\nint8 / float16 tokens/s on the limited link: {speedup:.2f}x (target >= 1.8x); float16 compute-to-"
              f"transfer ratio {args.compute_to_transfer} by construction at {rate:.2f} Mbit/s")
        for runs in (unlimited, limited):
            for row in runs.values():
                row.pop("token_ids")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
