"""Job events (what happened to a running job and how long it took): checking one before it is stored,
and reading them back. Shared by JobStore and the standard-library status path, so no SQLAlchemy here."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime

from layerbus.storage.status_records import JobEvent

# Events `layerbus status` shows and JobStore.job_events returns by default: the most recent ones.
DEFAULT_EVENT_LIMIT = 50
# Longest stored message; a longer one (a whole traceback) is cut, keeping its start, which names the failure.
MAX_EVENT_MESSAGE_CHARS = 2000
# Width of job_events.kind (String(32) in storage.schema).
MAX_EVENT_KIND_CHARS = 32
_CUT_MARK = " [...]"


def event_row(job_id: str, kind: str, message: str, duration_s: float | None, at: datetime) -> dict[str, object]:
    """The job_events row for one event; ValueError names a kind or duration the table cannot hold."""
    if not kind or len(kind) > MAX_EVENT_KIND_CHARS:
        raise ValueError(
            f"job event kind {kind!r} must be 1 to {MAX_EVENT_KIND_CHARS} characters, e.g. 'stage_lost'"
        )
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"job event {kind!r}: duration_s={duration_s!r} must be a finite number >= 0, or None")
    return {"job_id": job_id, "at": at, "kind": kind, "message": cut_message(message), "duration_s": duration_s}


def cut_message(message: str) -> str:
    if len(message) <= MAX_EVENT_MESSAGE_CHARS:
        return message
    return message[: MAX_EVENT_MESSAGE_CHARS - len(_CUT_MARK)] + _CUT_MARK


def events_oldest_first(newest_first: Iterable[tuple[datetime, str, str, float | None]]) -> list[JobEvent]:
    """JobEvents from (at, kind, message, duration_s) rows read newest first (the index's cheap direction)."""
    events = [JobEvent(at, kind, message, None if duration is None else float(duration))
              for at, kind, message, duration in newest_first]
    events.reverse()
    return events
