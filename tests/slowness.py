"""Wall-clock limits that hold on a loaded machine.

A few tests check that something is quick (a refusal before work, a planner that does not blow
up): their limits were set on the project's quiet 2-core VM. `limit_s` scales such a limit by how
much slower a fixed piece of Python work runs right now than it ran there, so two CPU-bound
processes beside the suite (half the cores each) double the limits rather than fail the tests,
while a change that makes the checked thing 10x slower still fails. `HETPLAN_TIME_SCALE=F` sets
the factor by hand.
"""

import os
import statistics
import time

QUIET_WORK_S = 0.033  # `_work` on the quiet VM (2026-11-26: 0.032-0.033 s; 0.06-0.07 s beside two others)


def _work() -> float:
    start = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i * i
    return time.perf_counter() - start


def slowdown() -> float:
    """How many times slower than the quiet VM this machine runs Python now (at least 1)."""
    given = os.environ.get("HETPLAN_TIME_SCALE")
    if given:
        return max(1.0, float(given))
    return max(1.0, statistics.median(_work() for _ in range(3)) / QUIET_WORK_S)


def limit_s(nominal_s: float) -> float:
    return nominal_s * slowdown()
