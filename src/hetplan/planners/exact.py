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
memory formula is the simulator's). With `recompute` allowed (`where-needed`), each candidate's
stages recompute exactly where they would not fit otherwise (and, with `shard`, every stage of
several replicas shards its optimizer state first: it only saves): for a given split and number of
micro-batches that is the best choice, since recomputing only adds time. Problems with more
than `limit` candidates are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import microbatch_fractions
from hetplan.cost.stage_table import StageTable
from hetplan.errors import InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage
from hetplan.planners.devices import device_classes
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.objectives import objective
from hetplan.planners.options import PlanOptions
from hetplan.planners.refine import with_recompute, with_shard
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import cut_states, subset_matrix

LIMIT = 200_000


def _multisets(avail: tuple[int, ...], cap: int | None = None) -> list[tuple[int, ...]]:
    """Every non-empty choice of how many devices to take from each class (at most `cap` in all)."""
    out: list[tuple[int, ...]] = [()]
    for a in avail:
        out = [x + (c,) for x in out for c in range(a + 1) if cap is None or sum(x) + c <= cap]
    return [x for x in out if any(x)]


def _assignments(avail: tuple[int, ...], n: int, cap: int | None = None) -> Iterator[tuple[tuple[int, ...], ...]]:
    if n == 0:
        yield ()
        return
    for group in _multisets(avail, cap):
        rest = tuple(a - g for a, g in zip(avail, group, strict=True))
        if sum(rest) < n - 1:
            continue
        for tail in _assignments(rest, n - 1, cap):
            yield (group, *tail)


def count_assignments(avail: tuple[int, ...], n: int, cap: int | None = None) -> int:
    """How many ordered choices of n disjoint non-empty groups (of at most `cap` devices) the
    classes allow, devices may stay unused. Without a cap, in closed form: the a devices of a
    class fall into the n groups or "unused" in C(a + n, n) ways, and inclusion-exclusion takes
    out the choices that leave a group empty (polynomial, where enumerating is exponential in
    the classes). With a cap, by recursion over the first group (few groups when the cap is small)."""
    if cap is None:
        return sum((-1) ** k * math.comb(n, k) * math.prod(math.comb(a + n - k, n - k) for a in avail)
                   for k in range(n + 1))
    return _count_capped(avail, n, cap, {})


def count_single_devices(avail: tuple[int, ...], n: int) -> int:
    """How many ordered choices of n single devices the classes allow: a lower bound of
    `count_assignments` under any cap, n! [x^n] prod_c sum_{j <= a_c} x^j / j!, exact in fractions."""
    poly = [Fraction(1)]
    for a in avail:
        term = [Fraction(1, math.factorial(j)) for j in range(a + 1)]
        poly = [sum(poly[i] * term[k - i] for i in range(len(poly)) if 0 <= k - i < len(term))
                for k in range(min(n, len(poly) + a - 1) + 1)]
    return int(poly[n] * math.factorial(n)) if n < len(poly) else 0


def _count_capped(avail: tuple[int, ...], n: int, cap: int, memo: dict) -> int:
    if n == 0:
        return 1
    if (avail, n) not in memo:
        memo[(avail, n)] = sum(_count_capped(tuple(a - g for a, g in zip(avail, group, strict=True)), n - 1, cap, memo)
                               for group in _multisets(avail, cap))
    return memo[(avail, n)]


def _count(n: float) -> str:
    """A count for a message: in full up to a trillion, then as a power of ten."""
    return f"{n:,.0f}" if n < 1e12 else f"10^{math.floor(math.log10(n))}"


def refusal(graph: Graph, what: str, limit: int) -> InfeasibleError:
    """exact's refusal, with the way to a smaller problem that applies to this graph."""
    fewer = ("profile it with --granularity block" if graph.source.startswith("profile:")
             else f"a graph of fewer than its {len(graph.nodes)} nodes")
    return InfeasibleError(f"exact: {what}, too many to search (limit {limit:,}); use dp or local-search, "
                           f"or make the problem smaller (fewer devices; {fewer})")


