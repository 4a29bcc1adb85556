"""`layerbus top [JOB]`: a running job's stages as they work, refreshed in place like htop (one frame with
--once). Read-only and light enough to leave running (no torch, no transformers; on a SQLite store not even
SQLAlchemy): it reads the job's status and the stage snapshots its broker writes into the store every few
seconds (jobs/snapshot_keeper.py), so it works from any machine that reaches the store.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from layerbus.cli.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError
from layerbus.cli.options import add_db, command_parser, open_store, positive_float
from layerbus.cli.top_frame import DEFAULT_STALE_AFTER_S, top_frame
from layerbus.storage.states import FINAL_JOB_STATES

if TYPE_CHECKING:
    from layerbus.storage import JobStatus, JobStore
    from layerbus.storage.snapshot_records import StageSnapshot

REFRESH_S = 2.0
# Terminal control: the alternate screen (the shell's screen comes back on exit, as with htop), cursor
# hidden; each frame homes the cursor and clears what the last one left beyond its lines.
_ENTER, _LEAVE = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"
_HOME, _CLEAR_LINE, _CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    with command_parser(subparsers, "top", main,
                        help="watch a job's stages as they work (host, layers, busy %%, step time, memory, links)",
                        description="A job's progress and ETA, and for each stage its host, layer span, "
                                    "weight format, wire codec, state, busy %%, step time, steps, memory "
                                    "against its budget, link MB/s and seconds since its broker last heard "
                                    "from it, refreshed in place; q or Ctrl-C quits. Read from the store, "
                                    "where the broker writes a snapshot of its stages every few seconds: "
                                    "works from any machine that reaches the store. Not on a terminal, it "
                                    "prints a frame per refresh until the job ends.") as parser:
        parser.add_argument("job", metavar="JOB", nargs="?",
                            help="job id (default: the newest running job, followed as jobs start; else the newest "
                                 "job)")
        parser.add_argument("--once", action="store_true", help="print one frame and exit")
        parser.add_argument("--interval", metavar="S", type=positive_float, default=REFRESH_S,
                            help=f"seconds between refreshes (default: {REFRESH_S:g})")
        parser.add_argument("--stale-after", metavar="S", type=positive_float, default=DEFAULT_STALE_AFTER_S,
                            help="show a broker's stages as stale when its snapshot is older than this "
                                 f"(default: {DEFAULT_STALE_AFTER_S:g} s)")
        add_db(parser)


def main(args: argparse.Namespace) -> int:
    reader = TopReader(args.db)
    try:
        if args.once:
            job_id = args.job or reader.running_job(None)
            print(reader.frame(job_id, args.stale_after, None)[1])
            return EXIT_OK
        if sys.stdout.isatty():
            return _interactive(reader, args.job, args.interval, args.stale_after)
        return _frames(reader, args.job, args.interval, args.stale_after)
    finally:
        reader.close()


class TopReader:
    """The job's status and stage snapshots from the store: through its driver alone (sqlite3 or psycopg,
    storage/direct_status.py) where it can answer, else one JobStore kept open across frames."""

    def __init__(self, url: str | None):
        from layerbus.storage.locations import default_db_url

        self.url = url or default_db_url()
        self._store: JobStore | None = None

    def running_job(self, shown: str | None) -> str:
        """The newest in_progress job; else `shown` (the job on screen), else the newest job."""
        job_id = self._latest("in_progress") or shown or self._latest(None)
        if job_id is None:
            raise UsageError(f"no jobs in {self.url} yet: queue one with `layerbus submit` or `layerbus run`")
        return job_id

    def _latest(self, status: str | None) -> str | None:
        from layerbus.storage.direct_status import read_latest_job_ids

        found = read_latest_job_ids(self.url, status)
        if found is None:
            return self.store().latest_job_id(status)
        return found[0] if found else None

    def frame(self, job_id: str, stale_after_s: float, width: int | None) -> tuple[JobStatus, str]:
        """The job's status and its frame as of now."""
        status, snapshots = self.read(job_id)
        return status, top_frame(status, snapshots, datetime.now(timezone.utc), stale_after_s, width)

    def read(self, job_id: str) -> tuple[JobStatus, list[StageSnapshot]]:
        from layerbus.storage.direct_status import read_job_status, read_stage_snapshots

        status = read_job_status(self.url, job_id)
        snapshots = read_stage_snapshots(self.url, job_id) if status is not None else None
        if status is None or snapshots is None:  # not a SQLite file, an unknown job: the store's own answer
            store = self.store()
            status, snapshots = store.job_status(job_id), store.stage_snapshots(job_id)
        return status, snapshots

    def store(self) -> JobStore:
        if self._store is None:
            self._store = open_store(self.url)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def _frames(reader: TopReader, job: str | None, interval_s: float, stale_after_s: float) -> int:
    """Not on a terminal (a pipe, a log): one frame per refresh, a blank line apart, until the job has
    ended; exit 0 if it completed, 1 otherwise (as `status --watch`)."""
    job_id = job or reader.running_job(None)
    try:
        while True:
            status, frame = reader.frame(job_id, stale_after_s, None)
            print(frame + "\n", flush=True)
            if status.status in FINAL_JOB_STATES:
                return EXIT_OK if status.status == "completed" else EXIT_FAILED
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _interactive(reader: TopReader, job: str | None, interval_s: float, stale_after_s: float) -> int:
    """Redraw in place on the alternate screen until q or Ctrl-C; without JOB, follow the newest running job."""
    keys = QuitKey(sys.stdin) if sys.stdin.isatty() else None
    out = sys.stdout
    out.write(_ENTER)
    shown: str | None = None
    try:
        while True:
            shown = job or reader.running_job(shown)
            size = shutil.get_terminal_size()
            _, frame = reader.frame(shown, stale_after_s, size.columns)
            hint = f"q quits; refreshed every {interval_s:g} s"[:size.columns]
            lines = frame.splitlines()[:max(1, size.lines - 2)] + ["", hint]
            out.write(_HOME + "".join(line + _CLEAR_LINE + "\n" for line in lines[:-1]) + lines[-1] + _CLEAR_BELOW)
            out.flush()
            if keys is not None and keys.wait(interval_s):
                return EXIT_OK
            if keys is None:
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        if keys is not None:
            keys.close()
        out.write(_LEAVE)
        out.flush()


class QuitKey:
    """`q` typed on the terminal, read as it is typed (cbreak mode: no Enter needed, Ctrl-C still
    interrupts); the terminal's mode is restored by close()."""

    def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
        import termios
        import tty

        self._termios = termios
        self.fd = stream.fileno()
        self.saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd)

    def wait(self, seconds: float) -> bool:
        """Wait up to `seconds`; True as soon as q (or Q) is typed. Other keys are ignored."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                return False
            key = os.read(self.fd, 1)
            if key in (b"q", b"Q"):
                return True
            if not key:  # the terminal went away: nothing more to read, just wait
                time.sleep(max(0.0, deadline - time.monotonic()))
        return False

    def close(self) -> None:
        self._termios.tcsetattr(self.fd, self._termios.TCSADRAIN, self.saved)
