"""A job's input stored a chunk at a time: nothing runs before the whole input passed, and a refused input
leaves nothing behind (real SQLite store, real JSONL files, chunks of three items)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerbus.jobs.inputs import FirstIds, stream_outcomes
from layerbus.jobs.intake import ItemsRefused, JobIntake
from layerbus.jobs.records import InputError
from layerbus.storage.errors import StoreError
from layerbus.storage.records import JobSettings, NewItem
from layerbus.storage.store import JobStore

SETTINGS = JobSettings(task="summarize", model="m", name="streamed")


@pytest.fixture
def store(tmp_path: Path):
    with JobStore.open(f"sqlite:///{tmp_path / 'store.db'}") as opened:
        yield opened


def write_lines(path: Path, count: int, bad: dict[int, str] | None = None) -> Path:
    lines = [json.dumps({"id": f"doc-{n}", "text": f"document {n}"}) for n in range(1, count + 1)]
    for number, text in (bad or {}).items():
        lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


def submit(store: JobStore, path: Path, skip_invalid: bool = False, prepare=None) -> tuple[str, JobIntake]:
    ids = FirstIds()
    intake = JobIntake(store, SETTINGS, ids, skip_invalid, str(path), chunk_items=3)
    prepare = prepare or (lambda r: NewItem(r.custom_id, r.text, f"Summarize: {r.text}", {}, r.line))
    intake.add_all(stream_outcomes(path, "summarize", ids), prepare)
    return intake.finish(), intake


def test_a_streamed_job_is_validating_until_its_whole_input_passed(store, tmp_path):
    seen = []

    def prepare(record):
        status = store.job_status(store.latest_job_id())
        seen.append((status.status, status.total, store.next_runnable_job()))
        return NewItem(record.custom_id, record.text, f"Summarize: {record.text}", {}, record.line)

    job_id, _ = submit(store, write_lines(tmp_path / "in.jsonl", 10), prepare=prepare)
    assert seen[-1] == ("validating", 9, None), "chunks are stored as they fill, and nothing is runnable"
    status = store.job_status(job_id)
    assert (status.status, status.total, status.queued) == ("queued", 10, 10)
    assert [item.custom_id for item in store.job_items(job_id)] == [f"doc-{n}" for n in range(1, 11)]


def test_a_refused_input_leaves_nothing_behind_and_names_every_bad_line(store, tmp_path):
    path = write_lines(tmp_path / "in.jsonl", 10, {8: "{oops", 9: json.dumps({"id": "doc-1", "text": "again"})})
    with pytest.raises(InputError) as raised:
        submit(store, path)  # two chunks were stored before line 8
    lines = str(raised.value).splitlines()
    assert lines[0].startswith(f"{path}:8: malformed JSON")
    assert lines[1] == f"{path}:9: duplicate id 'doc-1': line 1 has it already"
    assert store.list_jobs() == [] and store.next_runnable_job() is None


def test_items_the_job_refuses_leave_nothing_behind(store, tmp_path):
    def refuse_seven(record):
        return "no" if record.line == 7 else NewItem(record.custom_id, record.text, "p", {}, record.line)

    with pytest.raises(ItemsRefused, match=r"in.jsonl:7: no"):
        submit(store, write_lines(tmp_path / "in.jsonl", 10), prepare=refuse_seven)
    assert store.list_jobs() == []


def test_a_job_cancelled_while_it_is_filled_stays_cancelled_and_the_submit_stops(store, tmp_path):
    def cancel_at_five(record):
        if record.line == 5:
            store.cancel_job(store.latest_job_id())  # `layerbus cancel` from another shell
        return NewItem(record.custom_id, record.text, "p", {}, record.line)

    path = write_lines(tmp_path / "in.jsonl", 10)
    with pytest.raises(StoreError, match="is cancelled: items are added only while it is validating"):
        submit(store, path, prepare=cancel_at_five)  # the chunk after the cancel is refused
    (status,) = store.list_jobs()
    assert (status.status, status.total, status.cancelled, status.queued) == ("cancelled", 3, 3, 0)
    assert store.next_runnable_job() is None


def test_skip_invalid_queues_the_rest_and_records_the_bad_lines_failed(store, tmp_path):
    path = write_lines(tmp_path / "in.jsonl", 10, {4: "{oops", 9: json.dumps({"id": "line-4", "text": "mine"})})
    job_id, intake = submit(store, path, skip_invalid=True)
    status = store.job_status(job_id)
    assert (status.status, status.total, status.queued, status.failed, intake.invalid_count) == ("queued", 10, 9, 1, 1)
    (failed,) = [r for r in store.item_results(job_id) if r["status"] == "failed"]
    # "line-4" belongs to line 9, which comes after the bad line: the failed record's id steps aside.
    assert (failed["custom_id"], failed["seq"], failed["input"]) == ("line-4-2", 4, "{oops")


def test_an_interrupted_submit_leaves_nothing_behind(store, tmp_path):
    def interrupt_at_eight(record):
        if record.line == 8:
            raise KeyboardInterrupt
        return NewItem(record.custom_id, record.text, "p", {}, record.line)

    with pytest.raises(KeyboardInterrupt):
        submit(store, write_lines(tmp_path / "in.jsonl", 10), prepare=interrupt_at_eight)
    assert store.list_jobs() == []
