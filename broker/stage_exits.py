"""Stage processes someone else started, that ended for good: read from a folder where their launcher writes
one file per stage that ended (`layerbus broker --stage-exits DIR`; deploy/slurm/layerbus.sbatch writes
`<task>.exit` holding the stage's name and exit code when a stage task ends, since Slurm does not restart it).

The broker then stops waiting for those stages, and once every stage it was told of has ended and none is
registered, it stops at once, naming them and how each ended, instead of waiting for stages that will
never come (control.ControlPlane.children, the same watch a local cluster's supervisor keeps)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from layerbus.broker.control import StageExit

log = logging.getLogger("layerbus.broker")
_EXIT_LINE = re.compile(r"^\s*(?P<name>\S+)\s+(?P<code>-?\d+)(\s+(?P<pid>\d+))?\s*$")


class ExitFolder:
    """A ChildWatch over a folder of `*.exit` files, each "NAME CODE [PID]" (the stage's --name, its exit code,
    and its process id where the launcher knows it)."""

    max_restarts = 0  # nothing restarts them

    def __init__(self, folder: Path, watched: int):
        self.folder, self.watched = Path(folder), watched
        self.given_up: set[str] = set()
        self._read: set[str] = set()

    def check(self) -> list[StageExit]:
        exits = []
        try:
            paths = sorted(self.folder.glob("*.exit"))
        except OSError:
            return []
        for path in paths:
            if path.name in self._read:
                continue
            try:
                text = path.read_text()
            except OSError:
                continue
            match = _EXIT_LINE.match(text)
            if match is None:  # still being written, or not ours: read again next time
                continue
            self._read.add(path.name)
            name, code, pid = match.group("name"), int(match.group("code")), int(match.group("pid") or 0)
            self.given_up.add(name)
            why = f"its task ended with exit code {code}" if code >= 0 else f"its task was killed by signal {-code}"
            log.warning("stage %s: %s (%s); not restarted", name, why, path)
            exits.append(StageExit(name, pid, why, restarted=False, restarts=0))
        return exits
