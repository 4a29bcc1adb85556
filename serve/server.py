"""One running server's parts, shared by its routes: the store, the API's part of it, the settings, the clock,
the thread that validates batches one at a time, and the keeper that watches open batches."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from fastapi import Request

from layerbus.serve.auth import COOKIE, Caller, authenticate, bearer_key
from layerbus.serve.config import ServeConfig
from layerbus.serve.token_samples import TokenSamples
from layerbus.storage.api_store import ApiStore
from layerbus.storage.store import JobStore


class Server:
    """What the routes of one app share (app.state.server)."""

    def __init__(self, config: ServeConfig, store: JobStore, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.store = store
        self.api = ApiStore(store)
        self.clock = clock
        # Batch inputs are validated here, one at a time, off the request threads: a million lines take a while.
        self.intake = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-intake")
        # Ids of the batches this process is validating: a validating batch not among them was left by a server
        # that stopped.
        self.validating: set[str] = set()
        # Batches created before this moment and still validating were left by a server that stopped.
        self.started_at = self.now()
        # Generated tokens over time of the running jobs, for the dashboard's charts.
        self.token_samples = TokenSamples()
        config.files_dir.mkdir(parents=True, exist_ok=True)

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), timezone.utc)

    def caller(self, request: Request) -> Caller:
        """Who sent `request`: its bearer key, else the dashboard's cookie; ApiError 401 when refused."""
        key = bearer_key(request.headers.get("authorization"))
        if key is None:
            key = request.cookies.get(COOKIE) or None
        return authenticate(self.api, key, self.config.keys)

    def close(self) -> None:
        self.intake.shutdown(wait=False, cancel_futures=True)
        self.store.close()


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())
