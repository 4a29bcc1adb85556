"""ResultWriter's crash safety: a writer process killed with SIGKILL at a random moment never leaves an
unreadable file under a final name."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq

from layerbus.storage.results import RESULT_SCHEMA, ResultWriter, read_results
from tests.helpers.result_rows import JOB, row


def assert_every_final_name_readable(folder: Path) -> None:
    for path in folder.rglob("*.parquet"):
        assert pq.read_table(path).schema.names[:9] == RESULT_SCHEMA.names[:9], path


def _write_parts_forever(results_dir: str) -> None:
    """A writer that never stops; the test kills it with SIGKILL at a random moment."""
    writer = ResultWriter(Path(results_dir), JOB)
    batch = [row(f"id-{i}", i, "x" * 300) for i in range(4000)]
    while True:
        writer.write_part(batch)


def test_a_writer_killed_mid_write_never_leaves_an_unreadable_final_name(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    parts = tmp_path / JOB
    for attempt in range(3):
        before = len(list(parts.glob("part-*.parquet")))
        child = context.Process(target=_write_parts_forever, args=(str(tmp_path),))
        child.start()
        deadline = time.monotonic() + 60
        while len(list(parts.glob("part-*.parquet"))) < before + 2 and time.monotonic() < deadline:
            assert child.is_alive(), f"writer exited with {child.exitcode}"
            time.sleep(0.01)
        time.sleep(random.uniform(0, 0.05))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        assert_every_final_name_readable(tmp_path)
    numbers = sorted(int(p.name[5:10]) for p in parts.glob("part-*.parquet"))
    assert numbers == list(range(1, len(numbers) + 1)), "restarts continue the numbering without gaps"
    restarted = ResultWriter(tmp_path, JOB)
    assert list(parts.glob("*.tmp")) == []
    assert restarted.write_part([row("late", 99_999)]).name == f"part-{numbers[-1] + 1:05d}.parquet"
    final = restarted.finalize({"model": "m"})
    assert read_results(final).num_rows == 4001
