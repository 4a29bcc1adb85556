"""`layerbus run --stages N --chains K` end to end (real processes, a tiny random-weight model): two chains on
one job give exactly the one-stage run's outputs, every item once, both chains working; and a SIGKILLed stage
in one chain leaves the other chain completing items while the hit one gives up its share, outputs unchanged."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import select

from layerbus.storage import JobStore
from layerbus.storage.schema import items as items_table
from tests.helpers.cli import (JOB_ID, REPO, assert_parquet_matches_store, cli_env, layerbus, layerbus_executable,
                               result_outputs, run_outputs, status_json, write_jsonl)
from tests.helpers.fixtures_cli import model  # noqa: F401 - fixture
from tests.helpers.processes import descendants

ITEMS = 800  # enough that the fault lands mid-job: each chain records its first 64 before the kill
JOB_ARGS = ("--task", "summarize", "--max-new-tokens", "8")
RUN_ARGS = ("--threads-per-stage", "1", "--max-context", "128", "--slots", "8", "--partition", "equal")
LEASE_S = 6  # a chain that cannot go on leaves the job after one lease's wait
TIMEOUT_S = 300


def documents() -> list[dict]:
    return [{"id": f"doc-{i:03d}", "text": f"Chain {i % 2} takes batch {i}; {i % 7} stages pass it on."}
            for i in range(ITEMS)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", documents())


@pytest.fixture(scope="module")
def one_stage_outputs(tmp_path_factory, corpus, model) -> dict[str, str]:
    """The outputs of one chain of one stage: what any number of chains must give, token for token."""
    return run_outputs(tmp_path_factory.mktemp("one-stage"), corpus, model, "--stages", "1", *JOB_ARGS, *RUN_ARGS,
                       timeout=TIMEOUT_S)


def assert_each_item_once_with(expected: dict[str, str], home: Path, db: str, job_id: str) -> dict:
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == ITEMS
    rows = assert_parquet_matches_store(db, job_id, status["results_path"])
    assert Counter(row["custom_id"] for row in rows) == Counter(list(expected)), "every custom_id exactly once"
    assert result_outputs(status["results_path"]) == expected, "token for token the one-stage run's outputs"
    return status


def items_done_by_chain(status: dict) -> dict[str, int]:
    """'chain 1' -> items the chain's worker recorded (its worker record names the chain)."""
    return {worker["chain"].split(":")[0]: worker["items_done"] for worker in status["workers"]}


