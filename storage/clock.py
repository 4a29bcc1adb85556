"""The store's clock: every store call takes `now` (tests pass theirs in) and reads the real clock when given
none. Standard library only: the driver-only path (storage/light_sql.py) reads it too."""

from __future__ import annotations

from datetime import datetime, timezone


def utc_now(now: datetime | None) -> datetime:
    """The injected clock reading, or the real one; naive times are refused (local? UTC?)."""
    if now is None:
        return datetime.now(timezone.utc)
    if now.tzinfo is None:
        raise ValueError(
            f"naive datetime {now.isoformat()} given to the job store: "
            "pass an aware one, e.g. datetime.now(timezone.utc)"
        )
    return now
