"""`local-search`: simulated annealing over plans, every candidate scored by the event simulator.

In the spirit of FlexFlow's execution-simulator-guided search (Jia et al., "Beyond Data and Model
Parallelism for Deep Neural Networks", SysML 2019, a Metropolis-Hastings walk over strategies):
start from a plan (by default the `dp` planner's), propose a random small change, simulate it,
and accept it when it is better, or when it is worse with probability
exp(-(worse by a fraction) / temperature); the temperature falls linearly to zero over the time
budget, and the best plan seen is returned, so the result is never worse than the start.

Moves (each keeps the plan valid; `hetplan.plan.plan_problems` checks it):
- shift a boundary: move a node that no other node of its stage depends on to the next stage,
  or one that depends on no node of its stage to the previous stage;
- change a device: give a stage an unused device in place of one of its own, or swap devices
  between two stages;
- add a replica (an unused device joins a stage) or remove one;
- split a stage in two along its topological order (the second part takes an unused device or
  half of the stage's replicas), or merge two neighbouring stages;
- double or halve the number of micro-batches.

Infeasible plans are walked through with a finite penalty (`objectives.search_value`) but never
returned. Deterministic for a given seed and number of iterations; with a time budget the number
of iterations depends on the machine, so `max_iters` is there for reproducible runs (given both,
the search stops at whichever comes first: `hetplan.planners.kit.Budget`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from hetplan.cluster import Cluster
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage, plan_problems
from hetplan.planners.baselines import balanced_time
from hetplan.planners.dp import warm_start
from hetplan.planners.kit import SEARCH_BUDGET_S, Budget, microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer

START_TEMPERATURE = 0.05  # accept a 5% worse plan with probability 1/e at the start


def _with_stages(plan: Plan, stages: list[Stage]) -> Plan:
    return replace(plan, stages=tuple(stages), predicted=None)


@dataclass(frozen=True)
class _Walk:
    """What a move sees: the plan, a copy of its stages that the move may change, the cluster's
    devices the plan leaves unused, and the walk's random numbers."""

    plan: Plan
    stages: list[Stage]
    unused: list[str]
    graph: Graph
    rng: np.random.Generator
    choices: tuple[int, ...]

    def draw(self, high: int, low: int = 0) -> int:
        return int(self.rng.integers(low, high))


# Each move returns the changed stages (`neighbour` checks them), a plan (a change of micro-batches
# only), or None when it does not apply; each draws its random numbers in the same order as ever,
# so that a seed gives the same walk.
def _shift_boundary(w: _Walk) -> list[Stage] | None:
    """Move a node to the next stage (one no other node of its stage depends on) or to the
    previous one (one that depends on no node of its stage)."""
    if len(w.stages) < 2:
        return None
    k = w.draw(len(w.stages) - 1)
    forward = w.rng.random() < 0.5
    src, dst = (k, k + 1) if forward else (k + 1, k)
    linked = w.graph.successors if forward else w.graph.predecessors
    nodes = w.stages[src].nodes
    inside = set(nodes)
    movable = [v for v in nodes if not any(x in inside for x in linked(v))]
    if len(nodes) < 2 or not movable:
        return None
    v = movable[w.draw(len(movable))]
    w.stages[src] = Stage(tuple(x for x in nodes if x != v), w.stages[src].devices)
    there = w.stages[dst]
    w.stages[dst] = Stage((v, *there.nodes) if forward else (*there.nodes, v), there.devices)
    return w.stages


def _change_device(w: _Walk) -> list[Stage] | None:
    """Give a stage an unused device in place of one of its own, or swap devices between two
    stages."""
    stages, n = w.stages, len(w.stages)
    k = w.draw(n)
    devs = list(stages[k].devices)
    r = w.draw(len(devs))
    if w.unused and (n == 1 or w.rng.random() < 0.5):
        devs[r] = w.unused[w.draw(len(w.unused))]
        stages[k] = Stage(stages[k].nodes, tuple(devs))
        return stages
    if n == 1:
        return None
    o = w.draw(n - 1)
    o += o >= k
    other = list(stages[o].devices)
    q = w.draw(len(other))
    devs[r], other[q] = other[q], devs[r]
    stages[k], stages[o] = Stage(stages[k].nodes, tuple(devs)), Stage(stages[o].nodes, tuple(other))
    return stages


def _add_replica(w: _Walk) -> list[Stage] | None:
    if not w.unused:
        return None
    k = w.draw(len(w.stages))
    w.stages[k] = Stage(w.stages[k].nodes, (*w.stages[k].devices, w.unused[w.draw(len(w.unused))]))
    return w.stages