def test_two_chains_give_the_one_stage_outputs_every_item_once_both_working(tmp_path, corpus, model,
                                                                           one_stage_outputs):
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    done = layerbus(home, "run", corpus, "--model", model, "--db", db, "--stages", "2", "--chains", "2",
                    *JOB_ARGS, *RUN_ARGS, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    job_id = JOB_ID.search(done.stdout).group()

    status = assert_each_item_once_with(one_stage_outputs, home, db, job_id)
    by_chain = items_done_by_chain(status)
    print(f"items per chain: {by_chain}")
    assert set(by_chain) == {"chain 1", "chain 2"} and all(done > 0 for done in by_chain.values()), by_chain
    assert sum(by_chain.values()) == ITEMS, "nothing recorded twice"
    placed = sorted(event["message"] for event in status["events"] if event["kind"] == "placed")
    assert len(placed) == 2 and placed[0].startswith("chain 1: stage-0 [0, ") \
        and placed[1].startswith("chain 2: stage-1 [0, "), placed
    with JobStore.open(db) as store:
        assert store.job_finalization(job_id).holder in {w["worker"] for w in status["workers"]}
    logs = sorted(path.name for path in (home / "logs" / job_id).iterdir())
    assert logs == ["chain-1.log", "chain-2.log", "stage-0.log", "stage-1.log"], "one log per stage and per chain"


def stage_pid(run: subprocess.Popen, log_name: str) -> int:
    """The pid of the stage process under `run` that writes to `log_name` (its stderr is its log)."""
    for pid in descendants(run.pid):
        try:
            if os.readlink(f"/proc/{pid}/fd/2").endswith(f"/{log_name}"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no process under {run.pid} logs to {log_name}")


def finished_by_worker(db: str, job_id: str) -> list[tuple[str, datetime]]:
    """(holder, finished_at in UTC, naive) of every finished item, from the items themselves."""
    with JobStore.open(db) as store, store._read() as conn:  # noqa: SLF001 (the raw columns the counts come from)
        query = select(items_table.c.claimed_by, items_table.c.finished_at).where(items_table.c.job_id == job_id)
        return [(holder, finished.replace(tzinfo=None)) for holder, finished in conn.execute(query)
                if finished is not None]


@pytest.mark.parametrize("stages, victim, outcome", [("3", "stage-2", "worker_left"), ("4", "stage-3", "recovered")],
                         ids=["hit-chain-gives-up", "hit-chain-recovers"])
def test_sigkill_of_one_chains_stage_the_other_chain_keeps_completing_outputs_unchanged(
        stages, victim, outcome, tmp_path, corpus, model, one_stage_outputs):
    """Chain 2's last stage is killed once both chains have recorded work. With --stages 3 (chain 1: stage-0
    and stage-1, chain 2: stage-2 alone) chain 2 cannot re-plan and, its only stage process ended for good
    (the launcher started it and does not restart it), leaves its items to chain 1 at once, saying why; with
    --stages 4 (two chains of two) chain 2 re-plans over stage-2. Either way chain 1 goes on completing items
    and the job's outputs are the one-stage run's, each item once."""
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    submitted = layerbus(home, "submit", corpus, "--model", model, "--db", db, *JOB_ARGS)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    log = tmp_path / "run.log"
    with open(log, "w") as handle:
        run = subprocess.Popen([layerbus_executable(), "run", "--job", job_id, "--db", db, "--stages", stages,
                                "--chains", "2", "--lease", str(LEASE_S), *RUN_ARGS],
                               env=cli_env(home), cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
    try:
        with JobStore.open(db) as store:
            deadline = time.monotonic() + TIMEOUT_S
            while not (len(workers := store.job_workers(job_id)) == 2 and all(w.items_done > 0 for w in workers)):
                assert run.poll() is None, f"run ended early:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"no work by both chains within {TIMEOUT_S} s:\n{log.read_text()}"
                time.sleep(0.1)
            os.kill(stage_pid(run, f"{victim}.log"), signal.SIGKILL)
            assert store.job_status(job_id).completed < ITEMS // 2, "killed mid-job"
        assert run.wait(TIMEOUT_S) == 0, log.read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)

    status = assert_each_item_once_with(one_stage_outputs, home, db, job_id)
    by_chain = items_done_by_chain(status)
    print(f"items per chain: {by_chain}")
    assert sum(by_chain.values()) == ITEMS, "nothing recorded twice"
    events = status["events"]
    lost = [e for e in events if e["kind"] == "stage_lost"]
    assert len(lost) == 1 and lost[0]["message"].startswith("chain 2: ") and victim in lost[0]["message"], events
    after = [e for e in events if e["kind"] == outcome and e["message"].startswith("chain 2: ")]
    assert after, f"the hit chain's {outcome} event: {events}"
    since, until = (datetime.fromisoformat(event["at"]).replace(tzinfo=None) for event in (lost[0], after[0]))
    workers = {w["chain"].split(":")[0]: w["worker"] for w in status["workers"]}
    finished = finished_by_worker(db, job_id)
    chain_1_after_the_loss = [at for holder, at in finished if holder == workers["chain 1"] and at >= since]
    assert chain_1_after_the_loss, "the other chain went on completing items after the hit chain lost its stage"
    if outcome == "worker_left":
        assert "none can come back" in after[0]["message"] and victim in after[0]["message"], after[0]
        left_to_chain_1 = [at for at in chain_1_after_the_loss if at >= until]
        print(f"after chain 2 left: chain 1 finished {len(left_to_chain_1)} item(s)")
        assert left_to_chain_1, "the other chain completed the items the hit chain left"
    else:
        recovered = [at for holder, at in finished if holder == workers["chain 2"] and at >= until]
        print(f"after the loss: chain 1 finished {len(chain_1_after_the_loss)}, the recovered chain 2 {len(recovered)}")
        assert recovered, "the hit chain, re-planned over its surviving stage, completed items again"


def test_sigterm_stops_every_chain_and_run_job_resumes_with_the_same_outputs(tmp_path, corpus, model,
                                                                            one_stage_outputs):
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    log = tmp_path / "run.log"
    with open(log, "w") as handle:
        run = subprocess.Popen([layerbus_executable(), "run", str(corpus), "--model", str(model), "--db", db,
                                "--stages", "2", "--chains", "2", *JOB_ARGS, *RUN_ARGS],
                               env=cli_env(home), cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        with JobStore.open(db) as store:
            while not ((job_id := store.latest_job_id()) and len(store.job_workers(job_id)) == 2
                       and store.job_status(job_id).completed > 0):
                assert run.poll() is None, f"run ended early:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"no work within {TIMEOUT_S} s:\n{log.read_text()}"
                time.sleep(0.1)
            chain_processes = [pid for pid in descendants(run.pid) if _is_chain_process(pid, run.pid)]
            run.send_signal(signal.SIGTERM)
            assert run.wait(TIMEOUT_S) == 143, log.read_text()
            stopped = store.job_status(job_id)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)
    assert len(chain_processes) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in chain_processes), \
        "every chain's process stopped"
    assert stopped.status == "in_progress" and stopped.in_progress == 0, "each chain requeued its items in flight"
    assert 0 < stopped.completed < ITEMS and f"run --job {job_id}" in log.read_text()
    assert {w["state"] for w in status_json(home, job_id, "--db", db)["workers"]} == {"stopped"}

    resumed = layerbus(home, "run", "--job", job_id, "--db", db, "--stages", "2", "--chains", "2", *RUN_ARGS,
                       timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr
    assert_each_item_once_with(one_stage_outputs, home, db, job_id)


def _is_chain_process(pid: int, run_pid: int) -> bool:
    """A chain's broker process: a child of the run whose stderr is its chain-I.log (its stage launcher
    writes there too, one level down)."""
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        return parent == run_pid and os.readlink(f"/proc/{pid}/fd/2").rsplit("/", 1)[-1].startswith("chain-")
    except (OSError, IndexError, ValueError):
        return False


def test_chains_auto_profiles_the_stages_and_runs_the_planner_s_choice(tmp_path, corpus, model, one_stage_outputs):
    """--chains auto: the stages are profiled once, the planner's choice is said on stderr and run; whatever
    it chose, the outputs are the one-stage run's and every item is done once."""
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    planned = [arg for arg in RUN_ARGS if arg not in ("--partition", "equal")]  # auto plans from the profiles
    done = layerbus(home, "run", corpus, "--model", model, "--db", db, "--stages", "2", "--chains", "auto",
                    *JOB_ARGS, *planned, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    chosen = re.search(r"--chains auto: (\d) chain\(s\) \(([^)]*)\), [0-9.]+ tok/s predicted", done.stderr)
    assert chosen, done.stderr
    status = assert_each_item_once_with(one_stage_outputs, home, db, JOB_ID.search(done.stdout).group())
    if chosen.group(1) == "2":
        assert "in 2 chains" in done.stderr and all(items_done_by_chain(status).values())
