"""The plan's cost model of a job (pure): step costs fitted from profiled shapes, a job's windows from
the scheduler, phases priced window by window, CPU stages sharing a host's cores."""

from __future__ import annotations

import pytest

from layerbus.planner.placement import ModelMemory, Shapes, StageProfile, estimate_split, plan_placement
from layerbus.planner.plan_report import format_prediction, prediction_report
from layerbus.planner.batching import BatchingConfig
from layerbus.planner.step_cost import LinearCost, ProfilePoint, decode_step, fit_costs, prefill_step
from layerbus.planner.workload import Workload, shared_prefix_blocks, spread_shares
from layerbus.broker.job_simulation import job_shape
from layerbus.planner.sample_places import sample_places
from layerbus.wire.spans import LayerRange

TRUE_LAYER = LinearCost(per_pass_s=2.0, per_row_s=0.5, per_row_kv_s=0.01, per_token_s=0.2, per_token_ctx_s=0.001)
TRUE_OVERHEAD = LinearCost(per_step_s=1.0, per_row_s=0.05, per_token_s=0.01)


def test_fit_recovers_the_coefficients_of_a_linear_stage() -> None:
    works = [decode_step(32, 256), decode_step(8, 256), decode_step(32, 512), prefill_step(256), prefill_step(256, 256)]
    points = [ProfilePoint(w, TRUE_OVERHEAD.of(w) + TRUE_LAYER.of(w), TRUE_LAYER.of(w)) for w in works]
    layer, overhead = fit_costs(*points)
    for got, want in ((layer, TRUE_LAYER), (overhead, TRUE_OVERHEAD)):
        for field, value in want.to_json().items():
            assert getattr(got, field) == pytest.approx(value, rel=1e-9, abs=1e-12), field


def test_noise_never_makes_a_coefficient_negative() -> None:
    works = [decode_step(32, 256), decode_step(8, 256), decode_step(32, 512), prefill_step(256), prefill_step(256, 256)]
    # Fewer rows measured slower, a longer context faster: noise. The fit stays non-negative.
    times = [10.0, 11.0, 9.0, 30.0, 29.0]
    layer, overhead = fit_costs(*[ProfilePoint(w, t + 1.0, t) for w, t in zip(works, times)])
    assert all(value >= 0 for value in layer.to_json().values())
    assert layer.of(works[0]) == pytest.approx(10.0)  # the requested shape is still priced as measured


def test_job_shape_counts_every_prompt_token_and_new_token() -> None:
    workload = Workload.of([40, 300, 5, 120], [8, 16, 4, 30], output_fraction=0.5)
    batching = BatchingConfig(num_slots=4, num_micro_batches=2, max_step_tokens=64, max_context=512).resolved(1)
    shape = job_shape(workload, batching, windows=4)
    total = shape.total
    outputs = workload.expected_lengths()
    assert outputs == [4, 8, 2, 15]
    assert shape.new_tokens == sum(outputs)
    assert total.prefill_tokens == 40 + 300 + 5 + 120  # every prompt position prefilled once
    assert total.decode_rows == sum(outputs) - len(outputs)  # the first token comes with the prefill
    assert total.emit_rows == sum(outputs)
    assert len(shape.windows) == 4
    # Phases: the first window prefills, the last only decodes (the drain).
    assert shape.windows[0].work.prefill_tokens > 0 and shape.windows[-1].work.prefill_tokens == 0


@pytest.mark.parametrize("shares, count, want", [
    ([0.5], 3, [0.5, 0.5, 0.5]),
    ([0.25, 1.0], 4, [0.25, 0.25, 1.0, 1.0]),  # each part of the distribution as often as the others
    ([0.1, 0.2, 0.3, 0.4], 2, [0.1, 0.3]),  # fewer items than shares: evenly spaced ones
    ([0.1, 0.2, 0.3], 6, [0.1, 0.1, 0.2, 0.2, 0.3, 0.3]),
])
def test_spread_shares_keeps_the_distribution(shares, count, want) -> None:
    spread = spread_shares(shares, range(count))
    assert sorted(spread) == want
    assert spread == spread_shares(shares, range(count))  # the same workload is always priced the same


