"""deploy/slurm/layerbus.sbatch on a real single-node Slurm cluster (tests/helpers/slurm_cluster.py): task 0 the
broker, 2 stage tasks; `sbatch --wait` returns 0 once the queue is served, with the outputs of `layerbus run`
on the same input: with the tasks started together, with the stage tasks started well before the broker
(longer than their --broker-timeout) or after it, on a fresh home with the default model prepared by the
broker, and when one stage task is killed with kill -9 mid-job. When every stage task has ended, the broker
exits at once naming them, and the job waits for a later run. Skipped, with the reason, without root or
without Debian's slurm-wlm and munge (run_tests.sh installs them as root)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from layerbus.storage import JobStore
from tests.helpers.slurm_cluster import SlurmCluster, missing, single_node_slurm
from tests.helpers.cli import JOB_ID, REPO, cli_env, layerbus, layerbus_executable, status_json, write_jsonl
from tests.helpers.store_items import GHOST

SBATCH = REPO / "deploy" / "slurm" / "layerbus.sbatch"
DOCUMENTS = 60
JOB_ARGS = ("--task", "summarize", "--max-new-tokens", "48")
SLOTS = "2"  # few sequences at a time: the job lasts long enough to kill a stage in the middle of it
SBATCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    with single_node_slurm() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def case(tiny_models, tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """The tiny model, the corpus, and `layerbus run`'s outputs on them (the reference)."""
    model, folder = tiny_models("llama"), tmp_path_factory.mktemp("slurm-reference")
    corpus = write_jsonl(folder / "docs.jsonl", [{"id": f"doc-{i:02d}", "text": f"Batch {i} crosses {i % 5} nodes."}
                                                for i in range(DOCUMENTS)])
    home, db = folder / "home", f"sqlite:///{folder / 'jobs.db'}"
    run = layerbus(home, "run", corpus, "--model", model, "--db", db, *JOB_ARGS, "--stages", "2", "--slots", SLOTS,
                   "--threads-per-stage", "1", timeout=SBATCH_TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    return model, corpus, outputs(status_json(home, JOB_ID.search(run.stdout).group(), "--db", db)["results_path"])


def outputs(path: str) -> dict[str, str]:
    return {row["custom_id"]: row["output"] for row in pq.read_table(path).to_pylist()}


def submit(tmp_path: Path, model: Path | None, corpus: Path, job_args: tuple = JOB_ARGS) -> tuple[Path, str, str]:
    home, db = tmp_path / "home", f"sqlite:///{tmp_path / 'jobs.db'}"
    submitted = layerbus(home, "submit", corpus, *(("--model", model) if model is not None else ()), "--db", db,
                         *job_args)
    assert submitted.returncode == 0, submitted.stderr
    return home, db, submitted.stdout.strip()


def late_layerbus(tmp_path: Path, broker_s: float = 0.0, stage_s: float = 0.0) -> str:
    """A layerbus executable whose `broker` starts `broker_s` late and whose `stage` starts `stage_s` late: Slurm
    starts a job's tasks in no fixed order, and a node may boot, or a model download finish, long after another."""
    wrapper = tmp_path / "late-layerbus"
    wrapper.write_text(f"""#!/usr/bin/env bash
case "$2" in
    broker) sleep {broker_s} ;;
    stage) sleep {stage_s} ;;
esac
exec {layerbus_executable()} "$@"
""")
    wrapper.chmod(0o755)
    return str(wrapper)


def start_sbatch(slurm: SlurmCluster, tmp_path: Path, home: Path, db: str, model: Path | None,
                 insecure: bool = False, executable: str | None = None, **env_overrides: str) -> subprocess.Popen:
    env = {**cli_env(home), **slurm.env, "LAYERBUS_DB": db, "LAYERBUS": executable or layerbus_executable(),
           "LAYERBUS_BROKER_ARGS": f"--slots {SLOTS}", "LAYERBUS_INSECURE": "1" if insecure else "0",
           **env_overrides}
    if model is not None:
        env["LAYERBUS_MODEL"] = str(model)
    else:
        env.pop("LAYERBUS_MODEL", None)
    return subprocess.Popen(["sbatch", "--wait", "--ntasks=3", f"--output={tmp_path / 'slurm-%j.out'}", str(SBATCH)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(sbatch: subprocess.Popen, slurm: SlurmCluster, tmp_path: Path) -> tuple[int, str]:
    """sbatch's exit code and the job's output (every task's lines, labelled by task number)."""
    try:
        said, _ = sbatch.communicate(timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        sbatch.kill()
        said = "(sbatch --wait timed out)"
    job_output = "\n".join(path.read_text() for path in tmp_path.glob("slurm-*.out"))
    return sbatch.returncode, f"{said}\n{job_output}\n{slurm.log_tail()}"


def wait_until(ready, what: str, sbatch: subprocess.Popen, slurm: SlurmCluster, tmp_path: Path) -> None:
    deadline = time.monotonic() + SBATCH_TIMEOUT_S
    while not ready():
        if sbatch.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {what} (sbatch: {sbatch.poll()}):\n{finish(sbatch, slurm, tmp_path)[1]}")
        time.sleep(0.05)


def stage_pid(task: int) -> int | None:
    """The pid of the `layerbus stage` that Slurm task `task` runs (its --name ends in -task-N)."""
    for entry in Path("/proc").iterdir():
        try:
            words = (entry / "cmdline").read_bytes().decode().split("\0")
        except (OSError, ValueError):
            continue
        if "stage" in words and "--name" in words and words[words.index("--name") + 1].endswith(f"-task-{task}"):
            return int(entry.name)
    return None


@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "insecure"])
def test_sbatch_serves_the_queue_with_the_outputs_of_layerbus_run(slurm, case, tmp_path, insecure):
    model, corpus, expected = case
    home, db, job_id = submit(tmp_path, model, corpus)
    code, log = finish(start_sbatch(slurm, tmp_path, home, db, model, insecure), slurm, tmp_path)
    assert code == 0, log
    assert ("WARNING: --insecure" in log) == insecure, "CurveZMQ unless LAYERBUS_INSECURE=1"
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed", log
    assert Path(status["results_path"]).is_relative_to(home), "the job runs in the environment sbatch was given"
    assert outputs(status["results_path"]) == expected
    assert "exiting (--exit-when-idle) after 1 job(s), 1 completed" in log
    assert not list(tmp_path.glob(".layerbus-slurm-*")), "the job's throwaway keys must be gone"


@pytest.mark.parametrize("broker_s, stage_s", [(20.0, 0.0), (0.0, 5.0)], ids=["stages-first", "broker-first"])
def test_sbatch_serves_the_queue_whichever_task_starts_first(slurm, case, tmp_path, broker_s, stage_s):
    """Stage tasks started 20 s before the broker (longer than their 15 s --broker-timeout) wait for it; stage
    tasks started after it are waited for."""
    model, corpus, expected = case
    home, db, job_id = submit(tmp_path, model, corpus)
    code, log = finish(start_sbatch(slurm, tmp_path, home, db, model, executable=late_layerbus(tmp_path, broker_s,
                                                                                               stage_s)),
                       slurm, tmp_path)
    assert code == 0, log
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and outputs(status["results_path"]) == expected, log
    assert "silent for" not in log, "no stage left while the broker lived"


def test_a_stage_task_killed_mid_job_is_replanned_around_and_the_outputs_do_not_change(slurm, case, tmp_path):
    model, corpus, expected = case
    home, db, job_id = submit(tmp_path, model, corpus)
    with JobStore.open(db) as store:  # most items held elsewhere until the kill has been seen: no race with the end
        assert len(store.claim_items(job_id, GHOST, DOCUMENTS - 4, lease_s=3600)) == DOCUMENTS - 4
    sbatch = start_sbatch(slurm, tmp_path, home, db, model)
    try:
        with JobStore.open(db) as store:
            wait_until(lambda: store.job_status(job_id).completed >= 1, "a committed item", sbatch, slurm, tmp_path)
            pid = stage_pid(2)
            assert pid is not None, "no process for stage task 2"
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: "stage_lost" in [event.kind for event in store.job_events(job_id)], "the loss seen",
                       sbatch, slurm, tmp_path)
            assert store.requeue_expired(job_id, holders=[GHOST]) == {GHOST: DOCUMENTS - 4}
    except BaseException:
        sbatch.kill()  # the Slurm job itself is cancelled when the cluster stops
        raise
    code, log = finish(sbatch, slurm, tmp_path)
    assert code == 0, log
    assert "task 2: Exited with exit code 137" in log or "task 2: Killed" in log, log
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and status["request_counts"]["completed"] == DOCUMENTS, log
    assert outputs(status["results_path"]) == expected


def test_when_every_stage_task_has_ended_the_broker_stops_naming_them(slurm, case, tmp_path):
    """The stage tasks give up before the broker answers (--wait-for-broker 2, the broker 20 s late): once it
    is up it does not wait for them, it says which tasks ended and how, and the job waits for a later run."""
    model, corpus, _ = case
    home, db, job_id = submit(tmp_path, model, corpus)
    code, log = finish(start_sbatch(slurm, tmp_path, home, db, model, executable=late_layerbus(tmp_path, broker_s=20),
                                    LAYERBUS_WAIT_FOR_BROKER="2"), slurm, tmp_path)
    assert code == 1, log
    assert "none of the 2 stages can serve" in log and "-task-1 (pid" in log and "-task-2 (pid" in log, log
    assert "its task ended with exit code 3" in log, log
    assert status_json(home, job_id, "--db", db)["status"] == "queued", "nothing lost: the job waits for a later run"


FRESH_DOCUMENTS = 6
FRESH_ARGS = ("--task", "summarize", "--max-new-tokens", "8")


def test_a_fresh_home_with_the_default_model_and_stages_started_first_completes(slurm, default_model, tmp_path_factory,
                                                                               tmp_path):
    """No LAYERBUS_MODEL and an empty LAYERBUS_HOME: the broker task prepares the default model while the stage
    tasks, started 20 s before it, wait; the outputs are those of `layerbus run` on the same input."""
    folder = tmp_path_factory.mktemp("fresh-reference")
    corpus = write_jsonl(folder / "docs.jsonl", [{"id": f"doc-{i}", "text": f"Night {i}: the cluster finished {i} jobs."}
                                                 for i in range(FRESH_DOCUMENTS)])
    reference_home, reference_db = folder / "home", f"sqlite:///{folder / 'jobs.db'}"
    run = layerbus(reference_home, "run", corpus, "--db", reference_db, *FRESH_ARGS, "--stages", "2", "--slots", SLOTS,
                   "--threads-per-stage", "1", timeout=SBATCH_TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    expected = outputs(status_json(reference_home, JOB_ID.search(run.stdout).group(), "--db",
                                   reference_db)["results_path"])
    home, db, job_id = submit(tmp_path, None, corpus, FRESH_ARGS)
    code, log = finish(start_sbatch(slurm, tmp_path, home, db, None, executable=late_layerbus(tmp_path, broker_s=20)),
                       slurm, tmp_path)
    assert code == 0, log
    status = status_json(home, job_id, "--db", db)
    assert status["status"] == "completed" and outputs(status["results_path"]) == expected, log
