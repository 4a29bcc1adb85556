"""How torch's CPU threads wait between operations: passively, unless the user says otherwise.

torch's CPU kernels run on an OpenMP (libgomp) thread pool whose threads, by default, spin for a while
after each parallel region before they sleep. A decode step is thousands of small regions, so a stage's
threads spin most of the time they are not computing. Alone on its cores that costs nothing; beside
another busy process (a second stage, the broker, another job, a test worker) the spinning threads take
the cores the others need. Measured on this 2-core machine, two `layerbus run --stages 1
--threads-per-stage 2` on the sample corpus at once: 173-187 s with the default waits, 58-62 s with
OMP_WAIT_POLICY=PASSIVE (3.0x); one such run alone, 40-42 s against 40-44 s (no difference beyond the
noise). libgomp reads the variable once, when torch loads it, so it must be set before torch is imported:
the CLI sets it as it starts, so every process it starts (the stage launcher, stages, chain brokers)
inherits it, and the broker's local stages get it however the broker was started (a benchmark, lm-eval's
`LayerbusLM`). A dedicated many-core stage machine may gain from spinning: `OMP_WAIT_POLICY=ACTIVE` there
(or libgomp's own `GOMP_SPINCOUNT`, which takes precedence over the policy).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

WAIT_POLICY = "OMP_WAIT_POLICY"


def prefer_passive_waits(environ: MutableMapping[str, str] = os.environ) -> None:
    """Make OpenMP threads sleep when idle unless `environ` already chooses a wait policy."""
    environ.setdefault(WAIT_POLICY, "PASSIVE")


def with_passive_waits(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of `environ` for a process that computes with torch, given the passive policy by default."""
    copy = dict(environ)
    prefer_passive_waits(copy)
    return copy


def wait_policy(environ: Mapping[str, str] = os.environ) -> str:
    """The policy this process's threads run with, for cache keys: a step timed while threads spin is not
    one timed while they sleep (a profile cached before the passive default must be measured again)."""
    return environ.get(WAIT_POLICY, "default").upper()
