"""`layerbus run --chains K` without processes: bad K refused before anything is queued, each chain's share
of the stages' budgets and threads, and events that name their chain."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalStageOptions
from layerbus.cli.main import main as layerbus_main
from layerbus.jobs.chain_events import ChainEvents
from layerbus.jobs.chain_split import split_stages
from layerbus.jobs.leases import LeaseConfig
from layerbus.launch.chains import chain_runs
from layerbus.storage import JobStore
from tests.helpers.store_items import SETTINGS, new_items


@pytest.mark.parametrize("stages, chains, named", [
    ("2", "3", ["--chains 3 with --stages 2", "--chains 2 or fewer", "--stages 3 or more"]),
    ("3", "0", ["--chains 0", "--chains 1", "up to --chains 3"]),
    ("3", "-2", ["--chains -2"]),
])
def test_bad_chain_counts_are_usage_errors_before_anything_is_queued(tmp_path: Path, capsys, stages, chains, named):
    db = tmp_path / "jobs.db"
    code = layerbus_main(["run", str(tmp_path / "missing.jsonl"), "--task", "summarize", "--stages", stages,
                          "--chains", chains, "--db", f"sqlite:///{db}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert all(part in err for part in named), err
    assert not db.exists(), "nothing was queued: the store was not even opened"


@pytest.mark.parametrize("option", [["--metrics", "0"], ["--trace", "trace.json"]])
def test_one_broker_options_are_refused_with_several_chains(tmp_path: Path, capsys, monkeypatch, option):
    monkeypatch.chdir(tmp_path)
    code = layerbus_main(["run", "in.jsonl", "--task", "summarize", "--stages", "2", "--chains", "2", *option])
    err = capsys.readouterr().err
    assert code == 2 and option[0] in err and "--chains 1" in err, err


def test_each_stage_keeps_its_own_budget_and_threads_are_shared_over_all_stages(tmp_path: Path):
    budgets = tuple(("--memory-budget", f"{100 * (i + 1)}MB") for i in range(5))
    options = LocalStageOptions(log_dir=tmp_path, stage_args=budgets, threads_per_stage=0)
    config = BrokerConfig("model", 5)
    runs = chain_runs(split_stages(5, 2), "sqlite:///x.db", "job_1", config, options, tmp_path, LeaseConfig(), tmp_path)
    assert [run.config.num_stages for run in runs] == [3, 2]
    assert [run.options.first_stage for run in runs] == [0, 3]
    assert runs[0].options.stage_args == budgets[:3] and runs[1].options.stage_args == budgets[3:]
    assert [run.log_path.name for run in runs] == ["chain-1.log", "chain-2.log"]
    assert {run.options.threads_per_stage for run in runs} == {max(1, (os.cpu_count() or 1) // 5)}
    unbudgeted = chain_runs(split_stages(4, 2), "sqlite:///x.db", "job_1", BrokerConfig("model", 4),
                            LocalStageOptions(threads_per_stage=2), tmp_path, LeaseConfig(), tmp_path)
    assert [run.options.stage_args for run in unbudgeted] == [(), ()]
    assert {run.options.threads_per_stage for run in unbudgeted} == {2}, "--threads-per-stage is kept"


def test_a_chains_events_and_worker_record_name_the_chain(tmp_path: Path):
    with JobStore.open(f"sqlite:///{tmp_path / 'jobs.db'}") as store:
        job_id = store.create_job(SETTINGS, new_items(1))
        chain = ChainEvents(store, "chain 2")
        chain.add_job_event(job_id, "stage_lost", "stage stage-3 lost")
        chain.register_worker(job_id, "vm:1:ab", "vm", "stage-2 [0, 4)")
        assert store.job_events(job_id)[-1].message == "chain 2: stage stage-3 lost"
        assert store.job_workers(job_id)[0].chain == "chain 2: stage-2 [0, 4)"
        assert chain.job_status(job_id).total == 1, "everything else is the store's own"


@pytest.mark.parametrize("args, named", [
    (["--chains", "auto", "--partition", "balanced"], ["--chains auto", "--partition balanced", "pin --chains K"]),
    (["--chains", "auto", "--metrics", "0"], ["--metrics and --trace serve one broker", "--chains 1"]),
    (["--chains", "AUTO", "--trace", "t.json"], ["--metrics and --trace serve one broker"]),
])
def test_chains_auto_refuses_what_it_cannot_serve_before_anything_is_queued(tmp_path: Path, capsys, monkeypatch,
                                                                            args, named):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "jobs.db"
    code = layerbus_main(["run", "in.jsonl", "--task", "summarize", "--stages", "2", "--db", f"sqlite:///{db}", *args])
    err = capsys.readouterr().err
    assert code == 2 and all(part in err for part in named), err
    assert not db.exists()


def test_a_chain_count_that_is_no_number_names_the_choices(capsys):
    with pytest.raises(SystemExit) as ended:
        layerbus_main(["run", "in.jsonl", "--task", "summarize", "--chains", "two"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "'two' is not a number of chains" in err and "or auto" in err, err


def test_the_planner_s_chains_are_dealt_in_order_with_its_sizes():
    from layerbus.cli.chain_choice import chains_of, dealt_as_planned
    from tests.helpers.chain_cases import HALF_MODEL_BUDGET, plan_one, stage
    from layerbus.planner.chain_plan import ChainPlanOptions, plan_chains

    alike = [stage(f"stage-{i}", overhead=0.05, budget=HALF_MODEL_BUDGET) for i in range(4)]
    plan = plan_chains(alike, plan_one, ChainPlanOptions(chains=2))
    assert [(c.first, c.count) for c in chains_of(plan)] == [(0, 2), (2, 2)] and dealt_as_planned(plan)
    # stage-0 and stage-1 slow, stage-2 and stage-3 fast: the planner pairs a fast one with a slow one
    mixed = [stage(f"stage-{i}", layer=0.03 if i < 2 else 0.01, overhead=0.05, budget=HALF_MODEL_BUDGET)
             for i in range(4)]
    plan = plan_chains(mixed, plan_one, ChainPlanOptions(chains=2))
    assert [(c.first, c.count) for c in chains_of(plan)] == [(0, 2), (2, 2)]
    assert not dealt_as_planned(plan), plan.chosen.groups
