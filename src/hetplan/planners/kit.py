"""What every planner shares, in one place: the micro-batch counts it may choose and its budget
of iterations or seconds. (The warm start, dp's plan, is `hetplan.planners.dp.warm_start`.)"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from hetplan.graph import Graph
from hetplan.planners.options import PlanOptions

SEARCH_BUDGET_S = 10.0  # local search
LEARN_BUDGET_S = 20.0  # the RL planners, warm
FAITHFUL_BUDGET_S = 60.0  # the RL planners as their papers set them up (cold)
WARM_NATS = 3.0  # the RL policies' bias towards the warm start's choices, in logits


def microbatch_choices(graph: Graph, options: PlanOptions) -> tuple[int, ...]:
    """The user's number of micro-batches, or 1, 2, 4, ... micro-batches and micro-batches of 1, 2,
    4, ... rows, up to the batch (so a batch of 1,024 may run as 1,024 micro-batches where memory
    needs it)."""
    if options.microbatches:
        return (options.microbatches,)
    batch = graph.batch_size
    counts = {1 << k for k in range(batch.bit_length())}  # 1, 2, 4, ... micro-batches
    sizes = {math.ceil(batch / (1 << k)) for k in range(batch.bit_length())}  # of 1, 2, 4, ... rows
    return tuple(sorted(counts | sizes))


def learn_budget_s(options: PlanOptions) -> float:
    """The RL planners' default time budget: longer for the cold, faithful set-up."""
    return FAITHFUL_BUDGET_S if options.faithful else LEARN_BUDGET_S


@dataclass
class Budget:
    """A search's budget: `max_iters` alone runs that many iterations whatever the time (runs
    that must be the same every time); otherwise the time budget, the planner's default when the
    user gave none."""

    max_iters: int | None
    seconds: float
    began: float = field(default_factory=time.perf_counter)

    @classmethod
    def of(cls, options: PlanOptions, default_s: float, max_iters: int | None = None) -> Budget:
        iters = max_iters if max_iters is not None else options.max_iters
        if iters is not None:
            return cls(iters, math.inf if options.budget_s is None else options.budget_s)
        return cls(None, options.budget_s or default_s)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.began

    def used(self, iters: int) -> float:
        """The share of the budget `iters` iterations have used: of the iterations when they are
        counted, else of the time (may pass 1)."""
        return iters / self.max_iters if self.max_iters is not None else self.elapsed_s / self.seconds

    def fraction(self, iters: int) -> float | None:
        """How much of the budget `iters` iterations have used, or None once it is spent."""
        elapsed = self.elapsed_s
        frac = iters / self.max_iters if self.max_iters is not None else elapsed / self.seconds
        return None if frac >= 1.0 or elapsed >= self.seconds else frac

