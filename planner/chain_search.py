"""Searching for the chain and split: which stages, in which order, which layers each.

Exact dynamic programs over (stages used, layers placed) balance each stage's mean time per step on
the cost model (planner.cost_model): over every order and subset of the stages where they are few
(`_subset_dp`), else in a given order (`_ordered_dp`) with every (first, last) pair tried; with a link
matrix, each stage's send priced by the link to its successor (planner.link_search). `by_job_time`
then prices candidates window by window, where phases and shared cores make the job's time more
than the slowest stage's total. How much exact work a plan may spend is the caller's to say.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from layerbus.planner.cost_model import CostModel
from layerbus.planner.link_search import host_grouped_orders, pair_dp, prefer_more_stages
from layerbus.planner.plan_values import PlanOptions, StageProfile
from layerbus.wire.spans import LayerRange

Candidate = tuple[list[StageProfile], list[LayerRange]]  # the stages in order, and each one's layers
Searched = tuple[list[StageProfile], list[LayerRange], str]  # a candidate, and how it was searched ("exact", ...)


def search_chain(costs: CostModel, options: PlanOptions, exact_limit: int) -> Searched:
    """The chain and split with the smallest slowest-stage time per step, each stage sending at its own
    link's bandwidth, and how it was searched: exact over every order and subset while the subset DP
    takes at most `exact_limit` inner steps, else the heuristic `_end_pairs`."""
    p = len(costs.stages)
    n = costs.num_layers
    step = _price_table(costs, costs.step_s)
    if not options.allow_reorder:
        return (*_ordered_dp(costs, step, list(range(p)), options), "exact")
    if (1 << p) * p * n * n // 2 <= exact_limit:
        return (*_subset_dp(costs, step, options), "exact")
    return _end_pairs(costs, step, options)


def _price_table(costs: CostModel, price) -> list[list[list[float]]]:
    """table[s][start][end]: `price(stage, start, end)` where stage s can hold [start, end), else inf.
    Every DP here reads only such a table."""
    n, inf = costs.num_layers, math.inf
    table = [[[inf] * (n + 1) for _ in range(n + 1)] for _ in range(len(costs.stages))]
    for i, s in enumerate(costs.stages):
        for start in range(n):
            for end in range(start + 1, n + 1):
                if costs.fits(s, start, end):
                    table[i][start][end] = price(s, start, end)
    return table


def _end_pairs(costs: CostModel, step, options: PlanOptions) -> Searched:
    """Too many stages for every order: which stage embeds and which runs the head are what order
    changes most, so every (first, last) pair is tried with the others in the given order."""
    p = len(costs.stages)
    best: tuple[float, int, list, list] | None = None
    for first in range(p):
        for last in range(p):
            if first == last and p > 1:
                continue
            middle = [i for i in range(p) if i not in (first, last)]
            order = [first] + middle + ([last] if last != first else [])
            chain, spans = _ordered_dp(costs, step, order, options, pinned_ends=True)
            if chain:
                value = max(costs.step_s(s, sp.start, sp.end) for s, sp in zip(chain, spans))
                key = (value, -len(chain))
                if best is None or key < best[:2]:
                    best = (value, -len(chain), chain, spans)
    search = (f"heuristic: {p} stages are too many to try every order; every (first, last) pair was tried "
              "with the others in the given order")
    return (best[2], best[3], search) if best else ([], [], search)


def search_over_links(costs: CostModel, options: PlanOptions, exact_limit: int) -> Searched:
    """The search with a link matrix: each stage's send priced by the link to its successor
    (planner.link_search); exact while the pair DP's subsets x first stages x spans are at most
    `exact_limit`, else stages grouped by host (`_host_grouped`)."""
    stages, n = costs.stages, costs.num_layers
    p = len(stages)
    compute = _price_table(costs, costs.compute_s)
    send = [[costs.mean_send_s(a, 0, b.name) if n > 0 else 0.0 for b in stages] for a in stages]
    if (1 << p) * p * n * n // 2 <= exact_limit:
        triples = pair_dp(compute, send, options.allow_drop, not options.allow_reorder, options.drop_tolerance)
        return [stages[i] for i, _, _ in triples], [LayerRange(a, b) for _, a, b in triples], "exact"
    return _host_grouped(costs, compute, send, options)


def _host_grouped(costs: CostModel, compute, send, options: PlanOptions) -> Searched:
    """Too many stages for the pair DP: the stages of a host kept together, hosts chained by their
    fastest links (planner.link_search), the layers split exactly in each such order."""
    stages, n = costs.stages, costs.num_layers
    p = len(stages)
    orders = ([list(range(p))] if not options.allow_reorder
              else host_grouped_orders([costs.host_of(s) for s in stages], send))
    candidates = []
    for order in orders:
        # Every stage used, each sending to the next in this order: its sends are exact. With
        # dropping allowed, also each send priced at the slowest link to any later stage, so that
        # leaving one out never looks cheaper than it is. Both are priced exactly afterwards.
        runs = [(options if not options.allow_drop else replace(options, allow_drop=False), False)]
        if options.allow_drop:
            runs.append((options, True))
        for run_options, pessimistic in runs:
            step = _with_sends(compute, send, order, pessimistic, n)
            chain, spans = _ordered_dp(costs, step, order, run_options)
            if chain:
                candidates.append((costs.estimate(chain, spans).step_s, chain, spans))
    search = (f"heuristic: {p} stages over {n} layers are too many to try every order on the link matrix; "
              "the stages of a host kept together, hosts chained by their fastest links, layers split exactly")
    if not candidates:
        return [], [], search
    _, chain, spans = prefer_more_stages(candidates, lambda c: c[0], lambda c: len(c[1]), options.drop_tolerance)
    return chain, spans, search


def _with_sends(compute, send, order: list[int], pessimistic: bool, n: int) -> list[list[list[float]]]:
    """The compute table with each stage's send in `order` added (but the last layer's): to the stage
    after it, or with `pessimistic` to the slowest to reach of every stage after it."""
    inf = math.inf
    step = [[[inf] * (n + 1) for _ in range(n + 1)] for _ in range(len(compute))]
    for k, i in enumerate(order):
        later = order[k + 1:] if pessimistic else order[k + 1:k + 2]
        following = max((send[i][j] for j in later), default=0.0)
        for start in range(n):
            for end in range(start + 1, n + 1):
                if compute[i][start][end] < inf:
                    step[i][start][end] = compute[i][start][end] + (following if end < n else 0.0)
    return step


def by_job_time(costs: CostModel, options: PlanOptions, chain: list[StageProfile], spans: list[LayerRange],
                enumeration_limit: int) -> Candidate:
    """The DP balances each stage's total over the job; phases (prefill, decode, the drain) and
    stages sharing a host's cores make the job's time more than the slowest total. Price candidates
    window by window: every chain and split when they are at most `enumeration_limit`, else the DP's
    answer with its cuts moved one layer at a time while that helps."""
    n, stages = costs.num_layers, costs.stages
    sizes = range(1, len(stages) + 1) if options.allow_drop else [len(stages)]
    count = sum(math.perm(len(stages), k) * math.comb(n - 1, k - 1) for k in sizes if k <= n)
    if count > enumeration_limit:
        return chain, _moved_cuts(costs, chain, spans)
    fitting = _fitting_chains(costs, options, sizes)
    if not fitting:
        return chain, spans
    return _fastest(costs, options, fitting)


def _fitting_chains(costs: CostModel, options: PlanOptions, sizes) -> list[Candidate]:
    """Every chain of `sizes` stages (ordered where reordering is allowed) and split that fits."""
    n, stages = costs.num_layers, costs.stages
    fitting = []
    for k in sizes:
        if k > n:
            continue
        orders = itertools.permutations(stages, k) if options.allow_reorder else itertools.combinations(stages, k)
        for order in orders:
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = (0, *cuts, n)
                split = [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]
                if all(costs.fits(s, sp.start, sp.end) for s, sp in zip(order, split)):
                    fitting.append((list(order), split))
    return fitting


def _fastest(costs: CostModel, options: PlanOptions, fitting: list[Candidate]) -> Candidate:
    """The candidate that finishes the job soonest, preferring more stages within the tolerance.
    Priced from the lowest floor (`CostModel.job_floor_s`) up, until the floors pass what could still
    be chosen: the fastest so far, within that tolerance. A candidate left unpriced is slower than
    that, so the choice is the one pricing all of them gives, at a fraction of the time (the README
    command's plan has 2,613 candidates, priced twice)."""
    floors = [costs.job_floor_s(order, split) for order, split in fitting]
    priced: dict[int, float] = {}
    fastest = math.inf
    for i in sorted(range(len(fitting)), key=floors.__getitem__):
        if floors[i] > fastest * (1 + options.drop_tolerance) + 1e-15:
            break  # every later floor is higher still
        priced[i] = costs.job_s(*fitting[i])[0]
        fastest = min(fastest, priced[i])
    candidates = [(priced[i], order, split) for i, (order, split) in enumerate(fitting) if i in priced]
    best = prefer_more_stages(candidates, lambda c: c[0], lambda c: len(c[1]), options.drop_tolerance)
    return best[1], best[2]


def _moved_cuts(costs: CostModel, chain: list[StageProfile], spans: list[LayerRange]) -> list[LayerRange]:
    """`spans` with each cut between two stages moved one layer at a time while the job gets faster."""
    best_time = costs.job_s(chain, spans)[0]
    improved = True
    while improved:
        improved = False
        for i in range(len(spans) - 1):
            for delta in (-1, 1):
                cut = spans[i].end + delta
                if not spans[i].start < cut < spans[i + 1].end:
                    continue
                trial = list(spans)
                trial[i], trial[i + 1] = LayerRange(spans[i].start, cut), LayerRange(cut, spans[i + 1].end)
                if not (costs.fits(chain[i], trial[i].start, trial[i].end)
                        and costs.fits(chain[i + 1], trial[i + 1].start, trial[i + 1].end)):
                    continue
                time = costs.job_s(chain, trial)[0]
                if time < best_time * (1 - 1e-9):
                    spans, best_time, improved = trial, time, True
    return spans


def _subset_dp(costs: CostModel, step, options: PlanOptions):
    """best[mask][e]: the smallest possible slowest-stage time placing layers [0, e) on exactly the
    stages in `mask`, in some order. Exact over every order and every subset of the stages."""
    stages, n = costs.stages, costs.num_layers
    p = len(stages)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(1 << p)]
    parent: list[list[tuple[int, int] | None]] = [[None] * (n + 1) for _ in range(1 << p)]
    best[0][0] = 0.0
    for mask in range(1, 1 << p):
        row, back = best[mask], parent[mask]
        for i in range(p):
            if not mask >> i & 1:
                continue
            prev = best[mask ^ (1 << i)]
            table = step[i]
            for start in range(n):
                before = prev[start]
                if before == inf:
                    continue
                costs_from = table[start]
                for end in range(start + 1, n + 1):
                    value = costs_from[end]
                    if value == inf:
                        continue
                    if before > value:
                        value = before
                    if value < row[end]:
                        row[end], back[end] = value, (i, start)
    masks = [m for m in range(1, 1 << p) if best[m][n] < inf]
    if not options.allow_drop:
        masks = [m for m in masks if m == (1 << p) - 1]
    if not masks:
        return [], []
    chosen = prefer_more_stages(masks, lambda m: best[m][n], lambda m: bin(m).count("1"), options.drop_tolerance)
    chain, spans, mask, end = [], [], chosen, n
    while end > 0:
        i, start = parent[mask][end]
        chain.append(stages[i])
        spans.append(LayerRange(start, end))
        mask, end = mask ^ (1 << i), start
    return chain[::-1], spans[::-1]


