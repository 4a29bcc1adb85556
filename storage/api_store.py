"""The API server's part of the store: its keys (hashed), its files' records and its batches.

Apart from JobStore: the server is its only user, and the jobs its batches become are JobStore's. Opened on a
JobStore's database (`ApiStore(store)`), so both share one engine and one schema. Every method is one
transaction. Listings are pages in (created_at, id) order, newest first, that go on `after` an id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, fields
from datetime import datetime
from typing import Any

from sqlalchemy import and_, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from layerbus.storage.api_records import BATCH_FINAL, ApiBatch, ApiFile, ApiKey
from layerbus.storage.clock import utc_now
from layerbus.storage.errors import StoreError
from layerbus.storage.schema import api_batches, api_files, api_keys
from layerbus.storage.store import JobStore

KEY, FILE, BATCH = api_keys.c, api_files.c, api_batches.c
_BATCH_FIELDS = [f.name for f in fields(ApiBatch)]
_FILE_FIELDS = [f.name for f in fields(ApiFile)]


class ApiStore:
    """Keys, files and batches of `layerbus serve`, in the database of `store`."""

    def __init__(self, store: JobStore) -> None:
        self._db = store.db
        self.url = store.url

    # Keys.

    def add_key(self, name: str, key_hash: str, admin: bool, now: datetime | None = None) -> None:
        try:
            with self._db.write() as conn:
                conn.execute(insert(api_keys), {"name": name, "key_hash": key_hash, "admin": int(admin),
                                                "created_at": utc_now(now), "revoked_at": None})
        except IntegrityError as exc:
            raise StoreError(f"an API key named {name!r} exists already in {self.url} (a revoked key keeps its "
                             "name): choose another name; `layerbus keys api list` shows them") from exc

    def key_by_hash(self, key_hash: str) -> ApiKey | None:
        with self._db.read() as conn:
            row = conn.execute(select(KEY.name, KEY.admin, KEY.created_at, KEY.revoked_at)
                               .where(KEY.key_hash == key_hash)).one_or_none()
        return None if row is None else ApiKey(row.name, bool(row.admin), row.created_at, row.revoked_at)

    def keys(self) -> list[ApiKey]:
        with self._db.read() as conn:
            rows = conn.execute(select(KEY.name, KEY.admin, KEY.created_at, KEY.revoked_at)
                                .order_by(KEY.created_at, KEY.name)).all()
        return [ApiKey(row.name, bool(row.admin), row.created_at, row.revoked_at) for row in rows]

    def has_keys(self) -> bool:
        """Whether any key (revoked or not) was ever made: from then on every request needs one."""
        with self._db.read() as conn:
            return conn.execute(select(KEY.name).limit(1)).first() is not None

    def revoke_key(self, name: str, now: datetime | None = None) -> None:
        with self._db.write() as conn:
            done = conn.execute(update(api_keys).where(KEY.name == name, KEY.revoked_at.is_(None))
                                .values(revoked_at=utc_now(now)))
        if done.rowcount == 0:
            raise StoreError(f"no API key named {name!r} that is not revoked already in {self.url}; "
                             "`layerbus keys api list` shows them")

    # Files.

    def add_file(self, record: ApiFile) -> None:
        with self._db.write() as conn:
            conn.execute(insert(api_files), asdict(record))

    def file(self, file_id: str) -> ApiFile | None:
        with self._db.read() as conn:
            row = conn.execute(select(*[FILE[name] for name in _FILE_FIELDS]).where(FILE.id == file_id)).one_or_none()
        return None if row is None else ApiFile(*row)

    def files(self, owner: str | None, limit: int, after: str | None = None,
              purpose: str | None = None) -> list[ApiFile]:
        """Up to `limit` files of `owner` (None: everyone's), newest first, those after the file `after`."""
        query = select(*[FILE[name] for name in _FILE_FIELDS])
        if purpose is not None:
            query = query.where(FILE.purpose == purpose)
        return [ApiFile(*row) for row in self._page(query, api_files, FILE, owner, limit, after)]

    def delete_file(self, file_id: str) -> None:
        with self._db.write() as conn:
            conn.execute(delete(api_files).where(FILE.id == file_id))

    # Batches.

    def add_batch(self, record: ApiBatch) -> None:
        with self._db.write() as conn:
            conn.execute(insert(api_batches), asdict(record))

    def batch(self, batch_id: str) -> ApiBatch | None:
        with self._db.read() as conn:
            row = conn.execute(select(*[BATCH[name] for name in _BATCH_FIELDS])
                               .where(BATCH.id == batch_id)).one_or_none()
        return None if row is None else ApiBatch(*row)

    def batches(self, owner: str | None, limit: int, after: str | None = None) -> list[ApiBatch]:
        """Up to `limit` batches of `owner` (None: everyone's), newest first, those after the batch `after`."""
        query = select(*[BATCH[name] for name in _BATCH_FIELDS])
        return [ApiBatch(*row) for row in self._page(query, api_batches, BATCH, owner, limit, after)]

    def _page(self, query, table, columns, owner: str | None, limit: int, after: str | None) -> list:
        """`query`'s rows of `owner` (None: everyone's), newest first, up to `limit`, those after the row `after`:
        one page of OpenAI's list endpoints."""
        if owner is not None:
            query = query.where(columns.owner == owner)
        with self._db.read() as conn:
            if after is not None:
                query = query.where(_before(conn, table, columns, after))
            return conn.execute(query.order_by(columns.created_at.desc(), columns.id.desc()).limit(limit)).all()

    def open_batches(self) -> list[ApiBatch]:
        """Batches not in a final status, oldest first: what the server's keeper watches."""
        query = select(*[BATCH[name] for name in _BATCH_FIELDS]).where(BATCH.status.not_in(BATCH_FINAL))
        with self._db.read() as conn:
            rows = conn.execute(query.order_by(BATCH.created_at, BATCH.id)).all()
        return [ApiBatch(*row) for row in rows]

    def update_batch(self, batch_id: str, only_if_status: Sequence[str] = (), **values: Any) -> bool:
        """Set columns of a batch; with `only_if_status`, only while its status is one of them. True if it did."""
        query = update(api_batches).where(BATCH.id == batch_id)
        if only_if_status:
            query = query.where(BATCH.status.in_(list(only_if_status)))
        with self._db.write() as conn:
            return conn.execute(query.values(**values)).rowcount == 1


def _before(conn: Any, table: Any, columns: Any, after: str) -> Any:
    """Rows that come after the row `after` in (created_at, id) descending order; none when it is unknown."""
    created_at = conn.execute(select(columns.created_at).where(columns.id == after)).scalar_one_or_none()
    if created_at is None:
        return columns.id.is_(None)  # an id that is not there: an empty page, as a cursor past the end gives
    return or_(columns.created_at < created_at, and_(columns.created_at == created_at, columns.id < after))
