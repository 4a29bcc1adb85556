"""The planner's search when links differ by pair: a stage's send costs what the link to the stage
after it costs, so the order, the spans and the stages taking part are chosen together. Pure
functions over index tables (planner.placement builds them from profiles and the link matrix).

Exact by dynamic programming over suffixes: best[mask][i][s] is the smallest slowest-stage time
placing layers [s, n) on exactly the stages in `mask`, with stage i first (holding [s, e) and
sending to whichever stage j holds [e, ...)). Stage i's time depends only on its span and on j, so
the recursion max(compute[i][s][e] + send[i][j], best[mask - i][j][e]) is exact over every order
and subset. Per (i, e), only successors on the Pareto front of (send[i][j], best[..][j][e]) can win:
on a cluster of a few hosts that is one or two, which keeps the inner loop short."""

from __future__ import annotations

import math
from typing import Callable, Sequence

INF = math.inf


def prefer_more_stages(candidates, value: Callable, size: Callable, tolerance: float):
    """The candidate with the most stages among those within `tolerance` of the fastest; a stage
    is left out only when that is clearly faster, since more stages also means more memory headroom."""
    fastest = min(value(c) for c in candidates)
    close = [c for c in candidates if value(c) <= fastest * (1 + tolerance) + 1e-15]
    return min(close, key=lambda c: (-size(c), value(c)))


def pair_dp(compute: Sequence[Sequence[Sequence[float]]], send: Sequence[Sequence[float]], allow_drop: bool,
            keep_order: bool, drop_tolerance: float) -> list[tuple[int, int, int]]:
    """The chain as (stage index, start, end) triples, [] when nothing fits.

    compute[i][s][e]: stage i's seconds per step holding [s, e) without sending (INF: does not fit);
    send[i][j]: its seconds per step sending to stage j (the last stage sends nothing). With
    `keep_order`, a stage only sends to a stage after it in index order."""
    p = len(compute)
    n = len(compute[0]) - 1 if p else 0
    best: list[list[list[float] | None]] = [[None] * p for _ in range(1 << p)]
    parent: list[list[list[tuple[int, int] | None] | None]] = [[None] * p for _ in range(1 << p)]
    for mask in range(1, 1 << p):
        for i in range(p):
            if not mask >> i & 1:
                continue
            rest = mask ^ (1 << i)
            row, back = [INF] * (n + 1), [None] * (n + 1)
            table = compute[i]
            if rest == 0:
                for s in range(n):
                    row[s], back[s] = table[s][n], (n, -1)
            else:
                after = [j for j in range(p) if rest >> j & 1 and (not keep_order or j > i)]
                if keep_order and len(after) != bin(rest).count("1"):
                    after = []  # a stage before i in `rest` could never come after it
                for e in range(1, n):
                    front = _front([(send[i][j], best[rest][j][e], j) for j in after if best[rest][j][e] < INF])
                    for s in range(e):
                        c = table[s][e]
                        if c == INF:
                            continue
                        for d, later, j in front:
                            value = c + d
                            if later > value:
                                value = later
                            if value < row[s]:
                                row[s], back[s] = value, (e, j)
            best[mask][i], parent[mask][i] = row, back
    full = (1 << p) - 1
    candidates = [(mask, i) for mask in range(1, 1 << p) for i in range(p)
                  if best[mask][i] is not None and best[mask][i][0] < INF and (allow_drop or mask == full)]
    if not candidates:
        return []
    mask, i = prefer_more_stages(candidates, lambda c: best[c[0]][c[1]][0], lambda c: bin(c[0]).count("1"),
                                 drop_tolerance)
    chain, start = [], 0
    while True:
        end, j = parent[mask][i][start]
        chain.append((i, start, end))
        if j < 0:
            return chain
        mask, i, start = mask ^ (1 << i), j, end


def _front(options: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """The (send, later, j) options no other beats on both send and later."""
    kept: list[tuple[float, float, int]] = []
    for option in sorted(options):
        if not kept or option[1] < kept[-1][1]:
            kept.append(option)
    return kept


def host_grouped_orders(hosts: Sequence[str], send: Sequence[Sequence[float]]) -> list[list[int]]:
    """Candidate orders for too many stages to search exactly: the stages of one host together (in
    the given order), and the hosts chained greedily from each host in turn, each next host the one
    reached by the cheapest link from the current one (a link's cost: its slowest stage pair)."""
    groups: dict[str, list[int]] = {}
    for i, host in enumerate(hosts):
        groups.setdefault(host, []).append(i)
    names = list(groups)

    def cost(a: str, b: str) -> float:
        return max(send[i][j] for i in groups[a] for j in groups[b])

    orders = []
    for first in names:
        chain, left = [first], [h for h in names if h != first]
        while left:
            nearest = min(left, key=lambda h: cost(chain[-1], h))
            chain.append(nearest)
            left.remove(nearest)
        order = [i for host in chain for i in groups[host]]
        if order not in orders:
            orders.append(order)
    given = list(range(len(hosts)))
    return orders + ([given] if given not in orders else [])
