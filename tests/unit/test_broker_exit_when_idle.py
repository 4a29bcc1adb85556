"""`layerbus broker --exit-when-idle`: the exit code decision as a table test, and the usage error it makes with
one job. tests/cluster/test_broker_exit_when_idle.py serves a job with real processes, then exits."""

from __future__ import annotations

import pytest

from layerbus.cli.broker_service import exit_code_when_idle
from layerbus.cli.main import main as cli_main


@pytest.mark.parametrize("final_states, code", [
    ([], 0),  # nothing queued for this model: nothing failed
    (["completed"], 0),
    (["completed", "completed"], 0),
    (["completed", "failed"], 1),  # a failed job fails the batch job that ran it
    (["cancelled"], 1),
])
def test_exit_code_when_idle(final_states, code):
    assert exit_code_when_idle(final_states) == code


def test_exit_when_idle_with_one_job_is_a_usage_error(capsys):
    assert cli_main(["broker", "--stages", "1", "--exit-when-idle", "--job", "job_000000000000"]) == 2
    assert "drop one" in capsys.readouterr().err
