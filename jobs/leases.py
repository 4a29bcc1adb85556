"""A broker's hold on the items it claimed: its name in the store, its leases renewed from a thread of its
own, other holders' expired items taken back, and which earlier holders are known to be gone.

Several brokers may work one job (storage/leases.py): each holds what it claimed until its lease runs
out, so a starting broker takes back only what nobody holds any more instead of everything in flight.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from layerbus.storage import JobStore, Lease
from layerbus.storage.leases import DEFAULT_LEASE_S

log = logging.getLogger("layerbus.jobs")

# Made once per process: every run in this process claims under one name, so a later run finds what an
# earlier one left behind (ended by an exception before handing back) and knows it is its own.
_PROCESS_TOKEN = secrets.token_hex(4)


@dataclass(frozen=True)
class WorkerId:
    """Who holds a claim, as items.claimed_by records it: "host:pid:token"."""

    host: str  # socket.gethostname() of the broker's machine
    pid: int  # the broker's process id on that host
    token: str  # random, per process: a pid reused after a reboot is another worker

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}:{self.token}"

    @classmethod
    def parse(cls, text: str) -> WorkerId | None:
        """The WorkerId in a claimed_by value, or None for names not made by WorkerId (tests, older brokers)."""
        parts = text.rsplit(":", 2)
        if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2]:
            return None
        return cls(parts[0], int(parts[1]), parts[2])


def this_worker() -> WorkerId:
    return WorkerId(socket.gethostname(), os.getpid(), _PROCESS_TOKEN)


@dataclass(frozen=True)
class LeaseConfig:
    """How long a claim holds an item, and how often a running broker renews its claims."""

    # Seconds a claimed item stays this broker's without renewal: after a broker dies, how long its
    # items wait before another broker takes them over. Longer than any stall of the renewing thread.
    lease_s: float = DEFAULT_LEASE_S
    # Seconds between renewals (and sweeps for other holders' expired items); 0 = a twelfth of the
    # lease, at least 0.1 s and at most 5 s. Must be well under lease_s.
    renew_every_s: float = 0.0
    # Brokers expected to work the job at once (the chains of one `layerbus run --chains K`): each claims
    # at most an even share of what is still queued (jobs/claim_share.py), even before the others have
    # registered. Brokers found working the job in the store count too, whatever this says.
    peers: int = 1

    def __post_init__(self) -> None:
        if self.peers < 1:
            raise ValueError(f"peers={self.peers!r}: at least this broker works the job (1 or more)")
        if not self.lease_s > 0:
            raise ValueError(f"lease of {self.lease_s!r} s: a lease must last a positive number of seconds "
                             f"(default {DEFAULT_LEASE_S:g})")
        if self.renew_every_s == 0:
            object.__setattr__(self, "renew_every_s", min(5.0, max(0.1, self.lease_s / 12)))
        if not 0 < self.renew_every_s <= self.lease_s / 2:
            raise ValueError(f"renewing every {self.renew_every_s!r} s a lease of {self.lease_s:g} s: renew at "
                             "least twice per lease (or leave the interval at 0 to have it chosen)")


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists on this machine (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def gone_holders(leases: Iterable[Lease], me: str, this_host: str, alive: Callable[[int], bool]) -> list[str]:
    """Holders of in-flight items known to hold nothing any more, whatever their leases say: this very
    worker (an earlier run in this process that ended without handing back) and workers of this host
    whose process has exited. Anyone else may be alive elsewhere: their items wait for their leases."""
    gone = []
    for lease in leases:
        worker = WorkerId.parse(lease.holder)
        if lease.holder == me or (worker is not None and worker.host == this_host and not alive(worker.pid)):
            gone.append(lease.holder)
    return gone


def report_expired(store: JobStore, job_id: str, taken: dict[str, int]) -> None:
    """Say, as a `lease_expired` event per holder, that `taken` (holder -> items) went back to the queue
    because the holder's lease ran out. Whoever requeued them says it: the keeper's tick, or a worker
    handing its own items back, whose requeue takes expired ones along (jobs/runner.py `_hand_back`)."""
    for holder, count in taken.items():
        message = (f"{count} item(s) held by {holder or 'an unnamed worker'} went back to the queue: its lease "
                   "ran out (that broker stopped renewing: killed, stopped or cut off)")
        log.warning("job %s: %s", job_id, message)
        store.add_job_event(job_id, "lease_expired", message)


class LeaseKeeper:
    """Renews `worker`'s leases on a job and requeues other holders' expired items, every
    `config.renew_every_s`, from a thread of its own: a long load or re-plan in the broker's loop must
    not look like a dead broker. `with LeaseKeeper(...):` runs it; `tick()` is one round, for tests."""

    def __init__(self, store: JobStore, job_id: str, worker: str, config: LeaseConfig):
        self.store, self.job_id, self.worker, self.config = store, job_id, worker, config
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"leases-{job_id}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def tick(self) -> dict[str, int]:
        """Renew this worker's leases, then requeue what others hold past their leases; how many per holder."""
        self.store.renew_leases(self.job_id, self.worker, self.config.lease_s)
        taken = self.store.requeue_expired(self.job_id, keep=self.worker)
        report_expired(self.store, self.job_id, taken)
        return taken

    def _loop(self) -> None:
        while not self._stop.wait(self.config.renew_every_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 (a store hiccup: the next tick tries again, well within the lease)
                log.exception("job %s: could not renew the leases of %s", self.job_id, self.worker)


def note_lost_workers(store: JobStore, job_id: str, worker_name: str) -> None:
    """Brokers of this host that worked the job and whose process has ended without stopping (kill -9, a crash,
    a lost node's restart): each said once, as a `worker_lost` event, by the next broker that starts on the job or
    takes its finalization over."""
    said = {event.message.split(" ", 2)[1] for event in store.job_events(job_id, limit=1_000_000)
            if event.kind == "worker_lost"}
    host = socket.gethostname()
    for worker in store.job_workers(job_id):
        found = WorkerId.parse(worker.worker)
        if (worker.worker == worker_name or worker.worker in said or worker.state == "stopped" or found is None
                or found.host != host or pid_alive(found.pid)):
            continue
        message = (f"broker {worker.worker} ended without stopping (its process is gone) after {worker.items_done} "
                   f"item(s); {worker_name} goes on with the job")
        log.warning("job %s: %s", job_id, message)
        store.add_job_event(job_id, "worker_lost", message)
