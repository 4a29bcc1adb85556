"""Where an evenly spread sample of a job's items sits: one place in each of `count` equal stretches of
the job's `total` items, in queue order (JobStore.sample_items reads the items there; a sampled
planner.workload.Workload takes the outputs there). Standard library only: the broker imports it.

Each place is the start of its stretch moved on by a golden-ratio share of it, a different share for
each stretch. One fixed place per stretch (its middle, say) aliases with a job that repeats itself at
the stretch's period: items of every tenth line asking for n = 2 samples, sampled every tenth item,
are all missed or all hit. The golden-ratio shares are spread evenly over [0, 1) for any run of
stretches and never repeat, and they are the same on every run: a job is always planned the same way.
"""

from __future__ import annotations

GOLDEN = 0.6180339887498949  # the fractional part of the golden ratio


def sample_places(count: int, total: int) -> list[int]:
    """Places (0 to total - 1, increasing) of min(count, total) items spread over `total`."""
    if count < 1:
        raise ValueError(f"a sample needs at least 1 item, got count={count}")
    if count >= total:
        return list(range(total))
    starts = [i * total // count for i in range(count + 1)]  # stretch i: [starts[i], starts[i + 1]), never empty
    return [start + int((i + 1) * GOLDEN % 1.0 * (end - start))
            for i, (start, end) in enumerate(zip(starts, starts[1:]))]
