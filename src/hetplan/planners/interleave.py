"""Plans for interleaved schedules, made from a plan of one stage per group of devices.

Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC 2021) runs v stages on each of n ranks (stage s on rank s mod n;
the schedule says, `hetplan.schedule.stage_ranks`). From a plan whose n stages each run on their
own devices, `interleavings` keeps the devices and cuts the model again into n v stages, stage s
on the devices of the plan's stage that is the schedule's rank of s: pieces
of a topological order (so each stage is convex and no edge goes backwards), chosen by a linear
partition (Bokhari, "Partitioning problems in parallel, pipelined, and distributed computing",
1988) that makes the slowest resource as fast as it can be: a stage's compute on its devices,
or a cut's bytes on the link from its stage's devices to the next's (PipeDream's bottleneck of
compute and communication). Memory, latencies and the schedule's order are left to the
simulator, which scores every candidate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from hetplan.cost import CostModel
from hetplan.cost.stage_table import StageTable, prefix_states
from hetplan.plan import Plan, Stage
from hetplan.schedule import get_schedule, stage_ranks

MAX_PER_RANK = 4  # stages per rank tried


def _node_order(cost: CostModel, plan: Plan) -> list[str]:
    """The graph's topological order, the plan's stages kept in turn (its edges go forward)."""
    where = plan.stage_of()
    return sorted(cost.graph.topo_order, key=where.__getitem__)  # sorted() is stable


def linear_cuts(times: np.ndarray, row_of: Sequence[int], cut_s: np.ndarray | None = None) -> list[int] | None:
    """Cut points 0 = b_0 < b_1 < ... < b_parts = N of the N positions that make least the
    largest of: the sums `times[row_of[c], b_c:b_c+1]` (part c on row `row_of[c]` of the (rows, N)
    array), and `cut_s[c, b_c+1]`, the cost of cutting after part c before position b_c+1
    ((parts - 1, N + 1), or None for nothing). None if there are fewer positions than parts."""
    parts, n = len(row_of), times.shape[1]
    if n < parts:
        return None
    prefix = np.concatenate([np.zeros((times.shape[0], 1)), np.cumsum(times, axis=1)], axis=1)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((parts, n + 1), dtype=int)
    for c in range(parts):
        p = prefix[row_of[c]]
        span = p[None, :] - p[:, None]  # span[j, i]: positions j..i-1
        worst = np.maximum(best[:, None], span)
        if cut_s is not None and c < parts - 1:
            worst = np.maximum(worst, cut_s[c][None, :])
        worst[np.tril_indices(n + 1)] = np.inf  # a part holds at least one position
        choice[c] = np.argmin(worst, axis=0)
        best = worst[choice[c], np.arange(n + 1)]
    cuts = [n]
    for c in range(parts - 1, 0, -1):
        cuts.append(int(choice[c][cuts[-1]]))
    return [0, *reversed(cuts)]


def interleaved(cost: CostModel, plan: Plan, schedule: str, per_rank: int, microbatches: int) -> Plan | None:
    """The plan's groups of devices running `per_rank` stages each under `schedule`; None where
    the model has too few nodes or the plan too few groups."""
    groups = [s.devices for s in plan.stages]
    n = len(groups)
    if n < 2 or len({d for g in groups for d in g}) != sum(len(g) for g in groups):
        return None
    order = _node_order(cost, plan)
    table = StageTable(cost, prefix_states(len(order)), order)  # stages: runs of this order
    at = np.arange(len(order))
    times = np.array([table.together_s(g, at, at + 1) for g in groups])
    row_of = stage_ranks(schedule, n * per_rank, n)
    cut_s = np.array([table.cut * table.cut_per_byte_s(groups[row_of[c]], groups[row_of[c + 1]])
                      for c in range(len(row_of) - 1)]).reshape(len(row_of) - 1, len(order) + 1)
    cuts = linear_cuts(times, row_of, cut_s)
    if cuts is None:
        return None
    bounds = zip(cuts, cuts[1:], strict=False)
    stages = tuple(Stage(tuple(order[a:b]), groups[row_of[c]]) for c, (a, b) in enumerate(bounds))
    return replace(plan, stages=stages, schedule=schedule, microbatches=microbatches, predicted=None)


def runnable_microbatches(schedule: str, ranks: int, per_rank: int, near: int, batch_size: int) -> int | None:
    """The number of micro-batches nearest to `near` (ties: the larger) that the schedule runs on
    these ranks, at most the batch's samples; None if none does."""
    sched = get_schedule(schedule)
    ok = [m for m in range(1, batch_size + 1) if not sched.problem(ranks * per_rank, ranks, m)]
    return min(ok, key=lambda m: (abs(m - near), -m), default=None)


def interleavings(cost: CostModel, plan: Plan, schedule: str) -> list[Plan]:
    """The interleaved plans of `plan` with 2 to MAX_PER_RANK stages per rank."""
    out = []
    for v in range(2, MAX_PER_RANK + 1):
        m = runnable_microbatches(schedule, len(plan.stages), v, plan.microbatches, cost.graph.batch_size)
        candidate = interleaved(cost, plan, schedule, v, m) if m else None
        if candidate is not None:
            out.append(candidate)
    return out
