"""Stage tasks someone else started, that ended for good (broker/stage_exits.py: the files an sbatch's stage
tasks leave): each is read once, a half-written or foreign file is left for later, and the broker's control
plane stops waiting for them and says when none can come back."""

from __future__ import annotations

import pytest
import zmq

from layerbus.broker.control import ControlPlane, StagesGone
from layerbus.broker.stage_exits import ExitFolder


def test_each_exit_is_read_once_with_how_it_ended(tmp_path):
    folder = ExitFolder(tmp_path, watched=2)
    assert folder.check() == []
    (tmp_path / "task-1.exit").write_text("node-task-1 137 4242\n")
    (tmp_path / "task-2.tmp").write_text("node-task-2 0")  # still being written: not an exit yet
    (tmp_path / "notes.exit").write_text("not what a launcher writes")
    [ended] = folder.check()
    assert (ended.name, ended.pid, ended.restarted) == ("node-task-1", 4242, False)
    assert ended.why == "its task ended with exit code 137"
    assert folder.check() == [], "read once"
    (tmp_path / "task-2.exit").write_text("node-task-2 -9")
    [killed] = folder.check()
    assert killed.pid == 0 and killed.why == "its task was killed by signal 9"
    assert folder.given_up == {"node-task-1", "node-task-2"}


def test_the_broker_stops_waiting_once_every_stage_task_has_ended(tmp_path):
    context = zmq.Context()
    plane = ControlPlane(context)
    try:
        plane.children = ExitFolder(tmp_path, watched=2)
        (tmp_path / "task-1.exit").write_text("node-task-1 3 11")
        (tmp_path / "task-2.exit").write_text("node-task-2 1 12")
        with pytest.raises(StagesGone) as gone:
            plane.wait_for_stages(2, timeout_s=60)
        message = str(gone.value)
        assert "none of the 2 stages can serve" in message
        assert "node-task-1 (pid 11) its task ended with exit code 3" in message
        assert "node-task-2 (pid 12) its task ended with exit code 1" in message
        assert plane.none_can_come_back()
    finally:
        plane.close()
        context.destroy(linger=0)
