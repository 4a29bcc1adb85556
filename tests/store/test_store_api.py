"""The API server's part of the store (storage/api_store.py) on SQLite and PostgreSQL: keys found by their hash
and refused once revoked, listings paged newest first after a cursor and scoped to an owner, batch updates guarded
by status; and the key check (serve/auth.py) over it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from layerbus.serve.auth import ANONYMOUS, Caller, authenticate, key_hash, new_key
from layerbus.serve.errors import ApiError
from layerbus.storage.api_records import ApiBatch, ApiFile
from layerbus.storage.api_store import ApiStore
from layerbus.storage.errors import StoreError
from tests.helpers.fixtures_stores import store, store_url  # noqa: F401 - fixtures

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def api(store) -> ApiStore:
    return ApiStore(store)


def a_file(file_id: str, owner: str, minutes: int) -> ApiFile:
    return ApiFile(id=file_id, owner=owner, filename="in.jsonl", purpose="batch", bytes=10, lines=2,
                   path=f"/files/{file_id}.jsonl", created_at=T0 + timedelta(minutes=minutes))


def a_batch(batch_id: str, owner: str, minutes: int) -> ApiBatch:
    at = T0 + timedelta(minutes=minutes)
    return ApiBatch(id=batch_id, owner=owner, input_file_id="file-1", endpoint="/v1/chat/completions",
                    completion_window="24h", expires_at=at + timedelta(hours=24), metadata_json="{}",
                    status="validating", job_id=None, errors_json=None, output_file_id=None, error_file_id=None,
                    created_at=at, cancelling_at=None, expired_at=None, finished_at=None)


def test_keys_are_found_by_hash_and_refused_once_revoked(api):
    key, admin_key = new_key(), new_key()
    assert not api.has_keys()
    assert authenticate(api, "anything", "once_made") == ANONYMOUS, "before the first key, any key will do"
    api.add_key("alice", key_hash(key), admin=False)
    api.add_key("root", key_hash(admin_key), admin=True)

    assert authenticate(api, key, "once_made") == Caller("alice", admin=False)
    assert authenticate(api, admin_key, "required") == Caller("root", admin=True)
    for given, mode, code in ((None, "once_made", "missing_api_key"), ("lb-nope", "optional", "invalid_api_key"),
                              (None, "required", "missing_api_key")):
        with pytest.raises(ApiError) as refused:
            authenticate(api, given, mode)
        assert refused.value.status == 401 and refused.value.code == code
    api.revoke_key("alice")
    with pytest.raises(ApiError, match="revoked"):
        authenticate(api, key, "once_made")
    with pytest.raises(StoreError, match="exists already"):
        api.add_key("alice", key_hash(new_key()), admin=False)
    assert [(k.name, k.admin, k.revoked_at is not None) for k in api.keys()] == [("alice", False, True),
                                                                                  ("root", True, False)]
    assert key not in str(api.keys()), "only hashes are kept"


def test_listings_are_pages_newest_first_scoped_to_an_owner(api):
    for minute, (file_id, owner) in enumerate([("file-a", "alice"), ("file-b", "bob"), ("file-c", "alice"),
                                               ("file-d", "alice")]):
        api.add_file(a_file(file_id, owner, minute))
        api.add_batch(a_batch(file_id.replace("file", "batch"), owner, minute))

    assert [f.id for f in api.files("alice", 2)] == ["file-d", "file-c"]
    assert [f.id for f in api.files("alice", 2, after="file-c")] == ["file-a"]
    assert [f.id for f in api.files(None, 10)] == ["file-d", "file-c", "file-b", "file-a"]
    assert api.files("alice", 10, after="file-unknown") == []
    assert [b.id for b in api.batches("bob", 10)] == ["batch-b"]
    assert [b.id for b in api.batches(None, 2, after="batch-d")] == ["batch-c", "batch-b"]
    api.delete_file("file-c")
    assert api.file("file-c") is None and api.file("file-d") == a_file("file-d", "alice", 3)


def test_batch_updates_are_guarded_by_status(api):
    api.add_batch(a_batch("batch-1", "alice", 0))

    assert api.update_batch("batch-1", only_if_status=("validating",), status="submitted", job_id="job_1")
    assert not api.update_batch("batch-1", only_if_status=("validating",), status="failed")
    assert api.batch("batch-1").status == "submitted" and api.batch("batch-1").job_id == "job_1"
    assert [b.id for b in api.open_batches()] == ["batch-1"]
    api.update_batch("batch-1", status="completed", finished_at=T0)
    assert api.open_batches() == []
