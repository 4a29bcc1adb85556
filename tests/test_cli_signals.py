"""The first SIGINT stops a long-running command even when it lands inside a finalizer, where Python
drops exceptions (cli/signals.py): a real signal, sent to this process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from layerbus.cli.signals import Interrupted, stop_on_signals


class SignalsWhileFinalized:
    """Sends SIGINT to this process from its finalizer; the handler runs inside __del__."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # Python runs the pending handler here, within the finalizer
            pass


def test_an_interrupt_that_lands_in_a_finalizer_is_delivered_again() -> None:
    with pytest.raises(Interrupted) as raised:
        with stop_on_signals():
            SignalsWhileFinalized()  # finalized at once
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.01)
    assert raised.value.exit_code == 128 + signal.SIGINT


def test_an_interrupt_raises_where_the_program_is_and_the_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs in the background, as on CI
    with pytest.raises(Interrupted):
        with stop_on_signals():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
    assert signal.getsignal(signal.SIGINT) == before
