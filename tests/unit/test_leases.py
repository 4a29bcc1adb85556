"""Item leases from the broker's side (jobs/leases.py, jobs/runner.py): the worker's name, which earlier
holders are known to be gone, the renewing thread, and run_job beside another holder, on a real SQLite
store with the broker played in-process by a script (tests/helpers/scripted_broker.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from datetime import datetime, timedelta, timezone

import pytest

from layerbus.broker.requests import GenerationResult
from layerbus.jobs.leases import LeaseConfig, LeaseKeeper, WorkerId, gone_holders, pid_alive, this_worker
from layerbus.jobs.runner import StoreSink, StoreSource, StrandedWatch, default_worker_name, run_job
from layerbus.storage import ItemResult, JobStore, Lease
from layerbus.storage.results import ResultWriter
from tests.helpers.fixtures_jobs import tokenizer  # noqa: F401 - fixture
from tests.helpers.scripted_broker import ScriptedBroker, final_rows, queue_job

T0 = datetime(2030, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


@pytest.fixture
def store(tmp_path):
    with JobStore.open(f"sqlite:///{tmp_path / 'jobs.db'}") as opened:
        yield opened


def exited_pid() -> int:
    """The pid of a process of this machine that has exited (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("gpu-box-3:4242:9f3a", WorkerId("gpu-box-3", 4242, "9f3a")),
        ("odd:name:17:ab", WorkerId("odd:name", 17, "ab")),  # only the last two fields are fixed
        ("killed", None),
        ("host:pid:ab", None),
        (":17:ab", None),
        ("host:17:", None),
    ],
)
def test_worker_ids_parse_back_from_claimed_by(text, parsed):
    assert WorkerId.parse(text) == parsed
    if parsed is not None:
        assert str(parsed) == text


def test_this_process_has_one_name_with_its_host_and_pid():
    me = this_worker()
    assert (me.host, me.pid) == (socket.gethostname(), os.getpid())
    assert default_worker_name() == str(me) == str(this_worker())


@pytest.mark.parametrize(
    ("holder", "gone"),
    [
        ("me:1:aa", True),  # this worker: an earlier run of this process left it behind
        ("here:2:bb", True),  # this host, process exited
        ("here:3:cc", False),  # this host, process alive
        ("there:2:dd", False),  # another host: maybe alive, its lease decides
        ("killed", False),  # not a worker id: its lease decides
    ],
)
def test_gone_holders_are_this_worker_and_exited_processes_of_this_host(holder, gone):
    leases = [Lease(holder, 1, T0)]
    assert gone_holders(leases, "me:1:aa", "here", alive=lambda pid: pid == 3) == ([holder] if gone else [])


def test_pid_alive_tells_a_live_process_from_an_exited_one():
    assert pid_alive(os.getpid()) and not pid_alive(exited_pid())


@pytest.mark.parametrize(
    ("lease_s", "renew_every_s", "expected"),
    [(60.0, 0.0, 5.0), (12.0, 0.0, 1.0), (0.6, 0.0, 0.1), (10.0, 2.0, 2.0)],
)
def test_lease_config_renews_well_within_the_lease(lease_s, renew_every_s, expected):
    assert LeaseConfig(lease_s, renew_every_s).renew_every_s == pytest.approx(expected)


@pytest.mark.parametrize(
    ("lease_s", "renew_every_s", "message"),
    [(0.0, 0.0, r"lease of 0.0 s: a lease must last a positive number of seconds"),
     (10.0, 6.0, r"renewing every 6.0 s a lease of 10 s: renew at least twice per lease")],
)
def test_lease_config_refuses_leases_that_cannot_be_kept(lease_s, renew_every_s, message):
    with pytest.raises(ValueError, match=message):
        LeaseConfig(lease_s, renew_every_s)


def test_a_tick_renews_this_workers_leases_and_takes_back_expired_ones(store):
    job_id = queue_job(store, 4)
    store.claim_items(job_id, "me", 2, lease_s=5)
    store.claim_items(job_id, "dead-elsewhere:9:ff", 2, lease_s=0.001)
    (before,) = [lease.expires_at for lease in store.job_leases(job_id) if lease.holder == "me"]
    time.sleep(0.01)  # the other lease has surely run out
    assert LeaseKeeper(store, job_id, "me", LeaseConfig(lease_s=60)).tick() == {"dead-elsewhere:9:ff": 2}
    (after,) = store.job_leases(job_id)
    assert after.holder == "me" and after.expires_at > before + timedelta(seconds=50)
    (event,) = store.job_events(job_id)
    assert event.kind == "lease_expired" and event.message.startswith("2 item(s) held by dead-elsewhere:9:ff went")


