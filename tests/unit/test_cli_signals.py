"""The first SIGINT stops a long-running command even when it lands inside a finalizer, where Python
drops exceptions (launch/signals.py): a real signal, sent to this process."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import pytest

from layerbus.launch.signals import Interrupted, stop_on_signals
from layerbus.storage import JobSettings, JobStore, NewItem


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


def test_a_signal_that_lands_as_a_store_write_closes_is_raised_once_it_committed(tmp_path, monkeypatch) -> None:
    """A stopped run hands its items back in a `finally`, while the interrupt propagates. Raised inside a
    store method, at the first instruction of the write transaction's context-manager `__exit__` (StoreDb.write,
    before it resumes the generator that commits), an unguarded interrupt would leave that transaction open
    and its write lock held by the exception's own traceback: the hand-back would then wait on its own
    process's lock for the whole busy timeout and fail, "database is locked", with every item left in
    progress. A signal inside a store transaction is raised once it has closed."""
    monkeypatch.setattr("layerbus.storage.engine.SQLITE_BUSY_TIMEOUT_MS", 500)  # fail in 0.5 s, not 30
    with JobStore.open(f"sqlite:///{tmp_path / 'jobs.db'}") as store:
        job_id = store.create_job(JobSettings(task="generate", model="tiny"), [NewItem("a", "a", "a", {}, 0)])
        landed: list[str] = []

        def signal_as_write_closes(frame, event, arg) -> None:
            if (event == "call" and not landed and frame.f_code.co_name == "__exit__"
                    and frame.f_code.co_filename == contextlib.__file__
                    and getattr(frame.f_locals["self"], "gen", None) is not None
                    and frame.f_locals["self"].gen.gi_code.co_name == "write"
                    and frame.f_locals["self"].gen.gi_code.co_filename.endswith("store_db.py")):
                landed.append("SIGTERM")
                os.kill(os.getpid(), signal.SIGTERM)

        with pytest.raises(Interrupted):
            with stop_on_signals():
                try:
                    sys.setprofile(signal_as_write_closes)
                    store.add_job_event(job_id, "note", "written as the signal came")
                finally:
                    sys.setprofile(None)
                    store.add_job_event(job_id, "note", "handed back")  # as jobs/runner's _hand_back does
        assert landed == ["SIGTERM"]
        assert [event.message for event in store.job_events(job_id)][-2:] == ["written as the signal came",
                                                                              "handed back"]
