"""Multiple-choice eval throughput: layerbus against lm-evaluation-harness's HF backend, same machine,
same model (float32, CPU), same documents, measured side by side in one run.

The task: --docs 4-choice cloze questions built from the bundled sample corpus (a passage of 20-40
words, then which of four 3-word phrases comes next: the true one or three taken from elsewhere),
written as a layerbus task file. Both tools score exactly the same (context, choice) pairs.

  * lm-eval: `HFLM(pretrained=MODEL, dtype=float32, batch_size=B).loglikelihood(...)` on every
    (context, " " + choice) request, at its default batch size (1) and at the best of --hf-batch-sizes
    (each tried on the first --probe-docs documents, the fastest then run on all of them).
  * layerbus: `layerbus eval run TASK --stages N` as a user runs it, for each N in --stages.

Reported per system: documents/s over the scoring itself (lm-eval: the loglikelihood call; layerbus:
the job's in_progress -> finalizing timestamps) and over the whole command (model load and start-up
included), and prefill tokens computed per document (lm-eval: every position of every request, its
batch padding counted separately; layerbus: the positions its stages computed). Targets:
layerbus 1 stage >= 2x lm-eval at its best; 2 stages >= 0.9x 1 stage.

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/bench_eval.py [--docs 1000] [--stages 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.corpus import SAMPLE_CORPUS  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"


def cloze_questions(count: int, seed: int = 0) -> list[dict]:
    """`count` 4-choice questions from the sample corpus: deterministic for a seed."""
    rng = random.Random(seed)
    words = []
    for path in sorted(SAMPLE_CORPUS.glob("*.txt")):
        words.append(re.findall(r"\S+", path.read_text()))
    questions = []
    while len(questions) < count:
        doc = rng.randrange(len(words))
        text = words[doc]
        length = rng.randint(20, 40)
        if len(text) < length + 3:
            continue
        start = rng.randrange(len(text) - length - 3 + 1)
        context = " ".join(text[start:start + length])
        truth = " ".join(text[start + length:start + length + 3])
        distractors = []
        while len(distractors) < 3:
            other = words[rng.randrange(len(words))]
            at = rng.randrange(len(other) - 3)
            phrase = " ".join(other[at:at + 3])
            if phrase != truth and phrase not in distractors:
                distractors.append(phrase)
        gold = rng.randrange(4)
        choices = distractors[:gold] + [truth] + distractors[gold:]
        questions.append({"id": f"q{len(questions):05d}", "context": context,
                          "choices": [" " + c for c in choices], "gold": gold})
    return questions


def run_lm_eval(model_dir: Path, questions: list[dict], batch_size: int, max_length: int) -> dict:
    """Score every (context, choice) pair with lm-eval's HF backend; times the loglikelihood call alone."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    started = time.perf_counter()
    lm = HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=batch_size,
              max_length=max_length)
    loaded = time.perf_counter()
    requests = [Instance("loglikelihood", q, (q["context"], choice), i)
                for q in questions for i, choice in enumerate(q["choices"])]
    results = lm.loglikelihood(requests, disable_tqdm=True)
    done = time.perf_counter()
    positions = 0
    for q in questions:
        for choice in q["choices"]:
            context_ids, continuation_ids = lm._encode_pair(q["context"], choice)
            positions += len((context_ids + continuation_ids)[-(max_length + 1):][:-1])
    correct = 0
    for n, q in enumerate(questions):
        lls = [ll for ll, _ in results[4 * n:4 * n + 4]]
        correct += max(range(4), key=lambda i: (lls[i], -i)) == q["gold"]
    return {"system": f"lm-eval HF, batch {batch_size}", "docs": len(questions),
            "scoring_s": done - loaded, "total_s": done - started,
            "docs_per_s": len(questions) / (done - loaded), "docs_per_s_total": len(questions) / (done - started),
            "prefill_tokens_per_doc": positions / len(questions), "acc": correct / len(questions),
            "lls": [ll for ll, _ in results]}