def test_a_hand_back_that_takes_another_holder_s_expired_items_says_so(store, tokenizer, tmp_path):
    """A broker handing back its own items requeues, in the same statement, those whose lease has run out: a
    broker that ended just after a killed one's lease expired took the killed one's items, and the job's
    events said nothing of it (seen once in CI, on PostgreSQL, in tests/cluster/test_brokers_one_job.py)."""
    from layerbus.jobs.runner import _hand_back

    job_id = queue_job(store, 4)
    store.claim_items(job_id, "dead-elsewhere:9:ff", 2, lease_s=0.001)
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "me")
    source.fetch(2)
    time.sleep(0.01)  # the other lease has surely run out
    _hand_back(store, StoreSink(store, ResultWriter(tmp_path, job_id), source.outstanding), source)
    status = store.job_status(job_id)
    assert (status.queued, status.in_progress) == (4, 0)
    (event,) = store.job_events(job_id)
    assert event.kind == "lease_expired" and event.message.startswith("2 item(s) held by dead-elsewhere:9:ff went")


def test_the_keeper_thread_renews_while_the_broker_is_busy(store):
    job_id = queue_job(store, 1)
    store.claim_items(job_id, "me", 1, lease_s=3)
    (first,) = store.job_leases(job_id)
    with LeaseKeeper(store, job_id, "me", LeaseConfig(lease_s=3, renew_every_s=0.1)):
        deadline = time.monotonic() + 60
        while store.job_leases(job_id)[0].expires_at == first.expires_at:  # the main thread does nothing
            assert time.monotonic() < deadline, "the keeper never renewed the lease"
            time.sleep(0.05)
    assert store.job_leases(job_id)[0].holder == "me"


def test_a_resumed_run_takes_back_what_an_exited_broker_of_this_host_held(store, tokenizer, tmp_path):
    job_id = queue_job(store, 6)
    dead = str(WorkerId(socket.gethostname(), exited_pid(), "0dead"))
    store.claim_items(job_id, dead, 3)  # a 60 s lease, still running: the exited process is what counts

    status = run_job(store, job_id, ScriptedBroker(tokenizer, batch=4), tmp_path, poll_cancel_s=0)

    assert (status.status, status.completed) == ("completed", 6)
    resumed = [e.message for e in store.job_events(job_id) if e.kind == "resumed"]
    assert resumed == [f"3 item(s) left in progress by {dead} went back to the queue (its process has exited); "
                       "committed items are kept"]


def test_items_another_live_holder_has_are_left_until_its_lease_runs_out(store, tokenizer, tmp_path):
    job_id = queue_job(store, 6)
    other = "another-host:77:beef"  # may be alive: only its lease can tell
    store.claim_items(job_id, other, 2, lease_s=1.5)
    broker = ScriptedBroker(tokenizer, batch=4)

    status = run_job(store, job_id, broker, tmp_path, poll_cancel_s=0, leases=LeaseConfig(lease_s=2))

    assert (status.status, status.completed) == ("completed", 6)
    assert sorted(r["custom_id"] for r in final_rows(status.results_path)) == [f"doc-{i}" for i in range(6)]
    first_round = [int(r.request_id) for r in broker.requests[:4]]
    taken_over = [int(r.request_id) for r in broker.requests[4:]]
    assert len(taken_over) == 2 and not set(first_round) & set(taken_over), "the other's items ran once, later"
    kinds = [e.kind for e in store.job_events(job_id)]
    assert "lease_expired" in kinds and "resumed" not in kinds


