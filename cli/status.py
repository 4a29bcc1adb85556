"""`layerbus status`: recent jobs, or one job's progress; light enough to poll (no torch, no transformers)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from layerbus.cli.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from layerbus.cli.options import add_db, command_parser, open_store, positive_int
from layerbus.storage.states import FINAL_JOB_STATES

if TYPE_CHECKING:
    from layerbus.storage import JobEvent, JobStatus, JobStore, JobWorker
    from layerbus.storage.status_records import DocumentProgress

WATCH_INTERVAL_S = 2.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "status", main, help="show recent jobs, or one job's progress",
                        description="Without JOB: a table of recent jobs. With JOB: counts by state, "
                                    "tokens, tokens/s, ETA, timestamps, the results path, the "
                                    "brokers working it (host, chain, items done, tokens/s, last "
                                    "lease renewal) and the job's events (stages lost, re-plans, "
                                    "recoveries and how long they took).") as parser:
        parser.add_argument("job", metavar="JOB", nargs="?", help="job id (job_...)")
        parser.add_argument("--json", action="store_true", help="print JSON (one object per refresh with --watch)")
        parser.add_argument("--watch", action="store_true",
                            help=f"refresh every {WATCH_INTERVAL_S:.0f} s until the job (default: the latest) is "
                                 "finished; exit 0 if it completed, 1 otherwise")
        parser.add_argument("--limit", metavar="N", type=positive_int, default=20, help="jobs in the table (default: "
                                                                                        "20)")
        add_db(parser)


def main(args: argparse.Namespace) -> int:
    if not args.watch and _print_directly(args):
        return EXIT_OK
    with open_store(args.db) as store:
        if args.watch:
            return _watch(store, args.job or _latest(store), args.json)
        if args.job is None:
            jobs = store.list_jobs(limit=args.limit)
            print(json.dumps([status_json(s) for s in jobs], indent=2) if args.json else jobs_table(jobs))
            return EXIT_OK
        status = store.job_status(args.job)
        _print_job(status, store.job_events(args.job), args.json, store.job_workers(args.job),
                   store.document_progress(args.job))
        return EXIT_OK


def _print_directly(args: argparse.Namespace) -> bool:
    """Answer through the store's driver alone (sqlite3, psycopg), without importing SQLAlchemy (most of this
    command's time); False when that path cannot answer, and the full store (with its error messages) takes over."""
    from layerbus.storage.direct_status import (read_document_progress, read_job_events, read_job_status,
                                                read_job_workers, read_recent_jobs)
    from layerbus.storage.locations import default_db_url

    url = args.db or default_db_url()
    if args.job is None:
        jobs = read_recent_jobs(url, args.limit)
        if jobs is None:
            return False
        print(json.dumps([status_json(s) for s in jobs], indent=2) if args.json else jobs_table(jobs))
        return True
    status = read_job_status(url, args.job)
    if status is None:
        return False
    events = read_job_events(url, args.job)
    workers = read_job_workers(url, args.job)
    documents = read_document_progress(url, args.job)
    if events is None or workers is None or documents is False:
        return False
    _print_job(status, events, args.json, workers, documents)
    return True


def _print_job(status: JobStatus, events: Sequence[JobEvent], as_json: bool, workers: Sequence[JobWorker] = (),
               documents: DocumentProgress | None = None) -> None:
    print(json.dumps(status_json(status, events, workers, documents=documents), indent=2) if as_json
          else job_report(status, events, workers, documents=documents))


def _latest(store: JobStore) -> str:
    from layerbus.cli.errors import UsageError

    job_id = store.latest_job_id()
    if job_id is None:
        raise UsageError(f"no jobs in {store.url} yet: queue one with `layerbus submit` or `layerbus run`")
    return job_id