def _ordered_dp(costs: CostModel, step, order: list[int], options: PlanOptions, pinned_ends: bool = False):
    """Stages in a fixed order, each either used (>= 1 layer) or, with allow_drop, skipped.
    best[k][used][e]: smallest slowest-stage time with layers [0, e) on `used` of the first k stages."""
    stages, n = costs.stages, costs.num_layers
    p = len(order)
    inf = math.inf
    best = [[[inf] * (n + 1) for _ in range(p + 1)] for _ in range(p + 1)]
    parent = [[[None] * (n + 1) for _ in range(p + 1)] for _ in range(p + 1)]
    best[0][0][0] = 0.0
    for k in range(1, p + 1):
        i = order[k - 1]
        must_use = not options.allow_drop or (pinned_ends and (k == 1 or k == p))
        for used in range(0, k + 1):
            for end in range(n + 1):
                if not must_use and best[k - 1][used][end] < best[k][used][end]:
                    best[k][used][end], parent[k][used][end] = best[k - 1][used][end], ("skip", end)
                if used == 0 or end == 0:
                    continue
                for start in range(end):
                    before = best[k - 1][used - 1][start]
                    value = max(before, step[i][start][end])
                    if value < best[k][used][end]:
                        best[k][used][end], parent[k][used][end] = value, ("use", start)
    candidates = [used for used in range(1, p + 1) if best[p][used][n] < inf]
    if not candidates:
        return [], []
    used = prefer_more_stages(candidates, lambda u: best[p][u][n], lambda u: u, options.drop_tolerance)
    chain, spans, end = [], [], n
    for k in range(p, 0, -1):
        action, start = parent[k][used][end]
        if action == "use":
            chain.append(stages[order[k - 1]])
            spans.append(LayerRange(start, end))
            used, end = used - 1, start
    return chain[::-1], spans[::-1]