@pytest.mark.parametrize("places, spread_at_most", [
    (range(1000), 3), (range(500, 1500), 3), (range(0, 3000, 7), 3),  # runs of items, or every k-th: even
    # An evenly spread sample's places are not a run: even to within a few, where a random draw of 300
    # into 10 shares is 15-20 apart from the most drawn to the least
    (sample_places(300, 3000), 8), (sample_places(300, 3010), 8),
], ids=["the first 1000", "a later run", "every 7th", "a spread sample", "another spread sample"])
def test_every_share_comes_about_as_often_over_any_items(places, spread_at_most) -> None:
    shares = [k / 10 for k in range(1, 11)]
    spread = spread_shares(shares, places)
    counts = [spread.count(share) for share in shares]
    assert max(counts) - min(counts) <= spread_at_most, counts


def test_a_sample_is_given_the_shares_its_items_get_in_the_whole_job() -> None:
    prompts, budgets = [10 + k % 37 for k in range(3000)], [16 + 16 * (k % 3) for k in range(3000)]
    shares = [0.05, 0.3, 0.6, 1.0]
    whole = Workload.of(prompts, budgets).with_output_shares(shares)
    places = sample_places(300, 3000)
    sample = Workload.of([prompts[p] for p in places], [budgets[p] for p in places],
                         represents=3000).with_output_shares(shares)
    assert sample.expected_lengths() == [whole.expected_lengths()[p] for p in places]


def test_outputs_spread_like_earlier_ones_keep_the_long_tail_the_mean_loses() -> None:
    # Half the earlier outputs ended at an eighth of their budget, half ran to it (mean 56%). At the mean,
    # every sequence ends after 36 tokens; spread, the job goes on until the long ones reach 64.
    shares = [0.125] * 4 + [1.0] * 4
    batching = BatchingConfig(num_slots=16, num_micro_batches=2, max_step_tokens=256, max_context=512).resolved(1)
    at_mean = Workload.of([20] * 16, 64, output_fraction=sum(shares) / len(shares))
    spread = Workload.of([20] * 16, 64).with_output_shares(shares)
    assert spread.output_fraction == pytest.approx(at_mean.output_fraction)
    assert sorted(spread.expected_lengths()) == [8] * 8 + [64] * 8
    assert sum(spread.expected_lengths()) == pytest.approx(sum(at_mean.expected_lengths()), rel=0.02)
    # About as many new tokens, far more steps: the drain of the long ones.
    assert job_shape(spread, batching).total.steps >= 1.6 * job_shape(at_mean, batching).total.steps
    assert "56% of the limit on average, 12% to 100% as 8 earlier outputs ended" in spread.describe()
    told = spread.with_output_lengths([5] * 16)  # lengths as produced replace the shares
    assert told.output_shares is None and told.expected_lengths() == [5] * 16
    with pytest.raises(ValueError, match="at least one share"):
        Workload.of([20], 64).with_output_shares([])


@pytest.mark.parametrize("prompts, want", [
    # Three prompts on one 32-token system part: its two blocks are shared, each one's own rest is not.
    ([[1] * 32 + [2] * 20, [1] * 32 + [3] * 40, [1] * 32 + [4] * 5], [(0, 1), (0, 1), (0, 1)]),
    # Two share a third block beyond the common two; the last shares only the first block, then differs.
    ([[1] * 48 + [5], [1] * 48 + [6] * 9, [1] * 32 + [7] * 16, [1] * 16 + [8] * 40], [(0, 1, 2), (0, 1, 2), (0, 1), (0,)]),
    # A block equal to another prompt's at a different place is not a shared prefix (the hashes chain).
    ([[9] * 16 + [1] * 16, [1] * 32], [(), ()]),
    # Alone, or shorter than a block: nothing shared.
    ([[1] * 40], [()]),
    ([[1] * 15, [1] * 15], [(), ()]),
], ids=["system part", "a tree", "same block elsewhere", "alone", "under a block"])
def test_shared_prefix_blocks_name_the_leading_blocks_another_prompt_starts_with(prompts, want) -> None:
    assert shared_prefix_blocks(prompts, 16) == tuple(want)