class _Space:
    """Every plan exact may return: chains of cut states, groups of device classes per stage,
    and a number of micro-batches; counted before anything is enumerated, and refused as soon
    as a count passes the limit (a lower bound first, from the graph's size alone)."""

    def __init__(self, graph: Graph, cluster: Cluster, options: PlanOptions, scorer: Scorer, limit: int) -> None:
        self.classes = device_classes(cluster)
        self.avail = tuple(len(c) for c in self.classes)
        self.choices = microbatch_choices(graph, options)
        self.max_n = min(sum(self.avail), len(graph.nodes))
        self.cap = options.max_replicas
        fewest = [count_assignments(self.avail, n) if self.cap is None else count_single_devices(self.avail, n)
                  for n in range(self.max_n + 1)]
        # every prefix of a topological order is a cut state: at least C(N - 1, n - 1) chains of n stages
        at_least = len(self.choices) * sum(math.comb(len(graph.nodes) - 1, n - 1) * fewest[n]
                                           for n in range(1, self.max_n + 1))
        if at_least > limit:
            raise refusal(graph, f"at least {_count(at_least)} candidate plans", limit)
        ways = fewest if self.cap is None else [count_assignments(self.avail, n, self.cap)
                                                for n in range(self.max_n + 1)]
        self.states = states = cut_states(graph, limit=4096)
        if not states.complete:
            raise refusal(graph, f"graph {graph.name!r} has more than 4,096 cut states", limit)
        self.s = s = len(states.ideals)
        mat = states.matrix()
        below = subset_matrix(mat)
        self.chains = self._count_chains(graph, below, limit, ways)
        self.total = len(self.choices) * sum(self.chains[n][0] * ways[n] for n in range(1, self.max_n + 1))
        if self.total > limit:
            raise refusal(graph, f"{self.total:,} candidate plans", limit)
        self.above = [np.nonzero(below[i])[0].tolist() for i in range(s)]
        table = StageTable(scorer.cost, mat, states.order)
        self.time_of = {cluster.device(c[0]).type: table.whole_s(table.kind((c[0],)), 0, np.arange(s))
                        for c in self.classes}
        self.class_type = [cluster.device(c[0]).type for c in self.classes]

    def _count_chains(self, graph: Graph, below: np.ndarray, limit: int, ways: list[int]) -> list[list[int]]:
        """chains[n][i]: how many ways the nodes outside state i split into n stages, one matrix
        product per n, stopping as soon as the plans counted so far pass the limit. The counts
        are exact: none exceeds the count from the empty state (a chain from state i is one
        from the empty state with i's stage dropped), which stays below the limit."""
        step = below.astype(float)
        count = np.zeros(self.s)
        count[-1] = 1.0
        chains, so_far = [count.astype(int).tolist()], 0.0
        for n in range(1, self.max_n + 1):
            count = step @ count
            so_far += len(self.choices) * count[0] * ways[n]
            if so_far > limit:
                raise refusal(graph, f"at least {_count(so_far)} candidate plans", limit)
            chains.append(count.astype(int).tolist())
        return chains

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
            if self.chains[n - 1][j]:
                for rest in self.walk(j, n - 1):
                    yield ((i, j), *rest)

    def candidates(self, batch: int) -> list[tuple]:
        """(a lower bound on the step, the slowest stage's compute, chain, groups, m) of every
        candidate plan."""
        first = {m: max(microbatch_fractions(batch, m)) for m in self.choices}
        out = []
        for n in range(1, self.max_n + 1):
            if not self.chains[n][0]:
                continue
            assignments = list(_assignments(self.avail, n, self.cap))
            for chain in self.walk(0, n):
                for groups in assignments:
                    times = [self.stage_time(i, j, g) for (i, j), g in zip(chain, groups, strict=True)]
                    slowest, through = max(times), sum(times)
                    out += [(max(slowest, through * first[m]), slowest, chain, groups, m) for m in self.choices]
        return out


def _lower(space: _Space, cluster: Cluster, options: PlanOptions, scorer: Scorer, bound_s: float,
           slowest_s: float, groups: tuple[tuple[int, ...], ...]) -> float:
    """A lower bound on the objective of a candidate whose step is at least bound_s and whose
    slowest stage computes for slowest_s (the steady state's bottleneck is at least that)."""
    usd = sum(cluster.device(space.classes[ci][0]).usd_per_hour * c for g in groups for ci, c in enumerate(g))
    return objective(options).lower(bound_s, slowest_s, usd, scorer.graph.batch_size, options, scorer.t_ref_s)


def exact(graph: Graph, cluster: Cluster, options: PlanOptions, limit: int = LIMIT) -> Plan:
    scorer = Scorer(graph, cluster, options)
    space = _Space(graph, cluster, options, scorer, limit)
    batch = graph.batch_size
    floor_s = batch / options.min_samples_per_s if objective(options).floor else math.inf
    scored = sorted(((_lower(space, cluster, options, scorer, b, slow, g), b, chain, g, m)
                     for b, slow, chain, g, m in space.candidates(batch)), key=lambda x: x[:2])
    best_value, best_plan, looked = math.inf, None, []
    for low, bound_s, chain, groups, m in scored:
        if low >= best_value:
            break
        if bound_s > floor_s:
            continue
        # for a given split the best recomputes exactly where memory needs it (it only adds time)
        plan = with_recompute(scorer.cost, with_shard(scorer.cost, _realise(space.states, space.classes, chain,
                                                                            groups, m, options), options.shard),
                              options.recompute)
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
