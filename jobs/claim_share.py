"""How much of a job one broker claims when other brokers work it too: a pure decision.

A broker claims what its free slots and its waiting line can take (broker/run_state.py top_up). Alone
on a job that is right; beside other brokers (the chains of `layerbus run --chains K`, or several
`layerbus broker` processes) the first to claim took the whole of a small job: measured with two
chains of one stage on 60 items, chain 1 claimed all 60 and chain 2 did nothing. Claimed items are not
taken back from a live broker, so each holds at most an even share of what is not done yet.
"""

from __future__ import annotations

import math


def fair_claim(wanted: int, queued: int, in_flight: int, held: int, workers: int, ahead: int = 0) -> int:
    """How many of `wanted` items to claim when `workers` brokers (this one included) work a job with
    `queued` items left and `in_flight` claimed by all of them, `held` of those by this one: all of them
    alone; else as many as keep this broker within an even share of the items not yet done (queued and
    in flight, rounded up), and at least one when it holds none (an item kept for a broker that is not
    there would wait for nobody). Capping the claim alone was not enough: two chains of one stage on 60
    items, chain 1 claimed 30, then 15, 8, ... one step after another, and had claimed 59 before
    chain 2, placed a moment later, claimed its first.

    `ahead` of the `wanted` are for this broker's waiting line, to start when its slots free up. Once the
    queue no longer holds what every broker wants (`workers` x `wanted`), those are left to brokers that
    can start them now. Measured without that (bench_chains, two chains of 24 slots on 96 items of
    equal length): the chain whose wave ended a second earlier claimed 20 of the last 24 items, 10 for
    its line; they ran as a third wave of 8 items, 24 s on one chain while the other was idle (26% of
    the job's time)."""
    if workers <= 1 or wanted <= 0:
        return wanted
    if ahead > 0 and queued < workers * wanted:
        wanted = max(0, wanted - ahead)
    share = math.ceil((queued + in_flight) / workers)
    return max(1 if held == 0 else 0, min(wanted, share - held))
