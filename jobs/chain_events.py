"""The job store as one chain of `layerbus run --chains K` sees it: what it records names the chain, so
`layerbus status JOB` says which chain placed what, lost what, and did which items."""

from __future__ import annotations

from typing import Any


class ChainEvents:
    """The job store as one chain sees it: each event it records and its worker record name the chain.
    Everything else is the store's own."""

    def __init__(self, store: Any, label: str):
        self._store, self.label = store, label

    def add_job_event(self, job_id: str, kind: str, message: str, duration_s: float | None = None,
                      now: Any = None) -> None:
        self._store.add_job_event(job_id, kind, f"{self.label}: {message}", duration_s, now)

    def register_worker(self, job_id: str, worker: str, host: str, chain: str | None = None, *args: Any,
                        **kwargs: Any) -> None:
        self._store.register_worker(job_id, worker, host, f"{self.label}: {chain or '(no chain)'}", *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