def _remove_replica(w: _Walk) -> list[Stage] | None:
    multi = [k for k, st in enumerate(w.stages) if len(st.devices) > 1]
    if not multi:
        return None
    k = multi[w.draw(len(multi))]
    devs = list(w.stages[k].devices)
    devs.pop(w.draw(len(devs)))
    w.stages[k] = Stage(w.stages[k].nodes, tuple(devs))
    return w.stages


def _split_stage(w: _Walk) -> list[Stage] | None:
    """Split a stage in two along its topological order: the second part takes half of its
    replicas, or an unused device."""
    k = w.draw(len(w.stages))
    if len(w.stages[k].nodes) < 2:
        return None
    devs = list(w.stages[k].devices)
    if len(devs) > 1:
        half = len(devs) // 2
        first, second = tuple(devs[:half]), tuple(devs[half:])
    elif w.unused:
        first, second = tuple(devs), (w.unused[w.draw(len(w.unused))],)
    else:
        return None
    where = {v: i for i, v in enumerate(w.graph.topo_order)}
    nodes = sorted(w.stages[k].nodes, key=where.__getitem__)
    cut = w.draw(len(nodes), low=1)
    w.stages[k:k + 1] = [Stage(tuple(nodes[:cut]), first), Stage(tuple(nodes[cut:]), second)]
    return w.stages


def _merge_stages(w: _Walk) -> list[Stage] | None:
    if len(w.stages) < 2:
        return None
    k = w.draw(len(w.stages) - 1)
    a, b = w.stages[k], w.stages[k + 1]
    w.stages[k:k + 2] = [Stage(a.nodes + b.nodes, a.devices + b.devices)]
    return w.stages


def _change_microbatches(w: _Walk) -> Plan | None:
    """Double or halve the number of micro-batches (the next choice up or down)."""
    choices, plan = w.choices, w.plan
    if len(choices) < 2:
        return None
    i = choices.index(plan.microbatches) if plan.microbatches in choices else 0
    j = min(len(choices) - 1, max(0, i + (1 if w.rng.random() < 0.5 else -1)))
    if j == i:
        return None
    return replace(plan, microbatches=choices[j], predicted=None)


MOVES: tuple[Callable[[_Walk], list[Stage] | Plan | None], ...] = (
    _shift_boundary, _change_device, _add_replica, _remove_replica, _split_stage, _merge_stages,
    _change_microbatches)


def neighbour(plan: Plan, graph: Graph, cluster: Cluster, rng: np.random.Generator,
              choices: tuple[int, ...]) -> Plan | None:
    """A random valid plan one move away, or None when the move drawn does not apply."""
    used = set(plan.devices)
    unused = [d for d in cluster.ids if d not in used]
    move = MOVES[int(rng.integers(0, len(MOVES)))]
    out = move(_Walk(plan, list(plan.stages), unused, graph, rng, choices))
    if out is None or isinstance(out, Plan):
        return out
    out = _with_stages(plan, out)
    return None if plan_problems(out, graph, cluster) else out


def local_search(graph: Graph, cluster: Cluster, options: PlanOptions, start: Plan | None = None,
                 max_iters: int | None = None, progress: Callable[[float], None] | None = None) -> Plan:
    scorer = Scorer(graph, cluster, options)
    if start is None:
        start = warm_start(graph, cluster, options)
        if start is None:
            start = balanced_time(graph, cluster, options)
    choices = tuple(sorted(set(microbatch_choices(graph, replace(options, microbatches=None)))
                           | {start.microbatches}))
    if options.microbatches:
        choices = (options.microbatches,)
    rng = np.random.default_rng(options.seed)
    current = replace(start, planner="local-search", predicted=None)
    cur_v = scorer.search_value(current)
    best, best_v = (current, scorer.value(current)) if math.isfinite(scorer.value(current)) else (None, math.inf)
    start_v = best_v
    budget = Budget.of(options, SEARCH_BUDGET_S, max_iters)
    iters = accepted = 0
    while budget.fraction(iters) is not None:
        iters += 1
        if progress is not None and iters % 20 == 0:
            progress(min(1.0, budget.used(iters)))
        cand = neighbour(current, graph, cluster, rng, choices)
        if cand is None:
            continue
        v = scorer.search_value(cand)
        temperature = START_TEMPERATURE * max(0.0, 1.0 - budget.used(iters))
        worse = (v - cur_v) / max(cur_v, 1e-30)
        if worse <= 0 or (temperature > 0 and rng.random() < math.exp(-worse / temperature)):
            current, cur_v = cand, v
            accepted += 1
            real = scorer.value(cand)
            if real < best_v:
                best, best_v = cand, real
    if best is None:
        raise scorer.infeasible([current], "local-search")
    gain = (start_v - best_v) / start_v if math.isfinite(start_v) and start_v > 0 else None
    return replace(best, planner="local-search", meta={
        "local_search": {"start": start.planner, "iterations": iters, "accepted": accepted,
                         "simulations": scorer.simulations, "gain_over_start": gain}})
