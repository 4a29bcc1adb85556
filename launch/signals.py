"""Stopping long-running commands cleanly: the first SIGINT or SIGTERM raises `Interrupted` where the
program is, so `finally` blocks requeue items and stop stages; later ones are ignored until that is done.
One that lands inside a finalizer, where Python drops exceptions, is delivered again; one that lands inside
a store transaction is raised as the transaction closes (storage/signal_guard.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from layerbus.storage.signal_guard import hold_until_closed


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
        if hold_until_closed(lambda: _raise(Interrupted(signum))):
            return  # inside a store transaction: raised as it closes (storage/signal_guard.py says why)
        raise Interrupted(signum)

    previous_hook = sys.unraisablehook

    def redeliver(unraisable) -> None:
        # The signal landed while a finalizer ran (a ZeroMQ frame's __dealloc__, say), where Python
        # prints the exception and drops it: the command would go on as if never interrupted. Arm
        # the handler again and send the signal once more from a thread, a moment later, when the
        # finalizer is over (raised here, it would land in this hook and be dropped again).
        if isinstance(unraisable.exc_value, Interrupted):
            for other in handled:
                signal.signal(other, first)
            threading.Timer(0.05, os.kill, (os.getpid(), unraisable.exc_value.signum)).start()
            return
        previous_hook(unraisable)

    for signum in handled:
        signal.signal(signum, first)
    sys.unraisablehook = redeliver
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _raise(interrupted: Interrupted) -> None:
    raise interrupted
