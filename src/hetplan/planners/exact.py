"""`exact`: the optimum over every valid plan of a small problem, scored by the event simulator.

The reference against which every other planner's gap is measured. A valid plan is a chain of
down-sets {} = S_0 < S_1 < ... < S_n = V (every convex stage sequence in pipeline order is one,
`hetplan.planners.states`) with a non-empty group of devices per stage, no device in two
stages, devices left unused allowed, and a number of micro-batches from the same choices as
`dp` ({1, 2, 4, ..., 32} up to the batch, or the user's). Devices that cannot be told apart (same
type, host, memory and price, no link of their own) are interchangeable, so each group is
enumerated as a multiset of such classes.

Branch and bound keeps it exact while simulating few plans: every candidate gets a lower bound
that the simulator can never beat (the slowest stage's time, which its busiest replica spends
computing, and one micro-batch's forward and backward through all stages), candidates are
simulated in order of that bound, and the search stops when the bound of the next one cannot
beat the best value found. Plans that do not fit in memory are skipped before simulation (the
memory formula is the simulator's). Problems with more than `limit` candidates are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import microbatch_fractions
from hetplan.cost.formulas import usd_per_step
from hetplan.errors import InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage
from hetplan.planners.devices import device_classes
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import cut_states

LIMIT = 200_000


def _multisets(avail: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every non-empty choice of how many devices to take from each class."""
    out: list[tuple[int, ...]] = [()]
    for a in avail:
        out = [x + (c,) for x in out for c in range(a + 1)]
    return [x for x in out if any(x)]


