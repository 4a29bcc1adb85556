"""The chaos soak (bench/soak.py) for two minutes: two brokers and their stages started by hand work one job while
a seeded schedule kills, stops and restarts stages and brokers, starts stages late, and kills a broker as it
finalizes; every round must end with every item exactly once, nothing left queued or in progress, the job's
counters equal to a count of its items, every fault said in the job's events, and the outputs of a
fault-free run. An output may differ only at a greedy near-tie (the model's two best logits closer than float
rounding moves them, which the soak names with the gap): anything else fails."""

from __future__ import annotations

import re

from bench.soak import SoakConfig, soak

NEAR_TIE = 1e-5


def test_two_minutes_of_random_faults_lose_and_double_nothing(tmp_path):
    config = SoakConfig(minutes=2.0, items=600, seed=5, max_new_tokens=16)
    result = soak(config, tmp_path / "soak", f"sqlite:///{tmp_path / 'soak.db'}")
    assert result["rounds"], "at least one round ran"
    assert sum(result["faults_by_kind"].values()) >= 1, result["faults_by_kind"]
    for round_ in result["rounds"]:
        checks, problems = round_["checks"], round_["problems"]
        for name in ("completed", "brokers_exit_0", "nothing_left_in_progress", "counters_equal_a_count",
                     "every_id_once", "every_fault_seen"):
            assert checks[name], (name, problems, round_["faults"])
        if not checks["outputs_identical"]:
            said = " ".join(problems)
            differ = int(re.search(r"(\d+) output\(s\) differ", said).group(1))
            gaps = [float(gap) for gap in re.findall(r"the two best logits ([0-9.e+-]+) apart", said)]
            assert len(gaps) == differ and all(gap < NEAR_TIE for gap in gaps), problems