def test_results_of_items_taken_over_by_another_worker_are_not_recorded(store, tokenizer, tmp_path):
    job_id = queue_job(store, 2)
    source = StoreSource(store, job_id, tokenizer, store.job_settings(job_id), "slow:1:aa", lease_s=60)
    requests = source.fetch(2)
    store.requeue_expired(job_id, holders=["slow:1:aa"])  # its lease lost (as if it had run out)...
    taken, _ = store.claim_items(job_id, "fast:2:bb", 2)  # ...and another worker holds them now
    store.complete_items([ItemResult(taken.item_id, "fast's answer", "stop", 3, 2, 0.1)], holder="fast:2:bb")

    sink = StoreSink(store, ResultWriter(tmp_path, job_id), source.outstanding, holder="slow:1:aa")
    sink.deliver([GenerationResult(r.request_id, [5], "length", 3, text="slow's answer") for r in requests])
    sink.flush()

    outputs = {row["custom_id"]: row["output"] for row in store.item_results(job_id)}
    assert outputs == {"doc-0": "fast's answer"}, "slow's late results are refused; doc-1 is still fast's"
    assert [(lease.holder, lease.items) for lease in store.job_leases(job_id)] == [("fast:2:bb", 1)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_broker_left_without_stages_stops_after_its_grace_only_beside_a_working_broker(store):
    """StrandedWatch: never before the broker waits for a stage, nor within the grace, nor while it is alone
    on the job (or beside a stopped or lost broker); after the grace beside a working one, it stops; a
    recovery in between starts the grace again."""
    job_id = queue_job(store, 2)
    store.register_worker(job_id, "me", "here", lease_s=60)
    clock, recorded = FakeClock(), []
    watch = StrandedWatch(store, job_id, "me", grace_s=10, clock=clock, check_every_s=0)
    events = watch.watching(lambda kind, message, *a, **k: recorded.append(kind))
    events("stage_lost", "stage-0 left")
    clock.now += 60
    assert not watch(), "not waiting for a stage: running on"
    events("waiting", "the stages left cannot hold tiny")
    clock.now += 60
    assert not watch(), "alone on the job: waits as long as it takes"
    store.register_worker(job_id, "stopped-one", "there", lease_s=60)
    store.set_worker_state(job_id, "stopped-one", "stopped")
    store.register_worker(job_id, "lost-one", "there", lease_s=5, now=datetime.now(timezone.utc) - timedelta(seconds=60))
    assert not watch(), "beside brokers that stopped or are lost: still alone"
    store.register_worker(job_id, "other", "there", lease_s=60)
    events("recovered", "re-planned")
    events("waiting", "the stages left cannot hold tiny")
    clock.now += 9
    assert not watch(), "within the grace, counted from the new wait"
    clock.now += 2
    assert watch() and watch.left and "no stage for 11 s" in watch.reason
    assert recorded == ["stage_lost", "waiting", "recovered", "waiting"], "every event is passed on"


@pytest.mark.parametrize("wanted, queued, in_flight, held, workers, claimed", [
    (40, 60, 0, 0, 1, 40),  # alone: what the slots and the waiting line take
    (96, 60, 0, 0, 2, 30),  # two brokers: an even share, not the whole of a small job
    (96, 30, 30, 30, 2, 0),  # its share in hand, the other's still queued: nothing more
    (12, 60, 0, 0, 2, 12),  # fewer wanted than the share: what is wanted
    (10, 20, 20, 10, 2, 10),  # it finished its first items: its share grows back to half of what is left
    (10, 5, 0, 0, 3, 2),  # rounded up
    (10, 1, 3, 0, 4, 1),  # holding none, it still takes one
    (0, 60, 0, 0, 2, 0),  # nothing wanted, nothing claimed
])
def test_a_broker_beside_others_holds_an_even_share_of_what_is_not_done(wanted, queued, in_flight, held, workers,
                                                                       claimed):
    from layerbus.jobs.claim_share import fair_claim

    assert fair_claim(wanted, queued, in_flight, held, workers) == claimed


@pytest.mark.parametrize("wanted, ahead, queued, in_flight, held, workers, claimed", [
    (24, 12, 24, 50, 14, 2, 12),  # the job's end (bench_chains): its free slots' part only, the rest to the other
    (24, 12, 200, 50, 14, 2, 24),  # plenty queued for everyone: its waiting line too
    (24, 12, 48, 50, 14, 2, 24),  # exactly what both want: still the line
    (24, 12, 24, 50, 14, 1, 24),  # alone: the line as ever
    (12, 12, 10, 30, 20, 2, 0),  # only its line wanted near the end: nothing, the other may start them now
    (12, 12, 10, 30, 0, 2, 1),  # ... but a broker holding none takes one
])
def test_near_the_job_s_end_a_broker_beside_others_claims_for_its_free_slots_not_its_waiting_line(
        wanted, ahead, queued, in_flight, held, workers, claimed):
    from layerbus.jobs.claim_share import fair_claim

    assert fair_claim(wanted, queued, in_flight, held, workers, ahead) == claimed


def test_a_store_source_beside_another_broker_leaves_the_last_items_to_it(store, tokenizer):
    job_id = queue_job(store, 12)
    settings = store.job_settings(job_id)
    first = StoreSource(store, job_id, tokenizer, settings, "a:1:aa", peers=2)
    assert len(first.fetch(8, ahead=4)) == 4, "12 queued, less than 2 x 8: the 4 for free slots, not the line"
    second = StoreSource(store, job_id, tokenizer, settings, "b:2:bb", peers=2)
    assert len(second.fetch(8, ahead=0)) == 6, "for its free slots, up to an even share of the 12 not done"
    alone = StoreSource(store, queue_job(store, 12), tokenizer, settings, "c:3:cc")
    assert len(alone.fetch(8, ahead=4)) == 8, "alone on its job: its line too"


def test_brokers_working_the_job_bound_what_each_claims(store, tokenizer):
    job_id = queue_job(store, 12)
    settings = store.job_settings(job_id)
    first = StoreSource(store, job_id, tokenizer, settings, "a:1:aa", peers=2)
    assert len(first.fetch(12)) == 6, "two chains expected: half of the 12, before the other registers"
    assert first.fetch(12) == [] and not first.exhausted, "its share in hand: nothing now, more may come later"
    assert len(first.outstanding) == 6
    store.register_worker(job_id, "a:1:aa", "a")
    store.register_worker(job_id, "b:2:bb", "b")
    second = StoreSource(store, job_id, tokenizer, settings, "b:2:bb")  # peers=1, but the store lists two working
    assert len(second.fetch(12)) == 6, "the other half"
    store.set_worker_state(job_id, "b:2:bb", "stopped")
    queue_more = StoreSource(store, job_id, tokenizer, settings, "c:3:cc")
    assert queue_more.fetch(12) == [], "nothing queued"