def _watch(store: JobStore, job_id: str, as_json: bool) -> int:
    redraw = sys.stdout.isatty() and not as_json
    try:
        while True:
            status = store.job_status(job_id)
            events, workers = store.job_events(job_id), store.job_workers(job_id)
            if redraw:
                sys.stdout.write("\x1b[H\x1b[2J")  # cursor home, clear screen
            print(json.dumps(status_json(status, events, workers)) if as_json else job_report(status, events, workers),
                  flush=True)
            if status.status in FINAL_JOB_STATES:
                return EXIT_OK if status.status == "completed" else EXIT_FAILED
            if not redraw and not as_json:
                print(flush=True)
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def status_json(status: JobStatus, events: Sequence[JobEvent] | None = None,
                workers: Sequence[JobWorker] | None = None, now: datetime | None = None,
                documents: DocumentProgress | None = None) -> dict[str, Any]:
    """The JSON of one job; `events` and `workers` (one job's view, not the jobs table) add an "events" and
    a "workers" list, and `documents` (a job that split long documents) a "documents" object."""
    out = {
        "id": status.job_id,
        "name": status.name,
        "task": status.task,
        "model": status.model,
        "status": status.status,
        "request_counts": {"total": status.total, "completed": status.completed, "failed": status.failed,
                           "cancelled": status.cancelled, "queued": status.queued,
                           "in_progress": status.in_progress},
        "tokens": {"prompt": status.prompt_tokens, "completion": status.completion_tokens,
                   "total": status.prompt_tokens + status.completion_tokens},
        "tokens_per_s": status.tokens_per_s,
        "eta_s": status.eta_s,
        "timestamps": {column: _iso(value) for column, value in status.timestamps.items()},
        "results_path": status.results_path,
        "error": status.error,
        "wire": _wire_links(status.job_id),
        "chain": _chain_line(status.job_id),
        "stages": _stages(status.job_id),
    }
    if documents is not None:
        out["documents"] = {"total": status.total - documents.parts, "split": documents.split,
                            "split_done": documents.documents_done, "parts": documents.parts,
                            "parts_done": documents.parts_done, "reduce_levels_remaining": documents.levels_remaining}
    if events is not None:
        out["events"] = [{"at": _iso(e.at), "kind": e.kind, "message": e.message, "duration_s": e.duration_s}
                         for e in events]
    if workers is not None:
        clock = now or datetime.now(timezone.utc)
        out["workers"] = [{"worker": w.worker, "host": w.host, "chain": w.chain, "state": w.state_at(clock),
                           "items_done": w.items_done, "completion_tokens": w.completion_tokens,
                           "tokens_per_s": w.tokens_per_s, "lease_s": w.lease_s, "started_at": _iso(w.started_at),
                           "last_renewal": _iso(w.renewed_at),
                           "last_renewal_age_s": round((clock - w.renewed_at).total_seconds(), 3)}
                          for w in workers]
    return out


def workers_table(workers: Sequence[JobWorker], now: datetime) -> str:
    """One line per broker that worked the job: who, where, its state, what it did, when it last renewed."""
    header = ("WORKER", "HOST", "STATE", "ITEMS", "TOK/S", "LAST RENEWAL (UTC)", "CHAIN")
    rows = [(w.worker, w.host, w.state_at(now), str(w.items_done),
             f"{w.tokens_per_s:.1f}" if w.tokens_per_s is not None else "-",
             f"{_clock(w.renewed_at)} ({duration_text(max(0.0, (now - w.renewed_at).total_seconds()))} ago)",
             w.chain or "-") for w in workers]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows])


