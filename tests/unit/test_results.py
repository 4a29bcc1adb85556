"""ResultWriter: numbered parts, the files under a final name, and the merged job file.
tests/cluster/test_results.py kills a writer mid-write."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layerbus.storage.records import InvalidItem, ItemResult, JobSettings, NewItem
from layerbus.storage.results import RESULT_SCHEMA, ResultWriter, read_results, results_metadata, settings_metadata
from layerbus.storage.store import JobStore
from tests.helpers.result_rows import JOB, row


def test_parts_are_numbered_and_finalize_keeps_each_custom_id_once(tmp_path: Path) -> None:
    writer = ResultWriter(tmp_path, JOB)
    first = writer.write_part([row("b", 1, "first try"), row("a", 0)])
    second = writer.write_part([row("b", 1, "retry"), row("c", 2)])
    assert (first.name, second.name) == ("part-00001.parquet", "part-00002.parquet")
    assert first.parent == tmp_path / JOB
    submit_failure = {"custom_id": "d", "seq": 3, "input": "{bad", "error": "line 4: not JSON", "status": "failed",
                      "finish_reason": "error"}  # fmt: skip
    metadata = settings_metadata(JOB, "tiny-model", {"task": "generate", "max_new_tokens": 16})
    final = writer.finalize(metadata, store_rows=[submit_failure, row("c", 2, "from the store")])
    assert final == tmp_path / f"{JOB}.parquet"
    table = read_results(final)
    assert table.column_names == RESULT_SCHEMA.names
    assert [(r["custom_id"], r["output"]) for r in table.to_pylist()] == [
        ("a", "out"), ("b", "retry"), ("c", "from the store"), ("d", None),
    ]  # fmt: skip
    assert results_metadata(final) == {
        "job_id": JOB, "model": "tiny-model", "settings": json.dumps({"max_new_tokens": 16, "task": "generate"}),
    }  # fmt: skip
    assert not (tmp_path / JOB).exists(), "parts are deleted after a successful finalize"


def test_a_restarted_writer_continues_the_numbering(tmp_path: Path) -> None:
    ResultWriter(tmp_path, JOB).write_part([row("a", 0)])
    ResultWriter(tmp_path, JOB).write_part([row("b", 1)])
    third = ResultWriter(tmp_path, JOB).write_part([row("c", 2)])
    assert third.name == "part-00003.parquet"


def test_a_half_written_temporary_is_ignored_and_removed(tmp_path: Path) -> None:
    writer = ResultWriter(tmp_path, JOB)
    writer.write_part([row("a", 0)])
    garbage = tmp_path / JOB / "part-00002.parquet.tmp"
    garbage.write_bytes(b"PAR1 truncated by a kill")
    (tmp_path / f"{JOB}.parquet.tmp").write_bytes(b"half a final file")
    (tmp_path / "job_other.parquet.tmp").write_bytes(b"another job's writer is busy with this")
    restarted = ResultWriter(tmp_path, JOB)
    assert not garbage.exists() and not (tmp_path / f"{JOB}.parquet.tmp").exists()
    assert (tmp_path / "job_other.parquet.tmp").exists()
    assert restarted.write_part([row("b", 1)]).name == "part-00002.parquet"
    assert read_results(restarted.finalize({})).column("custom_id").to_pylist() == ["a", "b"]


def test_finalize_again_after_more_parts_keeps_earlier_rows_and_metadata(tmp_path: Path) -> None:
    writer = ResultWriter(tmp_path, JOB)
    writer.write_part([row("a", 0), row("b", 1, "failed once")])
    writer.finalize(settings_metadata(JOB, "m", {"seed": 1}))
    retry = ResultWriter(tmp_path, JOB)
    assert retry.write_part([row("b", 1, "second run")]).name == "part-00001.parquet"
    final = retry.finalize({})
    assert [r["output"] for r in read_results(final).to_pylist()] == ["out", "second run"]
    assert results_metadata(final)["model"] == "m"


def test_finalize_with_rows_from_a_real_store(tmp_path: Path) -> None:
    with JobStore.open(f"sqlite:///{tmp_path / 'store.db'}") as store:
        items = [NewItem(f"id-{i}", f"text {i}", f"p {i}", {}, i) for i in (0, 2)]
        refused = [InvalidItem("id-1", "?", "empty", 1)]
        job_id = store.create_job(JobSettings(task="generate", model="m"), items, refused)
        writer = ResultWriter(tmp_path / "results", job_id)
        claimed = store.claim_items(job_id, "w", 10)
        results = [ItemResult(c.item_id, f"out {c.custom_id}", "stop", 2, 3, 0.1) for c in claimed]
        store.complete_items(results)
        writer.write_part([row(c.custom_id, i * 2, f"out {c.custom_id}") for i, c in enumerate(claimed)])
        failed_at_submit = [r for r in store.item_results(job_id) if r["status"] == "failed"]
        final = writer.finalize(settings_metadata(job_id, "m", {}), store_rows=failed_at_submit)
    assert [(r["custom_id"], r["status"], r["error"]) for r in read_results(final).to_pylist()] == [
        ("id-0", "completed", None), ("id-1", "failed", "empty"), ("id-2", "completed", None),
    ]  # fmt: skip


def test_finalize_of_a_job_without_rows_writes_an_empty_file(tmp_path: Path) -> None:
    final = ResultWriter(tmp_path, JOB).finalize({"model": "m"})
    assert read_results(final).num_rows == 0 and results_metadata(final)["job_id"] == JOB


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "write_part got no rows for job 'job_0123456789ab'"),
        ([{"custom_id": "a", "outptu": "typo"}], r"result row 0 has unknown column\(s\) \['outptu'\]"),
        ([{"output": "no id"}], "result row 0 needs a custom_id string, got None"),
    ],
)
def test_bad_rows_are_refused(tmp_path: Path, rows: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ResultWriter(tmp_path, JOB).write_part(rows)


def test_metadata_for_another_job_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="names job 'job_other' but this writer is for 'job_0123456789ab'"):
        ResultWriter(tmp_path, JOB).finalize({"job_id": "job_other"})


def test_named_writers_sharing_a_folder_write_their_own_parts_and_finalize_merges_all(tmp_path: Path) -> None:
    first, second = ResultWriter(tmp_path, JOB, writer="box:11:aa"), ResultWriter(tmp_path, JOB, writer="box:22:bb")
    paths = [first.write_part([row("a", 0)]), second.write_part([row("b", 1)]), first.write_part([row("c", 2)])]
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [
        f"{JOB}/box-11-aa/part-00001.parquet", f"{JOB}/box-22-bb/part-00001.parquet",
        f"{JOB}/box-11-aa/part-00002.parquet"]
    assert sorted(first.part_paths()) == sorted(second.part_paths()) == sorted(paths), "each sees every part"
    final = second.finalize({})
    assert read_results(final).column("custom_id").to_pylist() == ["a", "b", "c"]
    assert not (tmp_path / JOB).exists(), "every writer's parts go once the final file holds them"


def test_a_writer_that_did_not_finalize_discards_only_its_own_parts(tmp_path: Path) -> None:
    mine, theirs = ResultWriter(tmp_path, JOB, writer="box:11:aa"), ResultWriter(tmp_path, JOB, writer="box:22:bb")
    mine.write_part([row("a", 0)])
    kept = theirs.write_part([row("b", 1)])
    mine.discard_parts()
    assert [p for p in theirs.part_paths()] == [kept]
    theirs.discard_parts()
    assert not (tmp_path / JOB).exists(), "the last one out removes the job's folder"


def test_another_live_processs_temporary_is_left_alone_and_a_dead_ones_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    live_tmp = tmp_path / f"{JOB}.parquet.{os.getppid()}.tmp"  # a finalizing broker's file in progress
    dead_tmp = tmp_path / f"{JOB}.parquet.{dead.pid}.tmp"
    live_tmp.write_bytes(b"being written")
    dead_tmp.write_bytes(b"half written by a killed finalizer")
    ResultWriter(tmp_path, JOB, writer="box:11:aa")
    assert live_tmp.exists() and dead_tmp.exists(), "a named writer leaves the final file's temporaries alone"
    ResultWriter(tmp_path, JOB).finalize({})
    assert live_tmp.exists() and not dead_tmp.exists()


@pytest.mark.parametrize(("writer", "folder"), [("gpu-3:4242:9f3a", "gpu-3-4242-9f3a"),
                                                ("a/b:1:c d", "a-b-1-c-d"), ("..", None)])
def test_a_writers_folder_is_its_name_made_safe(writer: str, folder: str | None) -> None:
    from layerbus.storage.results import writer_folder

    if folder is None:
        with pytest.raises(ValueError, match="leaves no folder name"):
            writer_folder(writer)
    else:
        assert writer_folder(writer) == folder


def test_results_head_shows_the_sample_column_only_where_an_item_has_several(tmp_path: Path) -> None:
    from layerbus.cli.results import head_table

    single = tmp_path / "single.parquet"
    pq.write_table(pa.Table.from_pylist([{**row("a", 1), "sample_index": 0}, {**row("b", 2), "sample_index": 0}]),
                   single)
    assert head_table(single, 5).splitlines()[0].split()[:2] == ["CUSTOM_ID", "STATUS"]
    several = tmp_path / "several.parquet"
    pq.write_table(pa.Table.from_pylist([{**row("a", 1, "first"), "sample_index": 0},
                                         {**row("a", 1, "second"), "sample_index": 1}]), several)
    lines = head_table(several, 5).splitlines()
    assert lines[0].split()[:3] == ["CUSTOM_ID", "SAMPLE", "STATUS"]
    assert [line.split()[:2] for line in lines[1:]] == [["a", "0"], ["a", "1"]], "the two rows told apart"
    older = tmp_path / "older.parquet"  # a file written before the column existed
    pq.write_table(pa.Table.from_pylist([row("a", 1)]), older)
    assert head_table(older, 5).splitlines()[1].split()[:2] == ["a", "completed"]
