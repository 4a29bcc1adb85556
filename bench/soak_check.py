"""The soak's checker (bench/soak.py): what the store, the results and the job's events say after a round of
faults: every id once, the outputs of a fault-free run, nothing stranded, exact counters, every fault said."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from layerbus.storage import JobStore

if TYPE_CHECKING:
    from bench.soak import Fault, RoundReport


def closest_call(model: Path, items: Path, custom_id: str) -> str:
    """For a greedy item: the smallest gap between the model's two best next-token logits along transformers'
    own greedy run of it (a gap within float rounding, ~1e-5, is a near-tie that any change in how the positions
    were cut may flip); for a sampled item, that it was sampled."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    line = next(json.loads(text) for text in items.read_text().splitlines() if f'"{custom_id}"' in text)
    body = line["body"]
    if body.get("temperature", 0):
        return "sampled"
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(body["prompt"], add_special_tokens=False)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=body["max_tokens"], do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
    gaps = [float(torch.topk(scores[0], 2).values.diff().abs()) for scores in out.scores]
    step = min(range(len(gaps)), key=gaps.__getitem__)
    return f"greedy; closest call at token {step}: the two best logits {gaps[step]:.1e} apart"


def check_round(report: RoundReport, db: str, job_id: str, reference: dict[str, str], env: dict,
                broker_codes: list[int | None], model: Path, items: Path) -> None:
    import pyarrow.parquet as pq
    from sqlalchemy import create_engine, text

    with JobStore.open(db) as store:
        status = store.job_status(job_id)
        events = store.job_events(job_id, limit=1_000_000)
    engine = create_engine(db)
    try:
        with engine.connect() as conn:  # the items themselves, counted apart from the job's counters
            counted = dict(conn.execute(text("SELECT status, COUNT(*) FROM items WHERE job_id = :job GROUP BY status"),
                                        {"job": job_id}).all())
    finally:
        engine.dispose()
    checks = report.checks
    checks["completed"] = status.status == "completed"
    checks["brokers_exit_0"] = all(code == 0 for code in broker_codes)
    checks["nothing_left_in_progress"] = status.queued == 0 and status.in_progress == 0 and not (
        counted.get("queued") or counted.get("in_progress"))
    checks["counters_equal_a_count"] = (status.completed == counted.get("completed", 0)
                                        and status.failed == counted.get("failed", 0)
                                        and status.total == sum(counted.values()) == report.items)
    rows = pq.read_table(status.results_path).to_pylist() if status.results_path else []
    ids = [row["custom_id"] for row in rows]
    checks["every_id_once"] = len(ids) == len(set(ids)) == report.items and set(ids) == set(reference)
    outputs = {row["custom_id"]: row["output"] for row in rows}
    differ = sorted(custom_id for custom_id in reference if outputs.get(custom_id) != reference[custom_id])
    checks["outputs_identical"] = not differ
    if differ:
        report.problems.append(f"{len(differ)} output(s) differ from the fault-free run: "
                               + "; ".join(f"{custom_id} ({closest_call(model, items, custom_id)})"
                                           for custom_id in differ[:5]))
    for fault in report.faults:
        fault.seen = seen(fault, events)
    unseen = [f"{f.kind} {f.target} at {f.round_s:.1f} s" for f in report.faults if not f.seen]
    checks["every_fault_seen"] = not unseen
    if unseen:
        report.problems.append(f"faults with no event in status: {unseen}")
    if report.seconds:
        report.tokens_per_s = status.completion_tokens / report.seconds


def seen(fault: Fault, events) -> bool:
    """Whether an event after the fault says it (a lost stage, a stage that joined, a broker that ended)."""
    after = [e for e in events if e.at.timestamp() >= datetime.fromisoformat(fault.at).timestamp() - 1.0]
    if fault.kind in ("broker-kill", "finalizing-kill"):
        pid = fault.target.split("pid ")[1]
        return any(e.kind in ("worker_lost", "lease_expired", "resumed") and f":{pid}:" in e.message for e in after)
    names = fault.target.split(",")
    if fault.kind == "late-stage":
        return any(names[0] in e.message for e in after)
    return all(any(e.kind == "stage_lost" and re.search(rf"\bstage {re.escape(name)}\b", e.message) for e in after)
               for name in names)
