"""Store transactions are never cut in half by a signal.

`layerbus run` and `layerbus broker` stop on SIGINT/SIGTERM by raising an exception wherever the main
thread is (launch/signals.py), so that `finally` blocks hand the items in flight back to the store. Raised
inside a transaction's context manager at the wrong instruction (in `__exit__`, before it resumes the
generator that commits), that exception leaves the transaction open and its SQLite write lock held by the
exception's own traceback: the hand-back's write then waits on its own process's lock for the whole busy
timeout and fails ("database is locked"), leaving every item in progress until its lease runs out.

So the store runs each transaction `guarded()`, and a signal handler asks `hold_until_closed` first: inside
a main-thread transaction, what the handler would raise is raised as the transaction closes, committed or
rolled back. Other threads' transactions are not guarded: signal handlers run in the main thread only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# How deep the main thread is in guarded transactions, and what a signal that came meanwhile left to do.
_depth = 0
_held: Callable[[], None] | None = None


@contextmanager
def guarded() -> Iterator[None]:
    """Run the block (one store transaction) with signal handlers' exceptions held until it has closed."""
    global _depth, _held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _held is not None:
            deliver, _held = _held, None
            deliver()  # raises: the signal's exception, now that the transaction is over


def hold_until_closed(deliver: Callable[[], None]) -> bool:
    """For a signal handler (main thread): inside a guarded transaction, keep `deliver` (which raises) to
    run as it closes, and return True; outside one, False (the handler raises at once)."""
    global _held
    if _depth == 0:
        return False
    if _held is None:
        _held = deliver
    return True
