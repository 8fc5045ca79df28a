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
of iterations depends on the machine, so `max_iters` is there for reproducible runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from hetplan.cluster import Cluster
from hetplan.errors import InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage, plan_problems
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer

DEFAULT_BUDGET_S = 10.0
START_TEMPERATURE = 0.05  # accept a 5% worse plan with probability 1/e at the start


def _with_stages(plan: Plan, stages: list[Stage]) -> Plan:
    return replace(plan, stages=tuple(stages), predicted=None)


def neighbour(plan: Plan, graph: Graph, cluster: Cluster, rng: np.random.Generator,
              choices: tuple[int, ...]) -> Plan | None:
    """A random valid plan one move away, or None when the move drawn does not apply."""
    stages = list(plan.stages)
    n = len(stages)
    used = set(plan.devices)
    unused = [d for d in cluster.ids if d not in used]
    move = int(rng.integers(0, 7))
    if move == 0 and n > 1:  # shift a boundary
        k = int(rng.integers(0, n - 1))
        if rng.random() < 0.5:
            inside = set(stages[k].nodes)
            movable = [v for v in stages[k].nodes if not any(w in inside for w in graph.successors(v))]
            if len(stages[k].nodes) < 2 or not movable:
                return None
            v = movable[int(rng.integers(0, len(movable)))]
            stages[k] = Stage(tuple(x for x in stages[k].nodes if x != v), stages[k].devices)
            stages[k + 1] = Stage((v, *stages[k + 1].nodes), stages[k + 1].devices)
        else:
            inside = set(stages[k + 1].nodes)
            movable = [v for v in stages[k + 1].nodes if not any(w in inside for w in graph.predecessors(v))]
            if len(stages[k + 1].nodes) < 2 or not movable:
                return None
            v = movable[int(rng.integers(0, len(movable)))]
            stages[k + 1] = Stage(tuple(x for x in stages[k + 1].nodes if x != v), stages[k + 1].devices)
            stages[k] = Stage((*stages[k].nodes, v), stages[k].devices)
    elif move == 1:  # change a device: an unused one, or a swap with another stage
        k = int(rng.integers(0, n))
        devs = list(stages[k].devices)
        r = int(rng.integers(0, len(devs)))
        if unused and (n == 1 or rng.random() < 0.5):
            devs[r] = unused[int(rng.integers(0, len(unused)))]
            stages[k] = Stage(stages[k].nodes, tuple(devs))
        elif n > 1:
            o = int(rng.integers(0, n - 1))
            o += o >= k
            other = list(stages[o].devices)
            q = int(rng.integers(0, len(other)))
            devs[r], other[q] = other[q], devs[r]
            stages[k], stages[o] = Stage(stages[k].nodes, tuple(devs)), Stage(stages[o].nodes, tuple(other))
        else:
            return None
    elif move == 2 and unused:  # add a replica
        k = int(rng.integers(0, n))
        stages[k] = Stage(stages[k].nodes, (*stages[k].devices, unused[int(rng.integers(0, len(unused)))]))
    elif move == 3:  # remove a replica
        multi = [k for k in range(n) if len(stages[k].devices) > 1]
        if not multi:
            return None
        k = multi[int(rng.integers(0, len(multi)))]
        devs = list(stages[k].devices)
        devs.pop(int(rng.integers(0, len(devs))))
        stages[k] = Stage(stages[k].nodes, tuple(devs))
    elif move == 4:  # split a stage along its topological order
        k = int(rng.integers(0, n))
        if len(stages[k].nodes) < 2:
            return None
        devs = list(stages[k].devices)
        if len(devs) > 1:
            half = len(devs) // 2
            first, second = tuple(devs[:half]), tuple(devs[half:])
        elif unused:
            first, second = tuple(devs), (unused[int(rng.integers(0, len(unused)))],)
        else:
            return None
        where = {v: i for i, v in enumerate(graph.topo_order)}
        nodes = sorted(stages[k].nodes, key=where.__getitem__)
        cut = int(rng.integers(1, len(nodes)))
        stages[k:k + 1] = [Stage(tuple(nodes[:cut]), first), Stage(tuple(nodes[cut:]), second)]
    elif move == 5 and n > 1:  # merge two neighbouring stages
        k = int(rng.integers(0, n - 1))
        stages[k:k + 2] = [Stage(stages[k].nodes + stages[k + 1].nodes, stages[k].devices + stages[k + 1].devices)]
    elif move == 6 and len(choices) > 1:  # double or halve the micro-batches
        i = choices.index(plan.microbatches) if plan.microbatches in choices else 0
        j = min(len(choices) - 1, max(0, i + (1 if rng.random() < 0.5 else -1)))
        if j == i:
            return None
        return replace(plan, microbatches=choices[j], predicted=None)
    else:
        return None
    out = _with_stages(plan, stages)
    return None if plan_problems(out, graph, cluster) else out


def local_search(graph: Graph, cluster: Cluster, options: PlanOptions, start: Plan | None = None,
                 max_iters: int | None = None, progress: Callable[[float], None] | None = None) -> Plan:
    scorer = Scorer(graph, cluster, options)
    max_iters = max_iters if max_iters is not None else options.max_iters
    if start is None:
        from hetplan.planners.dp import dp

        try:
            start = dp(graph, cluster, options)
        except InfeasibleError:
            from hetplan.planners.baselines import balanced_time

            start = balanced_time(graph, cluster, options)
    choices = tuple(sorted(set(microbatch_choices(graph, replace(options, microbatches=None)))
                           | {start.microbatches}))
    if options.microbatches:
        choices = (options.microbatches,)
    rng = np.random.default_rng(options.seed)
    budget = options.budget_s or DEFAULT_BUDGET_S
    current = replace(start, planner="local-search", predicted=None)
    cur_v = scorer.search_value(current)
    best, best_v = (current, scorer.value(current)) if math.isfinite(scorer.value(current)) else (None, math.inf)
    start_v = best_v
    began = time.perf_counter()
    iters = accepted = 0
    while True:
        elapsed = time.perf_counter() - began
        if (max_iters is not None and iters >= max_iters) or (max_iters is None and elapsed >= budget):
            break
        iters += 1
        if progress is not None and iters % 20 == 0:
            progress(min(1.0, iters / max_iters if max_iters else elapsed / budget))
        cand = neighbour(current, graph, cluster, rng, choices)
        if cand is None:
            continue
        v = scorer.search_value(cand)
        frac = max(0.0, 1.0 - (iters / max_iters if max_iters else elapsed / budget))
        temperature = START_TEMPERATURE * frac
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