def run_layerbus(task: Path, model_dir: Path, stages: int, work: Path, max_length: int) -> dict:
    env = dict(os.environ, LAYERBUS_HOME=str(work / f"home-{stages}"))
    db = f"sqlite:///{work / f'store-{stages}.db'}"
    started = time.perf_counter()
    done = subprocess.run([str(REPO / ".venv" / "bin" / "layerbus"), "eval", "run", str(task), "--model",
                           str(model_dir), "--stages", str(stages), "--db", db, "--max-context", str(max_length),
                           "--partition", "balanced", "--json"],
                          env=env, capture_output=True, text=True)
    total = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"layerbus eval run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    outcome = json.loads(done.stdout)
    status = json.loads(subprocess.run([str(REPO / ".venv" / "bin" / "layerbus"), "status", outcome["job_id"],
                                        "--db", db, "--json"], env=env, capture_output=True, text=True,
                                       check=True).stdout)
    stamps = {k: datetime.fromisoformat(v) for k, v in status["timestamps"].items() if v}
    scoring = (stamps["finalizing_at"] - stamps["in_progress_at"]).total_seconds()
    docs = status["request_counts"]["total"]
    import pyarrow.parquet as pq

    samples = pq.read_table(outcome["samples"]).to_pylist()
    acc = next(m["value"] for m in outcome["metrics"] if m["metric"] == "acc")
    return {"system": f"layerbus, {stages} stage{'s' if stages > 1 else ''}", "docs": docs, "scoring_s": scoring,
            "total_s": total, "docs_per_s": docs / scoring, "docs_per_s_total": docs / total,
            "prefill_tokens_per_doc": status["tokens"]["prompt"] / docs, "acc": acc,
            "lls": [ll for row in sorted(samples, key=lambda r: r["doc_id"]) for ll in row["lls"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--probe-docs", type=int, default=100)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the default model)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "bench_eval.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="layerbus-bench-eval-"))
    if args.model is None:
        from layerbus.models.default_model import default_model_dir

        args.model = default_model_dir()
    questions = cloze_questions(args.docs)
    task = work / "cloze.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in questions))

    rows = [run_lm_eval(args.model, questions, 1, args.max_length)]
    probes = {b: run_lm_eval(args.model, questions[:args.probe_docs], b, args.max_length)["docs_per_s"]
              for b in args.hf_batch_sizes}
    best = max(probes, key=probes.get)
    rows.append(run_lm_eval(args.model, questions, best, args.max_length))
    for stages in args.stages:
        rows.append(run_layerbus(task, args.model, stages, work, args.max_length))

    reference = rows[0]["lls"]
    best_hf = max(rows[:2], key=lambda r: r["docs_per_s"])
    one_stage = next((r for r in rows if r["system"] == "layerbus, 1 stage"), None)
    print(f"{args.docs} documents x 4 choices, {args.model.name}, float32 on CPU; lm-eval batch sizes probed on "
          f"{args.probe_docs} docs: " + ", ".join(f"{b}: {v:.2f} docs/s" for b, v in probes.items()))
    header = f"{'system':<22} {'docs/s':>8} {'docs/s incl. load':>18} {'prefill tok/doc':>16} {'acc':>6} " \
             f"{'max |dll|':>10} {'vs best HF':>10}"
    print(header)
    print("-" * len(header))
    for row in rows:
        row["max_abs_ll_diff_vs_hf_batch1"] = max(abs(a - b) for a, b in zip(row["lls"], reference))
        row["vs_best_hf"] = row["docs_per_s"] / best_hf["docs_per_s"]
        if one_stage is not None and row["system"].startswith("layerbus"):
            row["vs_1_stage"] = row["docs_per_s"] / one_stage["docs_per_s"]
        print(f"{row['system']:<22} {row['docs_per_s']:>8.2f} {row['docs_per_s_total']:>18.2f} "
              f"{row['prefill_tokens_per_doc']:>16.1f} {row['acc']:>6.3f} {row['max_abs_ll_diff_vs_hf_batch1']:>10.2e} "
              f"{row['vs_best_hf']:>9.2f}x")
    for row in rows:
        del row["lls"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"docs": args.docs, "model": str(args.model), "hf_probe_docs_per_s": probes,
                                    "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