def test_a_workload_of_prompts_prices_only_the_prefill_the_prefix_cache_leaves() -> None:
    """8 prompts of 56 tokens on one 48-token prefix (3 blocks). The first computes it all; the second too,
    and saves the 3 blocks (a prefix is kept the second time it is seen); the other six wait for that save
    and restore it, computing their last 8 tokens: 56 + 56 + 6 x 8 = 160 prompt tokens, not 8 x 56 = 448."""
    prompts = [[1] * 48 + [100 + i] * 8 for i in range(8)]
    batching = BatchingConfig(num_slots=8, num_micro_batches=1, max_step_tokens=512, max_context=128).resolved(1)
    cached = job_shape(Workload.of_prompts(prompts, 4), batching)
    lengths_only = job_shape(Workload.of([56] * 8, 4), batching)
    assert cached.total.prefill_tokens == 160
    assert lengths_only.total.prefill_tokens == 448
    assert cached.new_tokens == lengths_only.new_tokens == 32
    # The cache off: every prompt token computed, shared prefix or not.
    from dataclasses import replace

    from layerbus.planner.prefix_budget import PrefixCacheConfig

    off = replace(batching, prefix_cache=PrefixCacheConfig(budget_tokens=0))
    assert job_shape(Workload.of_prompts(prompts, 4), off).total.prefill_tokens == 448


def test_a_chains_share_and_told_lengths_keep_the_prefix_signatures() -> None:
    workload = Workload.of_prompts([[1] * 20 + [i] for i in range(6)], 4)
    assert workload.prefix_blocks == ((0,),) * 6
    assert workload.share(1, 2).prefix_blocks == ((0,),) * 3
    assert workload.with_output_lengths([1] * 6).prefix_blocks == workload.prefix_blocks


@pytest.mark.parametrize("prompts, budgets, longest", [
    ([10, 300, 40], 64, 364),
    ([10, 300, 40], [500, 1, 1], 510),  # the longest sequence is not the longest prompt's
    ([], 64, 0),
], ids=["longest prompt", "largest budget", "no items"])
def test_the_longest_sequence_is_a_prompt_plus_its_budget(prompts, budgets, longest) -> None:
    # What the broker tells the stages to size their KV caches for (Broker._context_hint).
    assert Workload.of(prompts, budgets).longest_sequence == longest


def test_a_larger_job_is_sampled_and_scaled_back() -> None:
    import layerbus.broker.job_simulation as workload_module

    workload = Workload.of([10] * 400, 50)
    batching = BatchingConfig(num_slots=8, num_micro_batches=2, max_context=256).resolved(1)
    full = job_shape(workload, batching)
    old, workload_module.MAX_SIMULATED_ROWS = workload_module.MAX_SIMULATED_ROWS, 5000
    try:
        sampled = job_shape(workload, batching)
    finally:
        workload_module.MAX_SIMULATED_ROWS = old
    assert sampled.new_tokens == pytest.approx(full.new_tokens)
    assert sampled.total.steps == pytest.approx(full.total.steps, rel=0.05)


MEMORY = ModelMemory(layer_weight_bytes=(100,) * 12, embed_bytes=10, head_bytes=10, head_shares_embed=False,
                     kv_bytes_per_token=1, activation_bytes_per_token=0, hidden_size=2, intermediate_size=4,
                     num_attention_heads=1, vocab_size=8, dtype_bytes=4)
SHAPES = Shapes(num_slots=8, micro_batch_size=2, num_micro_batches=4, max_context=64, max_step_tokens=16)


def stage(name: str, host: str = "", cores: int = 0, device: str = "cpu", share: float = 1.0,
          per_row: float = 1.0) -> StageProfile:
    return StageProfile(name, layer_decode_s=1.0, layer_prefill_s=1.0, embed_s=0.0, head_s=0.0, memory_budget=10**9,
                        layer_cost=LinearCost(per_row_s=per_row, per_token_s=0.1), overhead_cost=LinearCost(),
                        host=host, host_cores=cores, threads=1, device=device, compute_share=share)


