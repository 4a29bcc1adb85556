"""A chaos soak: two brokers and their stages, started by hand, work one job of thousands of items while a
seeded random schedule injects faults every few seconds; a checker then looks at what the store and the
results say.

Each round submits the job (greedy and seeded-sampling items, OpenAI batch lines), starts two
`layerbus broker --job J` processes on ports of their own, each with its stages (`layerbus stage`, restarted
when they die, as systemd's Restart=always would), and injects, drawn from the seed:

  stage-kill         kill -9 of a stage (it is started again a second later)
  stage-stop         SIGSTOP of a stage for longer than the liveness window, then SIGCONT
  broker-kill        kill -9 of a broker, restarted with `broker --job J` two seconds later
  late-stage         a stage started mid-job beside a broker (it joins, or waits as a spare)
  kill-while-loading kill -9 of a stage, then of another of its broker as soon as the re-plan loads
  finalizing-kill    kill -9 of the broker that finalizes the job, once it does (then restarted)

until the job completes; then it checks: every id exactly once in the results, outputs identical to a
fault-free run of the same job, no item left queued or in progress, the job's counters equal to a count of
its items, every fault visible as an event in `layerbus status`. Rounds follow one another until the time
is up. The seed, the schedule and the checks are written to JSON (`--replay FILE` runs a schedule again).

    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/soak.py                     # 20 minutes, SQLite
    flock /tmp/layerbus-heavy.lock .venv/bin/python bench/soak.py --postgres --minutes 60
    .venv/bin/python bench/soak.py --minutes 2 --items 600                            # the test suite's size
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.soak_check import check_round  # noqa: E402
from tests.helpers.processes import free_port_pair  # noqa: E402
from layerbus.storage import JobStore  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
KINDS = {"stage-kill": 3, "stage-stop": 2, "broker-kill": 1, "late-stage": 1, "kill-while-loading": 1}
LIVENESS_S = 2.0  # the brokers' liveness window: a stage stopped longer than this is lost
LEASE_S = 10.0
ROUND_TIMEOUT_S = 900.0
QUIET_TAIL_S = 20.0  # no fault once the job is expected to end within this: what it does could not be seen
MIN_UP_S = 5.0  # a stage or broker is faulted only once it has been up this long (its broker knows it by then)


@dataclass(frozen=True)
class SoakConfig:
    """What the soak runs, and for how long."""

    minutes: float = 20.0
    items: int = 5000
    seed: int = 1
    brokers: int = 2
    stages_per_broker: int = 2
    max_new_tokens: int = 32
    fault_gap_s: tuple[float, float] = (3.0, 8.0)  # seconds between faults, drawn evenly
    finalizing_kill_share: float = 0.5  # rounds whose finalizing broker is killed


@dataclass
class Fault:
    """One fault injected: when (UTC ISO and seconds into the round), what, and on whom."""

    at: str
    round_s: float
    kind: str
    target: str  # a stage's name, or "broker-N pid P"
    detail: str = ""
    seen: bool = False  # an event of `layerbus status` says it


@dataclass
class RoundReport:
    job_id: str
    seconds: float
    items: int
    faults: list[Fault] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    tokens_per_s: float = 0.0


def layerbus_executable() -> str:
    beside = Path(sys.executable).parent / "layerbus"
    return str(beside) if beside.exists() else "layerbus"


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def write_items(path: Path, model_name: str, count: int, max_new_tokens: int) -> Path:
    """OpenAI batch lines: every other item sampled (temperature 0.8, its own seed), the rest greedy."""
    lines = []
    for i in range(count):
        body = {"model": model_name, "prompt": f"Item {i}: the {i % 17} stages pass batch {i % 29} on; then",
                "max_tokens": max_new_tokens, "temperature": 0.8 if i % 2 else 0.0}
        if i % 2:
            body["seed"] = 1000 + i
        lines.append(json.dumps({"custom_id": f"item-{i:06d}", "method": "POST", "url": "/v1/completions",
                                 "body": body}))
    path.write_text("\n".join(lines) + "\n")
    return path


class Cluster:
    """The brokers and stages of one round, their logs, and the supervision that restarts dead stages."""

    def __init__(self, work: Path, model: Path, db: str, job_id: str, config: SoakConfig, env: dict):
        self.work, self.model, self.db, self.job_id, self.config, self.env = work, model, db, job_id, config, env
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.ports = [free_port_pair() for _ in range(config.brokers)]
        self.brokers: list[subprocess.Popen | None] = [None] * config.brokers
        self.broker_started = [0.0] * config.brokers
        self.broker_restart_at: list[float | None] = [None] * config.brokers
        self.broker_done = [False] * config.brokers
        self.stages: dict[str, tuple[int, subprocess.Popen]] = {}  # name -> (broker index, process)
        self.stage_started: dict[str, float] = {}
        self.stage_log_from: dict[str, int] = {}  # where the running process's lines begin in its log
        self.stage_restart_at: dict[str, float] = {}
        self.stopped: dict[str, float] = {}  # SIGSTOPped stages -> when to SIGCONT them
        self.late = 0

    def start(self) -> None:
        for i in range(self.config.brokers):
            self.start_broker(i)
            for k in range(self.config.stages_per_broker):
                self.start_stage(i, f"b{i}-s{k}")

    def start_broker(self, i: int) -> None:
        port = self.ports[i]
        with open(self.logs / f"broker-{i}.log", "a") as log:
            self.brokers[i] = subprocess.Popen(
                [layerbus_executable(), "-v", "broker", "--model", str(self.model), "--stages",
                 str(self.config.stages_per_broker), "--db", self.db, "--job", self.job_id,
                 "--bind-control", f"tcp://127.0.0.1:{port}", "--bind-results", f"tcp://127.0.0.1:{port + 1}",
                 "--liveness-window", str(LIVENESS_S), "--lease", str(LEASE_S), "--poll", "0.2"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.broker_started[i] = time.monotonic()
        self.broker_restart_at[i] = None

    def start_stage(self, i: int, name: str) -> None:
        path = self.logs / f"{name}.log"
        self.stage_log_from[name] = path.stat().st_size if path.exists() else 0
        with open(path, "a") as log:
            process = subprocess.Popen(
                [layerbus_executable(), "-v", "stage", "--broker", f"tcp://127.0.0.1:{self.ports[i]}", "--name", name,
                 "--threads", "1", "--broker-timeout", "60"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.stages[name] = (i, process)
        self.stage_started[name] = time.monotonic()
        self.stage_restart_at.pop(name, None)

    def supervise(self) -> None:
        """Restart stages that died (a second later) and brokers whose restart is due; resume stopped stages."""
        now = time.monotonic()
        for name, at in list(self.stopped.items()):
            if now >= at:
                self.signal_stage(name, signal.SIGCONT)
                del self.stopped[name]
        for name, (i, process) in list(self.stages.items()):
            if process.poll() is None or self.broker_done[i]:
                continue
            restart = self.stage_restart_at.setdefault(name, now + 1.0)
            if now >= restart:
                self.start_stage(i, name)
        for i, at in enumerate(self.broker_restart_at):
            if at is not None and now >= at:
                self.start_broker(i)
        for i, broker in enumerate(self.brokers):
            if broker is not None and broker.poll() is not None and self.broker_restart_at[i] is None:
                self.broker_done[i] = True  # ended by itself: its job is done (or it failed: the checker says)

    def signal_stage(self, name: str, signum: int) -> None:
        try:
            os.kill(self.stages[name][1].pid, signum)
        except ProcessLookupError:
            pass

    def kill_broker(self, i: int, restart_after_s: float = 2.0) -> int:
        broker = self.brokers[i]
        os.killpg(broker.pid, signal.SIGKILL)  # its own session: only the broker (stages are in theirs)
        broker.wait(30)
        self.broker_restart_at[i] = time.monotonic() + restart_after_s
        return broker.pid

    def up_for(self, i: int) -> float:
        """Seconds broker i has been up: 0 until it works the job (it is then among the job's workers; before
        that, on a loaded machine, it may still be placing its model, and a kill of it is nobody's loss)."""
        broker = self.brokers[i]
        up = broker is not None and broker.poll() is None and self.broker_restart_at[i] is None
        return time.monotonic() - self.broker_started[i] if up and self.works_the_job(broker.pid) else 0.0

    def works_the_job(self, pid: int) -> bool:
        with JobStore.open(self.db) as store:
            return any(f":{pid}:" in worker.worker for worker in store.job_workers(self.job_id))

    def stages_ready(self, min_up_s: float) -> list[str]:
        """Stages alive, not stopped, registered and answered, up for a while, whose broker is up for a while: a
        fault on them is seen."""
        now = time.monotonic()
        return sorted(name for name, (i, process) in self.stages.items()
                      if process.poll() is None and name not in self.stopped and self.up_for(i) >= min_up_s
                      and now - self.stage_started[name] >= min_up_s and self.registered(name))

    def registered(self, name: str) -> bool:
        """The running process of this stage has registered and its broker answered (its log says so)."""
        with open(self.logs / f"{name}.log", "rb") as log:
            log.seek(self.stage_log_from[name])
            text = log.read().decode(errors="replace")
        return " answered (after " in text

    def placing_since(self, i: int, since: float) -> bool:
        """Broker i logged a placement ("placing ...") after `since` (seconds of the epoch)."""
        text = (self.logs / f"broker-{i}.log").read_text(errors="replace")
        for line in text.splitlines()[-200:]:
            if "placing " in line:
                try:
                    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except ValueError:
                    continue
                if stamp >= since:
                    return True
        return False

    def done(self) -> bool:
        return all(self.broker_done)

    def stop(self) -> None:
        for name, (_, process) in self.stages.items():
            if name in self.stopped:
                self.signal_stage(name, signal.SIGCONT)
        for process in [p for p in self.brokers if p is not None] + [p for _, p in self.stages.values()]:
            if process.poll() is None:
                process.kill()
            process.wait(30)


def inject(cluster: Cluster, rng: random.Random, kind: str, started: float) -> Fault | None:
    """One fault of `kind` on a target drawn from `rng`; None when nothing fit (no target ready yet)."""
    ready = cluster.stages_ready(min_up_s=MIN_UP_S)
    at, round_s = now_utc().isoformat(), time.monotonic() - started
    if kind in ("stage-kill", "stage-stop", "kill-while-loading") and ready:
        name = rng.choice(ready)
        if kind == "stage-stop":
            pause = rng.uniform(LIVENESS_S + 1.0, LIVENESS_S + 5.0)
            cluster.signal_stage(name, signal.SIGSTOP)
            cluster.stopped[name] = time.monotonic() + pause
            return Fault(at, round_s, kind, name, f"stopped {pause:.1f} s")
        cluster.signal_stage(name, signal.SIGKILL)
        if kind == "stage-kill":
            return Fault(at, round_s, kind, name)
        broker, killed_at = cluster.stages[name][0], time.time()
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and not cluster.placing_since(broker, killed_at):
            time.sleep(0.05)
        others = [n for n in cluster.stages_ready(min_up_s=0.0) if cluster.stages[n][0] == broker and n != name]
        if not others:
            return Fault(at, round_s, "stage-kill", name, "no second stage to kill while loading")
        second = rng.choice(others)
        cluster.signal_stage(second, signal.SIGKILL)
        return Fault(at, round_s, kind, f"{name},{second}", "the second killed as the re-plan loaded")
    if kind == "broker-kill":
        up = [i for i in range(len(cluster.brokers)) if cluster.up_for(i) >= MIN_UP_S and not cluster.broker_done[i]]
        if not up:
            return None
        i = rng.choice(up)
        pid = cluster.kill_broker(i)
        return Fault(at, round_s, kind, f"broker-{i} pid {pid}", "restarted 2 s later")
    if kind == "late-stage":
        i = rng.randrange(len(cluster.brokers))
        if cluster.up_for(i) < MIN_UP_S:
            return None
        cluster.late += 1
        name = f"b{i}-late{cluster.late}"
        cluster.start_stage(i, name)
        return Fault(at, round_s, kind, name)
    return None


def run_round(work: Path, model: Path, items: Path, db: str, config: SoakConfig, rng: random.Random,
              reference: dict[str, str], env: dict) -> RoundReport:
    submitted = subprocess.run([layerbus_executable(), "submit", str(items), "--model", str(model), "--db", db,
                                "--task", "generate"], env=env, capture_output=True, text=True, timeout=600)
    if submitted.returncode != 0:
        raise RuntimeError(f"submit failed: {submitted.stderr}")
    job_id = submitted.stdout.strip()
    report = RoundReport(job_id, 0.0, config.items)
    cluster = Cluster(work / job_id, model, db, job_id, config, env)
    kill_finalizer = rng.random() < config.finalizing_kill_share
    started = time.monotonic()
    next_fault = started + rng.uniform(*config.fault_gap_s)
    try:
        cluster.start()
        with JobStore.open(db) as store:
            while not cluster.done():
                cluster.supervise()
                time.sleep(0.1)
                if time.monotonic() - started > ROUND_TIMEOUT_S:
                    report.problems.append(f"the job did not end within {ROUND_TIMEOUT_S:.0f} s")
                    break
                status = store.job_status(job_id)
                if status.status == "finalizing" and kill_finalizer:
                    holder = store.job_finalization(job_id).holder
                    pid = int(holder.split(":")[-2]) if holder else None
                    broker = next((i for i, p in enumerate(cluster.brokers) if p is not None and p.pid == pid), None)
                    if broker is not None and cluster.brokers[broker].poll() is None:
                        kill_finalizer = False
                        at = now_utc().isoformat()
                        cluster.kill_broker(broker)
                        report.faults.append(Fault(at, time.monotonic() - started, "finalizing-kill",
                                                   f"broker-{broker} pid {pid}", "restarted 2 s later"))
                left, elapsed = status.queued + status.in_progress, time.monotonic() - started
                expected_left_s = left * elapsed / status.completed if status.completed else float("inf")
                if time.monotonic() >= next_fault and status.status == "in_progress" and expected_left_s > QUIET_TAIL_S:
                    next_fault = time.monotonic() + rng.uniform(*config.fault_gap_s)
                    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
                    fault = inject(cluster, rng, kind, started)
                    if fault is not None:
                        report.faults.append(fault)
                        print(f"  {fault.round_s:7.1f} s  {fault.kind:<19} {fault.target} {fault.detail}", flush=True)
        report.seconds = time.monotonic() - started
    finally:
        cluster.stop()
    check_round(report, db, job_id, reference, env, [p.returncode for p in cluster.brokers if p is not None], model,
                items)
    return report


def reference_outputs(work: Path, model: Path, items: Path, env: dict) -> dict[str, str]:
    """The same job run once with no fault: what every round must give."""
    import pyarrow.parquet as pq

    db = f"sqlite:///{work / 'reference.db'}"
    done = subprocess.run([layerbus_executable(), "run", str(items), "--model", str(model), "--db", db, "--task",
                           "generate", "--stages", "2", "--threads-per-stage", "1"], env=env, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the fault-free run failed: {done.stderr[-2000:]}")
    with JobStore.open(db) as store:
        job_id = store.list_jobs(limit=1)[0].job_id
        path = store.job_status(job_id).results_path
    return {row["custom_id"]: row["output"] for row in pq.read_table(path).to_pylist()}


def soak(config: SoakConfig, work: Path, db: str, model: Path | None = None) -> dict:
    """Run rounds for `config.minutes`; the report (also what goes to JSON)."""
    from tests.helpers.tiny_models import make_tiny_model

    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LAYERBUS_HOME": str(work / "home"), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    model = model or make_tiny_model("llama", work / "model")
    items = write_items(work / "items.jsonl", model.name, config.items, config.max_new_tokens)
    print(f"soak: seed {config.seed}, {config.items} items, {config.minutes:g} min, store {db.split('@')[-1]}",
          flush=True)
    fault_free_started = time.monotonic()
    reference = reference_outputs(work, model, items, env)
    fault_free_s = time.monotonic() - fault_free_started
    rng = random.Random(config.seed)
    rounds: list[RoundReport] = []
    deadline = time.monotonic() + 60 * config.minutes
    while time.monotonic() < deadline or not rounds:
        print(f"round {len(rounds) + 1}:", flush=True)
        rounds.append(run_round(work, model, items, db, config, rng, reference, env))
        last = rounds[-1]
        print(f"  {last.job_id}: {len(last.faults)} fault(s) in {last.seconds:.0f} s; "
              f"{'ok' if all(last.checks.values()) else 'FAILED: ' + '; '.join(last.problems)}", flush=True)
    by_kind: dict[str, int] = {}
    for report in rounds:
        for fault in report.faults:
            by_kind[fault.kind] = by_kind.get(fault.kind, 0) + 1
    return {"config": asdict(config), "store": "postgresql" if db.startswith("postgresql") else "sqlite",
            "fault_free_s": fault_free_s, "rounds": [asdict(r) for r in rounds], "faults_by_kind": by_kind,
            "ok": all(all(r.checks.values()) for r in rounds), "measured_at": now_utc().isoformat(),
            "cores": os.cpu_count()}


def print_table(result: dict) -> None:
    rounds = result["rounds"]
    print(f"\nsoak on {result['store']}: {len(rounds)} round(s) of {result['config']['items']} items, seed "
          f"{result['config']['seed']}; the fault-free run took {result['fault_free_s']:.0f} s")
    print(f"{'round':<7}{'job':<18}{'seconds':>9}{'faults':>8}  checks")
    for n, r in enumerate(rounds, 1):
        failed = [name for name, ok in r["checks"].items() if not ok]
        print(f"{n:<7}{r['job_id']:<18}{r['seconds']:>9.0f}{len(r['faults']):>8}  "
              f"{'all hold' if not failed else 'FAILED ' + ', '.join(failed)}")
    print("faults by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(result["faults_by_kind"].items())))
    print("every id once, outputs identical, nothing stranded, counters exact, every fault seen: "
          f"{'yes' if result['ok'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="each item's budget (default: 32)")
    parser.add_argument("--seed", type=int, default=None, help="default: drawn, and printed")
    parser.add_argument("--postgres", action="store_true", help="a throwaway PostgreSQL server as the store")
    parser.add_argument("--db", default=None, help="a store URL (default: SQLite in the work folder)")
    parser.add_argument("--work", type=Path, default=None, help="where logs and the store go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    config = SoakConfig(minutes=args.minutes, items=args.items, seed=seed, max_new_tokens=args.max_new_tokens)
    work = args.work or Path(tempfile.mkdtemp(prefix="layerbus-soak-"))
    with ExitStack() as stack:
        db = args.db or f"sqlite:///{work / 'soak.db'}"
        if args.postgres:
            from tests.helpers.fixtures_postgres import create_database, throwaway_postgres

            db = create_database(stack.enter_context(throwaway_postgres()), "soak")
        result = soak(config, work, db)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"written to {args.out}; logs in {work}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