def _assignments(avail: tuple[int, ...], n: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    if n == 0:
        yield ()
        return
    for group in _multisets(avail):
        rest = tuple(a - g for a, g in zip(avail, group, strict=True))
        if sum(rest) < n - 1:
            continue
        for tail in _assignments(rest, n - 1):
            yield (group, *tail)


def count_assignments(avail: tuple[int, ...], n: int, memo: dict | None = None) -> int:
    memo = {} if memo is None else memo
    if n == 0:
        return 1
    key = (avail, n)
    if key not in memo:
        total = 0
        for group in _multisets(avail):
            rest = tuple(a - g for a, g in zip(avail, group, strict=True))
            if sum(rest) >= n - 1:
                total += count_assignments(rest, n - 1, memo)
        memo[key] = total
    return memo[key]


REFUSE = ("exact: {what}, too many to search (limit {limit:,}); use dp or local-search, or make the "
          "problem smaller (fewer nodes: --granularity block; fewer devices)")


class _Space:
    """Every plan exact may return: chains of cut states, groups of device classes per stage,
    and a number of micro-batches; counted before anything is enumerated."""

    def __init__(self, graph: Graph, cluster: Cluster, options: PlanOptions, scorer: Scorer, limit: int) -> None:
        self.states = states = cut_states(graph, limit=4096)
        if not states.complete:
            raise InfeasibleError(REFUSE.format(what=f"graph {graph.name!r} has more than 4,096 cut states",
                                                limit=limit))
        self.classes = device_classes(cluster)
        self.avail = tuple(len(c) for c in self.classes)
        ideals = states.ideals
        self.s = s = len(ideals)
        self.above = [[j for j in range(i + 1, s) if ideals[i] & ~ideals[j] == 0] for i in range(s)]
        # chains[(i, n)]: how many ways the nodes outside state i split into n stages
        self.chains: dict[tuple[int, int], int] = {}
        self.max_n = min(sum(self.avail), len(graph.nodes))
        for i in range(s - 1, -1, -1):
            self.chains[(i, 0)] = 1 if i == s - 1 else 0
            for n in range(1, self.max_n + 1):
                self.chains[(i, n)] = sum(self.chains[(j, n - 1)] for j in self.above[i])
        self.choices = microbatch_choices(graph, options)
        memo: dict = {}
        self.total = len(self.choices) * sum(self.chains[(0, n)] * count_assignments(self.avail, n, memo)
                                             for n in range(1, self.max_n + 1))
        if self.total > limit:
            raise InfeasibleError(REFUSE.format(what=f"{self.total:,} candidate plans", limit=limit))
        mat = states.matrix().astype(float)
        node_t = {t: scorer.cost.node_times_s(t) for t in {d.type for d in cluster.devices}}
        self.time_of = {t: mat @ np.array([sum(times[v]) for v in states.order]) for t, times in node_t.items()}
        self.class_type = [cluster.device(c[0]).type for c in self.classes]

    def stage_time(self, i: int, j: int, group: tuple[int, ...]) -> float:
        speed = 0.0
        for ci, c in enumerate(group):
            if c:
                dt = self.time_of[self.class_type[ci]][j] - self.time_of[self.class_type[ci]][i]
                if dt <= 0:
                    return 0.0
                speed += c / dt
        return 1.0 / speed

    def walk(self, i: int, n: int) -> Iterator[tuple[tuple[int, int], ...]]:
        if n == 0:
            if i == self.s - 1:
                yield ()
            return
        for j in self.above[i]:
            if self.chains[(j, n - 1)]:
                for rest in self.walk(j, n - 1):
                    yield ((i, j), *rest)

    def candidates(self, batch: int) -> list[tuple]:
        """(a lower bound on the step, chain, groups, m) of every candidate plan."""
        first = {m: max(microbatch_fractions(batch, m)) for m in self.choices}
        out = []
        for n in range(1, self.max_n + 1):
            if not self.chains[(0, n)]:
                continue
            assignments = list(_assignments(self.avail, n))
            for chain in self.walk(0, n):
                for groups in assignments:
                    times = [self.stage_time(i, j, g) for (i, j), g in zip(chain, groups, strict=True)]
                    slowest, through = max(times), sum(times)
                    out += [(max(slowest, through * first[m]), chain, groups, m) for m in self.choices]
        return out


def _lower(space: _Space, cluster: Cluster, options: PlanOptions, scorer: Scorer, bound_s: float,
           groups: tuple[tuple[int, ...], ...]) -> float:
    """A lower bound on the objective of a candidate whose step is at least bound_s."""
    if options.objective == "time":
        return bound_s
    if options.objective == "cost":
        usd = sum(cluster.device(space.classes[ci][0]).usd_per_hour * c for g in groups for ci, c in enumerate(g))
        return usd_per_step(usd, bound_s) / scorer.graph.batch_size
    return options.alpha * bound_s / scorer.t_ref_s


def exact(graph: Graph, cluster: Cluster, options: PlanOptions, limit: int = LIMIT) -> Plan:
    scorer = Scorer(graph, cluster, options)
    space = _Space(graph, cluster, options, scorer, limit)
    batch = graph.batch_size
    floor_s = batch / options.min_samples_per_s if options.objective == "cost" else math.inf
    scored = sorted(((_lower(space, cluster, options, scorer, b, g), b, chain, g, m)
                     for b, chain, g, m in space.candidates(batch)), key=lambda x: x[:2])
    best_value, best_plan, looked = math.inf, None, []
    for low, bound_s, chain, groups, m in scored:
        if low >= best_value:
            break
        if bound_s > floor_s:
            continue
        plan = _realise(space.states, space.classes, chain, groups, m, options)
        if any(scorer.cost.stage_memory_bytes(plan, k, d) > cluster.device(d).mem_bytes
               for k, st in enumerate(plan.stages) for d in st.devices):
            continue
        looked.append(plan)
        value = scorer.value(plan)
        if value < best_value:
            best_value, best_plan = value, plan
    if best_plan is None:
        fastest_s = min((b for _, b, _, _, _ in scored), default=math.inf)
        if fastest_s > floor_s:
            raise InfeasibleError(
                f"no plan reaches {options.min_samples_per_s:g} samples/s: even the fastest split is at most "
                f"{batch / fastest_s:,.1f} samples/s: lower --min-samples-per-s or add devices")
        raise scorer.infeasible(looked, "exact")
    return Plan(best_plan.stages, best_plan.microbatches, best_plan.schedule, "exact", options.objective,
                meta={"exact": {"candidates": space.total, "simulated": scorer.simulations,
                                "cut_states": space.s, "device_classes": len(space.classes)}})


def _realise(states, classes: list[list[str]], chain, groups, m: int, options: PlanOptions) -> Plan:
    taken = [0] * len(classes)
    stages = []
    for (i, j), group in zip(chain, groups, strict=True):
        devices = []
        for ci, c in enumerate(group):
            devices += classes[ci][taken[ci]:taken[ci] + c]
            taken[ci] += c
        stages.append(Stage(states.members(states.ideals[j] & ~states.ideals[i]), tuple(devices)))
    return Plan(tuple(stages), m, options.schedule, "exact", options.objective)