@pytest.mark.parametrize("stages, want_ratio", [
    # 3 one-thread stages on 3 hosts: no sharing.
    ([stage("a", "h1", 2), stage("b", "h2", 2), stage("c", "h3", 2)], 1.0),
    # ... on one host of 2 cores: 3 threads want 2 cores, the job takes 1.5x as long.
    ([stage("a", "h", 2), stage("b", "h", 2), stage("c", "h", 2)], 1.5),
    # GPU stages in one box do not compete for its CPU cores.
    ([stage("a", "h", 2, "cuda:0"), stage("b", "h", 2, "cuda:1"), stage("c", "h", 2, "cuda:2")], 1.0),
    # Emulated slower devices sleep most of their time: 3 x 1/3 of a core fits 2 cores.
    ([stage("a", "h", 2, share=1 / 3), stage("b", "h", 2, share=1 / 3), stage("c", "h", 2, share=1 / 3)], 1.0),
    # ... at half a core each, 3 on 1 core: 1.5 cores of work for each step of the chain. An emulated
    # step lasts its CPU time / its share (stages/emulation.py), so waiting for the core lengthens it
    # only beyond that: the cores, not the stretch of each stage, set the pace.
    ([stage("a", "h", 1, share=0.5), stage("b", "h", 1, share=0.5), stage("c", "h", 1, share=0.5)], 1.5),
])
def test_stages_sharing_a_hosts_cores_are_slower_together(stages, want_ratio) -> None:
    spans = [LayerRange(0, 4), LayerRange(4, 8), LayerRange(8, 12)]
    alone = estimate_split([stage(s.name) for s in stages], spans, MEMORY, SHAPES)
    shared = estimate_split(stages, spans, MEMORY, SHAPES)
    assert shared.job_s / alone.job_s == pytest.approx(want_ratio, rel=1e-6)


def test_phases_each_have_their_slowest_stage() -> None:
    # `fast_decode` decodes cheaply but prefills slowly; `slow_decode` the other way round. A job that
    # prefills, then decodes, is slower than the bottleneck of its summed work says: each phase waits
    # for a different stage. Priced window by window, the job takes longer than one window says.
    fast_decode = StageProfile("p", 1.0, 1.0, 0.0, 0.0, 10**9, layer_cost=LinearCost(per_row_s=0.1, per_token_s=1.0),
                               overhead_cost=LinearCost())
    slow_decode = StageProfile("d", 1.0, 1.0, 0.0, 0.0, 10**9, layer_cost=LinearCost(per_row_s=1.0, per_token_s=0.1),
                               overhead_cost=LinearCost())
    batching = BatchingConfig(num_slots=8, num_micro_batches=2, max_step_tokens=32, max_context=128).resolved(2)
    job = job_shape(Workload.of([60] * 8, 30), batching, windows=16)
    one_window = job_shape(Workload.of([60] * 8, 30), batching, windows=1)
    spans = [LayerRange(0, 6), LayerRange(6, 12)]
    phased = estimate_split([fast_decode, slow_decode], spans, MEMORY, batching, job=job)
    summed = estimate_split([fast_decode, slow_decode], spans, MEMORY, batching, job=one_window)
    assert phased.job_s > 1.2 * summed.job_s
    assert phased.new_tokens == summed.new_tokens == 8 * 30
    # And the planner, told the job, finds the split that finishes it soonest.
    plan = plan_placement([fast_decode, slow_decode], MEMORY, batching, job=job)
    best = min(estimate_split(chain, [LayerRange(0, k), LayerRange(k, 12)], MEMORY, batching, job=job).job_s
               for chain in ([fast_decode, slow_decode], [slow_decode, fast_decode]) for k in range(1, 12))
    assert plan.chosen.job_s == pytest.approx(best)


def test_prediction_report_has_a_line_per_stage() -> None:
    stages = [stage("a"), stage("b")]
    plan = plan_placement(stages, MEMORY, SHAPES)
    before = {"a": {"busy_s": 1.0, "steps": 10}, "b": {"busy_s": 0.0, "steps": 0}}
    after = {"a": {"busy_s": 11.0, "steps": 110}, "b": {"busy_s": 8.0, "steps": 100}}
    report = prediction_report(plan, before, after, new_tokens=200, wall_s=20.0)
    assert report["stages"]["a"]["measured_ms_per_step"] == pytest.approx(100.0)
    assert report["stages"]["b"]["measured_tok_s"] == pytest.approx(25.0)
    assert report["measured_tok_s"] == pytest.approx(10.0)
    lines = format_prediction(report)
    assert len(lines) == 4 and [line.split()[0] for line in lines[1:3]] == plan.order  # in chain order
    assert lines[-1].startswith(f"run: {plan.tokens_per_s:.1f} tok/s predicted, 10.0 measured")