def job_report(status: JobStatus, events: Sequence[JobEvent] = (), workers: Sequence[JobWorker] = (),
               now: datetime | None = None, documents: DocumentProgress | None = None) -> str:
    rate = f" ({status.tokens_per_s:.1f} tok/s)" if status.tokens_per_s is not None else ""
    lines = [
        ("job", f"{status.job_id}" + (f" ({status.name})" if status.name else "")),
        ("status", status.status),
        ("task", status.task),
        ("model", status.model),
        ("items", f"{status.total} total: {status.completed} completed, {status.failed} failed, "
                  f"{status.cancelled} cancelled, {status.queued} queued, {status.in_progress} in progress"),
        ("tokens", f"{status.prompt_tokens} prompt, {status.completion_tokens} generated{rate}"),
    ]
    if documents is not None:  # the items above count a long document's parts too
        lines.insert(4, ("documents", document_line(status, documents)))
    if status.eta_s is not None:
        lines.append(("eta", duration_text(status.eta_s)))
    lines += [(column.removesuffix("_at"), f"{_clock(value)} UTC") for column, value in status.timestamps.items()
              if value is not None]
    lines.append(("results", status.results_path or "(not written yet)"))
    chain = _chain_line(status.job_id)
    if chain:
        lines.append(("chain", chain))
    if status.error:
        lines.append(("error", status.error))
    width = max(len(label) for label, _ in lines)
    table = "\n".join(f"{label:<{width}}  {value}" for label, value in lines)
    if workers:
        table += f"\n\nworkers\n{workers_table(workers, now or datetime.now(timezone.utc))}"
    return f"{table}\n\nevents (UTC)\n{events_table(events)}" if events else table


def document_line(status: JobStatus, documents: DocumentProgress) -> str:
    """`documents`' line of a job that split long documents: the documents, the parts under them, the reduce
    levels to go."""
    levels = f", {documents.levels_remaining} reduce level(s) to go" if documents.levels_remaining else ""
    return (f"{status.total - documents.parts} total, {documents.split} split ({documents.documents_done} done) into "
            f"{documents.parts} part(s), {documents.parts_done} done{levels}")


def events_table(events: Sequence[JobEvent]) -> str:
    """One line per event: time, kind, message and how long it took; a message's later lines are indented."""
    width = max(len(e.kind) for e in events)
    lines = []
    for event in events:
        took = f" (took {event.duration_s:.2f} s)" if event.duration_s is not None else ""
        first, *rest = event.message.splitlines() or [""]
        lead = f"{_clock(event.at)}  {event.kind:<{width}}  "
        lines.append(f"{lead}{first}{took}".rstrip())
        lines += [" " * len(lead) + line for line in rest]
    return "\n".join(lines)


def _wire_links(job_id: str) -> list[dict] | None:
    """Codec per link of the job's last run on this machine ([{from, to, codec}]), or None."""
    from layerbus.storage.run_info import read_run_info

    links = (read_run_info(job_id) or {}).get("wire")
    return links if isinstance(links, list) else None


def _stages(job_id: str) -> list[dict] | None:
    """Each stage of the job's last run on this machine ([{name, layers, weights, weight_bytes}]), or None."""
    from layerbus.storage.run_info import read_run_info

    stages = (read_run_info(job_id) or {}).get("stages")
    return stages if isinstance(stages, list) else None


def _chain_line(job_id: str) -> str | None:
    """The chain of the job's last run on this machine, with each link's codec, or None."""
    from layerbus.storage.run_info import chain_line, read_run_info

    return chain_line(read_run_info(job_id))


def jobs_table(jobs: list[JobStatus]) -> str:
    if not jobs:
        return "no jobs yet: queue one with `layerbus submit INPUT --task ...` or `layerbus run INPUT --task ...`"
    # Completed, failed and cancelled apart: a cancelled or all-failed job must not read as done.
    header = ("JOB", "STATUS", "TASK", "COMPLETED/TOTAL", "FAILED", "CANCELLED", "TOK/S", "CREATED (UTC)", "NAME")
    rows = [(s.job_id, _status_text(s), s.task, f"{s.completed}/{s.total}", str(s.failed), str(s.cancelled),
             f"{s.tokens_per_s:.1f}" if s.tokens_per_s is not None else "-",
             _clock(s.timestamps.get("created_at")), s.name) for s in jobs]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows])


def _status_text(status: JobStatus) -> str:
    """The job's state, saying so when a finished job produced nothing (OpenAI's Batch API calls a
    batch whose every request failed "completed"; the table must not let that pass unnoticed)."""
    if status.status == "completed" and status.total and not status.completed:
        return "completed (none succeeded)"
    return status.status


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _clock(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def duration_text(seconds: float) -> str:
    """A span of time as 42s, 3m07s or 2h05m00s (status's ETA, top's)."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
