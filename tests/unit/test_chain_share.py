"""Each chain of a job plans for its share of the job's items: the brokers of `run --chains K`
and the planner pricing a grouping see the items a chain will really run, not the whole job K times."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerbus.broker.broker import BrokerConfig
from layerbus.launch.local_cluster import LocalStageOptions
from layerbus.planner.placement import PlanOptions
from layerbus.broker.job_simulation import job_shape
from layerbus.planner.planning import one_chain_planner
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.workload import Workload
from layerbus.launch.chains import chain_runs
from layerbus.jobs.chain_split import split_stages
from layerbus.jobs.leases import LeaseConfig
from tests.helpers.chain_cases import MODEL, stage

PROMPTS = (10, 11, 12, 13, 14, 15, 16)
BUDGETS = (4, 5, 6, 7, 8, 9, 10)


@pytest.mark.parametrize("index, count, prompts, budgets", [
    (0, 1, PROMPTS, BUDGETS),  # one chain runs the whole job
    (0, 2, (10, 12, 14, 16), (4, 6, 8, 10)),  # every other item, from the chain's place in the queue
    (1, 2, (11, 13, 15), (5, 7, 9)),
    (2, 3, (12, 15), (6, 9)),
    (6, 7, (16,), (10,)),
])
def test_a_chain_s_share_is_every_count_th_item_from_its_place(index, count, prompts, budgets) -> None:
    share = Workload(PROMPTS, BUDGETS, 0.5).share(index, count)
    assert (share.prompt_lengths, share.max_new_tokens) == (prompts, budgets)
    assert share.output_fraction == 0.5 and share.represents is None


def test_every_item_is_in_exactly_one_chain_s_share() -> None:
    workload = Workload(PROMPTS, BUDGETS, 1.0, output_lengths=(1, 2, 3, 4, 5, 6, 7))
    shares = [workload.share(i, 3) for i in range(3)]
    assert sorted(n for s in shares for n in s.prompt_lengths) == sorted(PROMPTS)
    assert sorted(n for s in shares for n in s.output_lengths) == [1, 2, 3, 4, 5, 6, 7]


def test_more_chains_than_items_each_plan_for_one() -> None:
    two = Workload((10, 20), (4, 4))
    assert [two.share(i, 3).prompt_lengths for i in range(3)] == [(10,), (20,), (10,)]


def test_a_sample_keeps_its_mix_and_stands_for_a_count_th_of_the_job() -> None:
    sample = Workload((10, 20, 30), (4, 4, 4), represents=3000)
    share = sample.share(1, 4)
    assert share.prompt_lengths == sample.prompt_lengths and share.represents == 750
    assert Workload((10, 20, 30), (4, 4, 4), represents=4).share(0, 4).represents == 3, \
        "a sample never stands for fewer items than it lists"


@pytest.mark.parametrize("index, count", [(2, 2), (-1, 2), (0, 0)])
def test_a_place_outside_the_chains_is_refused(index, count) -> None:
    with pytest.raises(ValueError, match="chain index"):
        Workload(PROMPTS, BUDGETS).share(index, count)


def test_run_chains_gives_each_chain_s_broker_its_share(tmp_path: Path) -> None:
    workload = Workload(PROMPTS, BUDGETS)
    runs = chain_runs(split_stages(4, 2), "sqlite:///x.db", "job_1", BrokerConfig("model", 4, workload=workload),
                      LocalStageOptions(threads_per_stage=1), tmp_path, LeaseConfig(), tmp_path)
    assert [run.config.workload.prompt_lengths for run in runs] == [(10, 12, 14, 16), (11, 13, 15)]
    alone = chain_runs(split_stages(2, 2), "sqlite:///x.db", "job_1", BrokerConfig("model", 2),
                       LocalStageOptions(threads_per_stage=1), tmp_path, LeaseConfig(), tmp_path)
    assert [run.config.workload for run in alone] == [None, None], "a job without a workload plans without one"


def test_the_planner_prices_a_chain_of_a_grouping_for_its_share_of_the_job() -> None:
    workload = Workload.of([3] * 40, 4)
    plan_one = one_chain_planner(BatchingConfig(micro_batch_size=2, max_context=8, max_step_tokens=4),
                                 MODEL, PlanOptions(), workload=workload, job_shape=job_shape)
    pool = [stage("a"), stage("b")]
    whole, half = plan_one(pool, (), 1).chosen, plan_one(pool, (), 2).chosen
    assert whole.new_tokens == 160 and half.new_tokens == 80


def test_a_chain_s_caches_are_made_for_the_longest_item_of_the_whole_job() -> None:
    """A chain may take any item (the other chain lost, or faster): its KV caches are sized at load for
    the job's longest, not grown mid-job for an item outside its share."""
    workload = Workload((10, 500, 10, 10), (4, 40, 4, 4))
    assert workload.share(0, 2).longest_sequence == 540
    assert workload.share(0, 2).with_output_lengths([1, 1]).longest_sequence == 540