def test_a_run_that_only_scored_reports_documents_per_second_and_tokens_scored() -> None:
    """An eval generates nothing: the plan counts one new token per scored document, so the run's line is in
    documents/s, with the positions scored, not "0 new tokens"."""
    stages = [stage("a"), stage("b")]
    plan = plan_placement(stages, MEMORY, SHAPES)
    after = {"a": {"busy_s": 10.0, "steps": 100}, "b": {"busy_s": 8.0, "steps": 100}}
    report = prediction_report(plan, {}, after, new_tokens=0, wall_s=20.0, finished=400, prompt_tokens=9000)
    assert report["measured_tok_s"] == pytest.approx(20.0) and report["scored"] == {"documents": 400, "tokens": 9000}
    run_line = format_prediction(report)[-1]
    assert run_line.startswith(f"run: {plan.tokens_per_s:.1f} documents/s predicted, 20.0 measured")
    assert run_line.endswith("; 9000 tokens scored for 400 documents in 20.0 s") and "new tokens" not in run_line


@pytest.mark.parametrize("factors, want_ratio", [
    ((1.5, 1.5), 1.5),  # measured: each step 1.5x slower while the other serves, and the other always does
    ((1.0, 1.0), 1.0),  # measured: sharing costs nothing (two cores, enough memory bandwidth)
    # Only the first suffers; it then sets the pace, the second waits for it part of the time and
    # disturbs it only then: busy_a = 1 + 1 / busy_a, the golden ratio (not 2x).
    ((2.0, 1.0), (1 + 5 ** 0.5) / 2),
])
def test_a_measured_corun_factor_replaces_the_thread_count(factors, want_ratio) -> None:
    from dataclasses import replace

    spans = [LayerRange(0, 6), LayerRange(6, 12)]
    two = [replace(stage("a", "h", 2), corun_factor=factors[0]), replace(stage("b", "h", 2), corun_factor=factors[1])]
    alone = estimate_split([stage("a"), stage("b")], spans, MEMORY, SHAPES)
    shared = estimate_split(two, spans, MEMORY, SHAPES)
    assert shared.job_s / alone.job_s == pytest.approx(want_ratio, rel=0.02)


@pytest.mark.parametrize("cuts, want_ratio", [
    # Every stage busy, as when the factor was measured: the job takes the measured 2x as long.
    ((0, 3, 6, 9, 12), 2.0),
    # One stage holds 9 of 12 layers, the others are busy about a ninth of the time: one core each for
    # it and the rest, so it computes as fast as alone and the job takes as long as alone. The factor
    # scaled by how busy the others are on average (1 + 1 x 1/9) had it ~11% slower (bench/bench_topology.py).
    ((0, 1, 2, 11, 12), 1.0),
])
@pytest.mark.parametrize("threads, factor", [(1, 2.0), (2, 1.5)], ids=["one thread", "threads that do not scale"])
def test_a_corun_factor_that_cores_explain_fades_when_the_others_idle(cuts, want_ratio, threads, factor) -> None:
    """Four one-thread stages on two cores measured 2x together: cores explain all of it. Four two-thread
    stages on four cores measured 1.5x (their second threads gave them less than twice the speed): all
    busy, the job takes the measured 1.5x as long, not the 2x that threads over cores would say."""
    from dataclasses import replace

    spans = [LayerRange(a, b) for a, b in zip(cuts, cuts[1:])]
    shared = [replace(stage(name, "h", 2 * threads), corun_factor=factor, threads=threads) for name in "abcd"]
    want_ratio = 1 + (want_ratio - 1) * (factor - 1)
    alone = estimate_split([stage(name) for name in "abcd"], spans, MEMORY, SHAPES)
    assert estimate_split(shared, spans, MEMORY, SHAPES).job_s / alone.job_s == pytest.approx(want_ratio, rel=0.01)
