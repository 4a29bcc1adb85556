"""Long documents summarized end to end by map-reduce on local stages: documents/hour, map and reduce tokens,
the reduce depth, and the planner's predicted generation rate and time against the measured.

The corpus is text shipped in Debian packages (licences under /usr/share/common-licenses and packages'
copyright files under /usr/share/doc), the documents whose token count is within [--min-tokens,
--max-tokens], longest first. `layerbus run` runs them as a user does (a subprocess, its own home and
store); the figures come from the store afterwards.

    LAYERBUS_MODEL_CACHE=... .venv/bin/python bench/bench_long_documents.py [--documents 8] [--stages 3]

Writes bench/results/bench_long_documents.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS_PATH = REPO / "bench" / "results" / "bench_long_documents.json"
# Where Debian keeps texts every machine of this kind has.
SOURCES = ("/usr/share/common-licenses", "/usr/share/doc")


def find_documents(count: int, min_tokens: int, max_tokens: int, count_tokens) -> list[tuple[str, str, int]]:
    """(id, text, tokens) of up to `count` Debian texts within the token range, longest first, one per content."""
    seen, found = set(), []
    for root in SOURCES:
        for path in sorted(Path(root).rglob("*")):
            if not path.is_file() or path.is_symlink() or path.suffix in (".gz", ".html", ".png", ".svg"):
                continue
            try:
                text = path.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError):
                continue
            if len(text) < min_tokens or text in seen:
                continue
            seen.add(text)
            tokens = count_tokens(text)
            if min_tokens <= tokens <= max_tokens:
                name = re.sub(r"[^A-Za-z0-9.+-]+", "-", str(path.relative_to("/usr/share")))
                found.append((name, text, tokens))
    found.sort(key=lambda doc: -doc[2])
    return found[:count]


def run_job(corpus: Path, home: Path, args: argparse.Namespace) -> tuple[float, str]:
    env = {**os.environ, "LAYERBUS_HOME": str(home), "TQDM_DISABLE": "1"}
    command = [sys.executable, "-m", "layerbus.cli.main", "run", str(corpus), "--task", "summarize",
               "--stages", str(args.stages), "--max-new-tokens", str(args.max_new_tokens),
               "--max-context", str(args.max_context), "--db", f"sqlite:///{home / 'jobs.db'}"]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"layerbus run exited {done.returncode}:\n{done.stderr[-3000:]}")
    return seconds, done.stderr


def measure(db: str, seconds: float) -> dict:
    from sqlalchemy import create_engine, text

    engine = create_engine(db)
    with engine.connect() as conn:
        job_id, settings = conn.execute(text("SELECT id, settings_json FROM jobs")).one()
        rows = conn.execute(text(
            "SELECT parent_id, level, combine, status, prompt_tokens, completion_tokens FROM items WHERE job_id = :j"),
            {"j": job_id}).all()
        events = conn.execute(text("SELECT kind, message FROM job_events WHERE job_id = :j ORDER BY id"),
                              {"j": job_id}).all()
        run = conn.execute(text("SELECT in_progress_at, finalizing_at FROM jobs WHERE id = :j"), {"j": job_id}).one()
    documents = [r for r in rows if r.parent_id is None]
    maps = [r for r in rows if r.parent_id is not None and (r.level or 0) == 0]
    reduces = [r for r in rows if r.combine == "reduce"]
    generated = sum(r.completion_tokens or 0 for r in rows)
    predicted = next((float(m) for kind, message in events if kind == "placed"
                      for m in re.findall(r"predicted ([0-9.]+) tok/s", message)), None)
    run_s = (_utc(run.finalizing_at) - _utc(run.in_progress_at)) if run.finalizing_at and run.in_progress_at else None
    return {
        "job_id": job_id,
        "documents": len(documents),
        "documents_split": sum(1 for r in documents if r.combine is not None),
        "documents_failed": sum(1 for r in documents if r.status != "completed"),
        "map_items": len(maps),
        "reduce_items": len(reduces),
        "reduce_depth": max((r.level or 0 for r in reduces), default=0),
        "map_tokens": {"prompt": sum(r.prompt_tokens or 0 for r in maps),
                       "generated": sum(r.completion_tokens or 0 for r in maps)},
        "reduce_tokens": {"prompt": sum(r.prompt_tokens or 0 for r in reduces),
                          "generated": sum(r.completion_tokens or 0 for r in reduces)},
        "wall_s": round(seconds, 1),
        "run_s": round(run_s, 1) if run_s else None,
        "documents_per_hour": round(len(documents) / seconds * 3600, 1),
        "generated_tokens_per_s": round(generated / run_s, 2) if run_s else None,
        "predicted_tokens_per_s": predicted,
        "predicted_run_s": round(generated / predicted, 1) if predicted else None,
        "settings": json.loads(settings).get("extra", {}).get("long_documents"),
    }


def _utc(value):
    from datetime import datetime, timezone

    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=12000)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args(argv)

    from layerbus.cli.options import resolve_model
    from layerbus.jobs.document_split import token_counter

    count = token_counter(resolve_model(None))
    documents = find_documents(args.documents, args.min_tokens, args.max_tokens, lambda t: count(t, False))
    if not documents:
        raise SystemExit(f"no Debian text of {args.min_tokens} to {args.max_tokens} tokens under {SOURCES}")
    with tempfile.TemporaryDirectory(prefix="bench-long-documents-") as tmp:
        home = Path(tmp)
        corpus = home / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"id": name, "text": text}) + "\n" for name, text, _ in documents))
        seconds, _ = run_job(corpus, home, args)
        result = measure(f"sqlite:///{home / 'jobs.db'}", seconds)
    result.update(corpus_tokens=sum(tokens for *_, tokens in documents),
                  token_range=[min(t for *_, t in documents), max(t for *_, t in documents)],
                  stages=args.stages, max_new_tokens=args.max_new_tokens, max_context=args.max_context)
    print(f"{result['documents']} documents ({result['corpus_tokens']:,} tokens, {result['token_range'][0]:,} to "
          f"{result['token_range'][1]:,} each) on {args.stages} stages: {result['documents_per_hour']} documents/hour; "
          f"map {result['map_items']} items, {result['map_tokens']}; reduce {result['reduce_items']} items, "
          f"{result['reduce_tokens']}, depth {result['reduce_depth']}; generated {result['generated_tokens_per_s']} "
          f"tok/s against {result['predicted_tokens_per_s']} predicted ({result['run_s']} s against "
          f"{result['predicted_run_s']} s); {result['documents_failed']} failed")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
