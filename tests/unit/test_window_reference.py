"""`placement.window_s` prices every window of every chain and split the planner tries (thousands per plan),
so it is written for speed: what does not change between the rounds of its fixed point is worked out once,
and `_cores_stretch` is done inline. Here the plain version (each round works out everything again) is the
specification, and the fast one must give the very same
figures, to the last bit, on random chains: CPU and GPU stages, hosts shared or not, threads, emulated
devices, measured co-run factors and other chains' stages on the same hosts."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from layerbus.planner.window_pricing import MIN_CORE_SHARE, Neighbour, _cores_stretch, _hosts, _on, window_s
from layerbus.planner.plan_values import StageProfile
from layerbus.planner.step_cost import StepWork
from layerbus.planner.workload import Window


def reference_window_s(alone, chain, window, num_micro_batches, latency=None, neighbours=()):
    steps = max(window.work.steps, 1e-12)
    if latency is None:
        latency = sum(s.link_latency_s for s in chain)
    busy = list(alone)
    time = 0.0
    for _ in range(8):
        chain_bound = window.longest_chain * (sum(busy) / steps + latency)
        host_bound = 0.0
        for host, cores in _hosts(chain).items():
            if any(s.corun_factor > 0 for s in chain if _on(s, host)):
                continue
            demand = sum(b * s.compute_share * max(1, s.threads) for b, s in zip(alone, chain) if _on(s, host))
            taken = sum(n.cores for n in neighbours if _on(n.profile, host))
            host_bound = max(host_bound, demand / max(cores - taken, MIN_CORE_SHARE * cores))
        in_step = 0.0  # a ring of one micro-batch per stage (and one at the broker) starts a host's stages together
        together = set()
        if num_micro_batches <= len(chain) + 1 and window.work.steps > 0:
            for host in _hosts(chain):
                on = [k for k, s in enumerate(chain) if _on(s, host)]
                excess = max(chain[k].lockstep_excess_s for k in on)
                if len(on) >= 2 and excess > 0 and not any(_on(n.profile, host) for n in neighbours):
                    in_step = max(in_step, max(busy[k] for k in on) + window.work.steps * excess)
                    together.update(on)
        time = max(max(busy, default=0.0), chain_bound, host_bound, in_step)
        if time <= 0:
            return 0.0, busy
        stretched = []
        for k, (b, s) in enumerate(zip(alone, chain)):
            others = [j for j, o in enumerate(chain) if j != k and _on(o, s.host)]
            near = [(n.profile, min(1.0, n.busy)) for n in neighbours if _on(n.profile, s.host)]
            if not s.shares_cores or not (others or near):
                stretched.append(b)
                continue
            sharing = [(chain[j], 1.0 if k in together else min(1.0, busy[j] / time)) for j in others] + near
            cores = _cores_stretch(s, sharing)
            if s.corun_factor > 0:
                at_full = _cores_stretch(s, [(o, 1.0) for o, _ in sharing])
                if at_full > 1:
                    cores = 1 + (min(s.corun_factor, at_full) - 1) * (cores - 1) / (at_full - 1)
                rest = max(1.0, s.corun_factor / at_full)
                overlap = sum(share for _, share in sharing) / len(sharing)
                stretched.append(b * cores * (1 + (rest - 1) * overlap))
            else:
                stretched.append(b * cores)
        busy = stretched
    return max(time, max(busy, default=0.0)), busy


def random_case(rnd: random.Random):
    chain = [StageProfile(f"s{i}", 1e-3, 1e-2, 1e-4, 1e-3, 1 << 30, device=rnd.choice(["cpu", "cpu", "cuda:0"]),
                          host=rnd.choice(["a", "b", ""]), host_cores=rnd.choice([0, 1, 2, 4]),
                          threads=rnd.choice([0, 1, 2]), compute_share=rnd.choice([1.0, 0.5, 0.33]),
                          corun_factor=rnd.choice([0.0, 0.0, 1.1, 1.6, 2.3]), link_latency_s=rnd.random() * 1e-3,
                          lockstep_excess_s=rnd.choice([0.0, 0.0, 1e-3, 0.05]))
             for i in range(rnd.randint(1, 8))]
    neighbours = [Neighbour(replace(rnd.choice(chain), name=f"n{i}", host=rnd.choice(["a", "b"]),
                                    threads=rnd.choice([1, 2, 3])), rnd.random() * 1.3, rnd.random() * 2)
                  for i in range(rnd.choice([0, 0, 1, 3]))]
    alone = [rnd.random() * rnd.choice([0.0, 1.0, 10.0]) for _ in chain]
    window = Window(StepWork(steps=rnd.randint(0, 50)), 10.0, rnd.randint(1, 20))
    return alone, chain, window, rnd.randint(1, 5), rnd.choice([None, 0.0, 2e-3]), neighbours


@pytest.mark.parametrize("seed", range(4))
def test_the_fast_window_gives_the_plain_versions_figures_to_the_last_bit(seed) -> None:
    rnd = random.Random(seed)
    for _ in range(1000):
        case = random_case(rnd)
        assert window_s(*case) == reference_window_s(*case), case


def random_plan_case(rnd: random.Random):
    """A few stages with their own costs, hosts, threads and memory, on a 12-layer model, and a job."""
    from layerbus.planner.placement import ModelMemory
    from layerbus.planner.batching import BatchingConfig
    from layerbus.planner.step_cost import LinearCost
    from layerbus.planner.workload import Workload
    from layerbus.broker.job_simulation import job_shape

    stages = [StageProfile(f"s{i}", 1.0, 1.0, rnd.random() * 0.1, rnd.random() * 3, rnd.choice([10**9, 700, 450]),
                           layer_cost=LinearCost(per_row_s=rnd.uniform(0.2, 2), per_token_s=rnd.uniform(0.02, 0.5)),
                           overhead_cost=LinearCost(per_step_s=rnd.random()), device=rnd.choice(["cpu", "cuda:0"]),
                           host=rnd.choice(["h", "g"]), host_cores=rnd.choice([1, 2, 4]), threads=rnd.choice([1, 2]),
                           compute_share=rnd.choice([1.0, 0.4]), corun_factor=rnd.choice([0.0, 1.3, 1.8]),
                           lockstep_excess_s=rnd.choice([0.0, 0.2]))
              for i in range(rnd.randint(1, 4))]
    memory = ModelMemory(layer_weight_bytes=(100,) * 12, embed_bytes=10, head_bytes=10, head_shares_embed=False,
                         kv_bytes_per_token=1, activation_bytes_per_token=0, hidden_size=2, intermediate_size=4,
                         num_attention_heads=1, vocab_size=8, dtype_bytes=4)
    batching = BatchingConfig(num_slots=8, num_micro_batches=2, max_step_tokens=32, max_context=128).resolved(len(stages))
    job = job_shape(Workload.of([rnd.randint(5, 60) for _ in range(8)], rnd.randint(4, 30)), batching, windows=8)
    return stages, memory, batching, job


@pytest.mark.parametrize("seed", range(3))
def test_pricing_from_the_lowest_floor_up_chooses_what_pricing_every_candidate_chooses(seed, monkeypatch) -> None:
    from layerbus.planner import placement
    from layerbus.planner.placement import PlacementError, PlanOptions, plan_placement

    rnd = random.Random(seed)
    for _ in range(40):
        stages, memory, batching, job = random_plan_case(rnd)
        options = PlanOptions(allow_drop=rnd.random() < 0.5, drop_tolerance=rnd.choice([0.0, 0.2]))

        def plan():
            try:
                chosen = plan_placement(stages, memory, batching, options, job)
            except PlacementError as error:
                return str(error)
            return chosen.order, chosen.spans, chosen.chosen.job_s, chosen.left_out

        pruned = plan()
        with monkeypatch.context() as patch:  # every floor 0: every candidate priced
            patch.setattr(placement._CostModel, "job_floor_s", lambda self, chain, spans: 0.0)
            everything = plan()
        assert pruned == everything
