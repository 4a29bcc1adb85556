"""The prefix cache on against off, side by side in one run, on the default model:

  * a summarize job of --items short documents (500), rendered as `layerbus submit --task summarize`
    renders them (the chat template's system part and the instruction come first, so every item shares
    them), --job-new-tokens new tokens each: prefill tokens computed against what the cache should copy
    (the prompt tokens minus each item's shared prefix, the first item's excepted, within one block per
    item), and the wall time with and without the cache;
  * bench_pipeline's corpus (bench/corpus.py, --prompts of them, up to 128 new tokens): wall time
    and useful tokens/s with and without the cache (target: 1.3x faster).

Each case runs off then on, then (with --rounds 2) on then off, on the same local stages' configuration;
the speedup is the ratio of the median wall times, and outputs must be identical.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_prefix_cache.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.corpus import SAMPLE_CORPUS, tokenized_prompts  # noqa: E402
from layerbus.broker.broker import BrokerConfig  # noqa: E402
from layerbus.launch.local_cluster import LocalCluster, LocalStageOptions  # noqa: E402
from layerbus.planner.prefix_budget import PrefixCacheConfig  # noqa: E402
from layerbus.broker.requests import GenerationRequest  # noqa: E402
from layerbus.planner.batching import BatchingConfig  # noqa: E402
from layerbus.planner.workload import Workload  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def short_documents(count: int) -> list[str]:
    """`count` distinct documents: a numbered first line, then one or two paragraphs of the sample corpus
    (cycled). The number makes each document its own from its first token, so what items share is what
    every summarize job's items share: the chat template's system part and the instruction."""
    paragraphs = [p.strip() for path in sorted(SAMPLE_CORPUS.glob("*.txt"))
                  for p in path.read_text().split("\n\n") if p.strip()]
    return [f"Report {i + 1}.\n" + paragraphs[i % len(paragraphs)]
            + ("\n\n" + paragraphs[(i * 7 + 3) % len(paragraphs)] if i % 3 == 0 else "") for i in range(count)]


def summarize_prompts(tokenizer, count: int) -> list[tuple[str, list[int]]]:
    from layerbus.jobs.records import InputRecord
    from layerbus.jobs.tasks import TaskSpec, render_prompt

    spec = TaskSpec("summarize")
    prompts = []
    for i, text in enumerate(short_documents(count)):
        rendered = render_prompt(InputRecord(f"doc-{i}", text, None, None), spec, tokenizer)
        prompts.append((f"doc-{i}", tokenizer(rendered.text, add_special_tokens=rendered.add_special_tokens).input_ids))
    return prompts


def expected_restored(prompts: list[tuple[str, list[int]]], block: int) -> int:
    """What the cache should copy: each item's longest prefix shared with an earlier item, in
    whole blocks and short of its last token (which gives the first new token); the first item computes all."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for _, ids in prompts:
        usable = (len(ids) - 1) // block
        shared = 0
        for blocks in range(usable, 0, -1):
            if tuple(ids[:blocks * block]) in seen:
                shared = blocks
                break
        total += shared * block
        for blocks in range(1, len(ids) // block + 1):
            seen.add(tuple(ids[:blocks * block]))
    return total


def run(model_dir: Path, prompts, max_new_tokens: int, stages: int, threads: int, prefix_tokens: int) -> dict:
    requests = [GenerationRequest(pid, ids, max_new_tokens=max_new_tokens) for pid, ids in prompts]
    batching = BatchingConfig(micro_batch_size=0, max_step_tokens=0, max_context=4096,
                              prefix_cache=PrefixCacheConfig(budget_tokens=prefix_tokens))
    config = BrokerConfig(str(model_dir), stages, batching=batching,
                          workload=Workload.of_prompts([ids for _, ids in prompts], max_new_tokens))
    with LocalCluster(config, LocalStageOptions(threads_per_stage=threads)) as cluster:
        started = time.perf_counter()
        results, stats = cluster.broker.generate(requests)
        wall = time.perf_counter() - started
    useful = sum(len(r.token_ids) for r in results)
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    figures = stats.prefix_cache or {}
    restored = figures.get("restored_tokens", 0)
    return {"prefix_cache_tokens": prefix_tokens, "wall_s": wall, "useful_tokens": useful, "useful_tok_s": useful / wall,
            "prompt_tokens": prompt_tokens, "restored_tokens": restored, "prefill_computed": prompt_tokens - restored,
            "prefix_cache": figures, "outputs": [r.token_ids for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--job-new-tokens", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64, help="pipeline-corpus prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--prefix-cache-tokens", type=int, default=PrefixCacheConfig().budget_tokens)
    parser.add_argument("--skip-corpus", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of off/on, alternating which goes first")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_prefix_cache.json")
    args = parser.parse_args()
    from layerbus.models.default_model import default_model_dir
    from layerbus.models.model_info import load_tokenizer

    model_dir = default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    threads = max(1, 2 // args.stages)
    block = PrefixCacheConfig().block_tokens
    cases = [("summarize job", summarize_prompts(tokenizer, args.items), args.job_new_tokens)]
    if not args.skip_corpus:
        cases.append(("pipeline corpus", tokenized_prompts(tokenizer, args.prompts), args.max_new_tokens))
    report = {"model": str(model_dir), "stages": args.stages, "block_tokens": block, "cases": []}
    for name, prompts, new_tokens in cases:
        offs, ons = [], []
        for round_ in range(args.rounds):
            order = (0, args.prefix_cache_tokens) if round_ % 2 == 0 else (args.prefix_cache_tokens, 0)
            for tokens in order:
                (ons if tokens else offs).append(run(model_dir, prompts, new_tokens, args.stages, threads, tokens))
        off = min(offs, key=lambda r: r["wall_s"]) if len(offs) < 3 else sorted(offs, key=lambda r: r["wall_s"])[1]
        on = min(ons, key=lambda r: r["wall_s"]) if len(ons) < 3 else sorted(ons, key=lambda r: r["wall_s"])[1]
        off_wall = statistics.median(r["wall_s"] for r in offs)
        on_wall = statistics.median(r["wall_s"] for r in ons)
        expected = expected_restored(prompts, block)
        case = {"case": name, "items": len(prompts), "new_tokens": new_tokens, "prompt_tokens": on["prompt_tokens"],
                "expected_restored": expected,
                "identical_outputs": all(r["outputs"] == offs[0]["outputs"] for r in offs + ons),
                "speedup": off_wall / on_wall, "wall_s_off": [r["wall_s"] for r in offs],
                "wall_s_on": [r["wall_s"] for r in ons],
                "off": {k: v for k, v in off.items() if k != "outputs"},
                "on": {k: v for k, v in on.items() if k != "outputs"}}
        case["restored_short_by_blocks_per_item"] = (expected - on["restored_tokens"]) / block / len(prompts)
        report["cases"].append(case)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\n{args.stages} stages, default model, blocks of {block} tokens, cache of {args.prefix_cache_tokens} tokens")
    print("| case | items | prompt tokens | prefill computed off / on | restored (expected) | short of expected, "
          "blocks per item | wall s off / on (each round) | speedup (medians) | identical outputs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in report["cases"]:
        off, on = case["off"], case["on"]
        print(f"| {case['case']} | {case['items']} | {case['prompt_tokens']} | {off['prefill_computed']} / "
              f"{on['prefill_computed']} | {on['restored_tokens']} ({case['expected_restored']}) | "
              f"{case['restored_short_by_blocks_per_item']:.2f} | "
              f"{', '.join(f'{w:.1f}' for w in case['wall_s_off'])} / {', '.join(f'{w:.1f}' for w in case['wall_s_on'])} | "
              f"{case['speedup']:.2f}x | {case['identical_outputs']} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
