"""Stopping long-running commands cleanly: the first SIGINT or SIGTERM raises `Interrupted` where the
program is, so `finally` blocks requeue items and stop stages; later ones are ignored until that is done."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(KeyboardInterrupt):
    """Raised by the first SIGINT (Ctrl-C) or SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.getsignal(signum) for signum in handled}

    def while_stopping(signum: int, frame: object) -> None:
        print(f"layerbus: {signal.Signals(signum).name} received while stopping; still stopping, please wait",
              file=sys.stderr)

    def first(signum: int, frame: object) -> None:
        for other in handled:
            signal.signal(other, while_stopping)
        raise Interrupted(signum)

    for signum in handled:
        signal.signal(signum, first)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
