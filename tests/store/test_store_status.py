"""Pure parts of the store: the job lifecycle table and how a JobStatus is computed from aggregates."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from layerbus.storage.errors import StoreError
from layerbus.storage.records import JobSettings
from layerbus.storage.states import JOB_STATES, JOB_TRANSITIONS, TIMESTAMP_COLUMNS, check_job_transition
from layerbus.storage.status import StateAggregate, build_job_status

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("current", "target", "allowed"),
    [
        ("validating", "queued", True),
        ("queued", "in_progress", True),
        ("in_progress", "finalizing", True),
        ("finalizing", "completed", True),
        ("in_progress", "failed", True),
        ("cancelling", "cancelled", True),
        ("in_progress", "completed", False),
        ("queued", "cancelled", False),
        ("completed", "failed", False),
        ("cancelled", "queued", False),
        ("failed", "in_progress", False),
        ("in_progress", "in_progress", False),
    ],
)
def test_job_transitions(current: str, target: str, allowed: bool) -> None:
    if allowed:
        check_job_transition("job_1", current, target)
    else:
        with pytest.raises(StoreError, match=f"job 'job_1' cannot move from {current} to {target}"):
            check_job_transition("job_1", current, target)


def test_every_state_has_a_transition_entry_and_a_timestamp() -> None:
    assert set(JOB_TRANSITIONS) == set(JOB_STATES)
    assert all(targets <= set(JOB_STATES) for targets in JOB_TRANSITIONS.values())
    assert TIMESTAMP_COLUMNS[:2] == ("created_at", "queued_at") and len(TIMESTAMP_COLUMNS) == len(JOB_STATES)


def test_final_states_name_themselves_final() -> None:
    with pytest.raises(StoreError, match=r"moves from completed: none: it is final"):
        check_job_transition("job_1", "completed", "failed")


def _job(status: str, **stamps: datetime) -> dict:
    row = {c: None for c in TIMESTAMP_COLUMNS}
    row.update(id="job_1", name="n", task="generate", model="m", status=status, total_count=10,
               results_path=None, error=None, created_at=T0, queued_at=T0, **stamps)  # fmt: skip
    return row


@pytest.mark.parametrize(
    ("job", "aggregates", "now_s", "tokens_per_s", "eta_s"),
    [
        # Not started: no rate, no ETA.
        (_job("queued"), [StateAggregate("queued", 10, 0, 0, 0)], 50, None, None),
        # Running 40 s, 4 finished items and 200 tokens: 5 tok/s, 6 items left at 10 s each.
        (
            _job("in_progress", in_progress_at=T0 + timedelta(seconds=10)),
            [StateAggregate("completed", 4, 4, 40, 200), StateAggregate("queued", 5, 0, 0, 0),
             StateAggregate("in_progress", 1, 1, 0, 0)],
            50, 5.0, 60.0,
        ),
        # Items refused at submit (ran == 0) do not count as pace.
        (
            _job("in_progress", in_progress_at=T0),
            [StateAggregate("failed", 3, 0, 0, 0), StateAggregate("queued", 7, 0, 0, 0)],
            10, 0.0, None,
        ),
        # Finished: the rate stops at finalizing, the ETA is gone.
        (
            _job("completed", in_progress_at=T0, finalizing_at=T0 + timedelta(seconds=20),
                 completed_at=T0 + timedelta(seconds=21)),
            [StateAggregate("completed", 10, 10, 0, 100)],
            1000, 5.0, None,
        ),
    ],
)  # fmt: skip
def test_throughput_and_eta(job: dict, aggregates: list, now_s: int, tokens_per_s, eta_s) -> None:
    status = build_job_status(job, aggregates, T0 + timedelta(seconds=now_s))
    assert (status.tokens_per_s, status.eta_s) == (tokens_per_s, eta_s)
    assert sum(status.counts.values()) == sum(a.count for a in aggregates)
    assert set(status.counts) == {"queued", "in_progress", "completed", "failed", "cancelled", "waiting"}


def test_settings_round_trip_keeps_unknown_keys() -> None:
    settings = JobSettings(task="translate", model="m", target_language="fr", extra={"stop": ["\n"]})
    assert JobSettings.from_json(settings.to_json()) == settings
    newer = settings.to_json().replace('"task"', '"new_knob": 3, "task"')
    assert JobSettings.from_json(newer).extra == {"stop": ["\n"], "new_knob": 3}
