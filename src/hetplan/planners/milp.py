"""`milp`: the certified optimum of the `throughput` objective, by a mixed-integer program (HiGHS).

PipeDream's question (Narayanan et al., SOSP 2019), the steady state of a pipeline that never
flushes (`hetplan.cost.CostModel.bottleneck_s`), is a maximum of per-stage and per-cut terms. So
the best plan is a chain of cut states {} = S_0 < S_1 < ... < S_n = V (`hetplan.planners.states`,
all of them: no coarsening) with a group of devices per stage that minimises the largest term.
PipeDream and dp solve it by dynamic programming over a restricted space. Here mixed-integer
programs solved by HiGHS find the optimum, or at the time budget a lower bound. Either way the
answer certifies how far any plan of the space can be from the best.

The space: each stage runs on a *group*, a multiset of device classes (`devices.device_classes`:
devices alike, on one host) of at most `--max-replicas` devices, mixed types and hosts allowed as
in dp; past MAX_GROUPS multisets, r devices of one class (PipeDream's replicas). A cut's link is
the slowest between the classes the two groups use, and the hosts' network interfaces it crosses
cap what it carries at once (`CostModel._cut_Bps`), so the cut conflicts below are written per
pair of class sets (one pair when every link of the cluster is the same, on one host).

The optimum is one of finitely many values: a stage option's time (s = (i, j, group): compute on
the group plus its all-reduce shared by its r devices) or a cut term 2 bytes(S_k) / (bandwidth r).
The search bisects over those values between the best lower bound and the best plan found.
Each step asks HiGHS (`scipy.optimize.milp`) whether some plan has every term at most L:

    x_s in {0, 1} for each option s with time <= L
    flow:      sum_{s ends at k} x_s - sum_{s starts at k} x_s = [k = V] - [k = {}]   every state k
    devices:   sum_s (devices of class c in s) x_s <= |c|                               every class c
    conflicts: in_{k,a,r} + out_{k,b} <= 1   where 2 bytes(S_k) / (bandwidth(a, b) r) > L,
               and the same with the two sides swapped

Here in_{k,a,r} is the sum of the options that end at k on r devices of class set a, and out_{k,b}
the sum of those that start at k on class set b. The slower of the two sides is
2 bytes / (bandwidth min(r, r')), as in `formulas.steady_cut_s`; the hosts' interfaces add the
term 2 bytes / cap(a, b), a conflict whatever the sizes. A program proven infeasible
raises the lower bound. A plan found lowers the upper bound to its own exact bottleneck. At the
time budget the answer is the best plan with its bound and gap; otherwise it is the optimum.
(Minimising B directly, with B >= time_s x_s, gave HiGHS a weak relaxation: resnet50 on 8
devices found no plan in 60 s.)

Memory: an option is kept only if the weights, gradients and Adam state of its stage fit every
device of its group. Activations are left out, so the program is a relaxation: its bound is
valid, and the plan returned is the best that the event simulator finds fitting. Before the
search, options that cannot beat an upper bound U (dp's plan) are dropped:
- those slower on their own;
- those beside a cut that is slower than U even at the fastest link over all their lanes;
- those that leave more than U per stage of the rest of the graph on the remaining devices,
  even at the fastest type's speed.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import Bounds, LinearConstraint
from scipy.optimize import milp as highs_milp
from scipy.sparse import coo_array

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage
from hetplan.planners.devices import device_classes
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import StateSums

MAX_OPTIONS = 2_000_000  # stage options past which the program is refused (memory, solve time)
MAX_STATES = 4096  # cut states past which the program is refused (the states' subset matrix is quadratic)
MAX_GROUPS = 4096  # multisets of device classes per stage past which a stage takes one class only
DEFAULT_BUDGET_S = 60.0


@dataclass(frozen=True)
class Group:
    """A stage's devices: how many of each class, the key of its links, the devices themselves."""

    counts: tuple[int, ...]
    link_key: int  # the classes it uses, as bits (which links its cuts cross); 0 when every link is the same
    devices: tuple[str, ...]


def _groups(classes: list[list[str]], cap: int, uniform: bool) -> list[Group]:
    """Every group a stage may take: any multiset of classes of at most `cap` devices, or, past
    MAX_GROUPS of them, r devices of one class (see the module's docstring)."""
    shapes: list[tuple[int, ...]] = [()]
    for members in classes:
        shapes = [s + (k,) for s in shapes for k in range(len(members) + 1) if sum(s) + k <= cap]
        if len(shapes) > MAX_GROUPS:
            shapes = [tuple(r if k == c else 0 for k in range(len(classes)))
                      for c, members in enumerate(classes) for r in range(1, min(cap, len(members)) + 1)]
            break
    out = []
    for shape in shapes:
        if any(shape):
            devices = tuple(d for members, k in zip(classes, shape, strict=False) for d in members[:k])
            support = sum(1 << c for c, k in enumerate(shape) if k)
            out.append(Group(shape + (0,) * (len(classes) - len(shape)), 0 if uniform else support, devices))
    return out


class _Rows:
    """A sparse constraint matrix built row by row or block by block."""

    def __init__(self) -> None:
        self.r: list[np.ndarray] = []
        self.c: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    @property
    def count(self) -> int:
        return len(self.lo)

    def add_block(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
        """Entries of rows from `count` on, whose bounds `bounds` gives next."""
        self.r.append(np.asarray(rows, dtype=int))
        self.c.append(np.asarray(cols, dtype=int))
        self.v.append(np.asarray(vals, dtype=float))

    def bounds(self, *pairs: tuple[float, float]) -> None:
        for lo, hi in pairs:
            self.lo.append(lo)
            self.hi.append(hi)

    def add_row(self, cols: np.ndarray, vals: np.ndarray, lo: float, hi: float) -> None:
        self.add_block(np.full(len(cols), self.count), cols, vals)
        self.bounds((lo, hi))

    def constraint(self, variables: int) -> LinearConstraint:
        a = coo_array((np.concatenate(self.v), (np.concatenate(self.r), np.concatenate(self.c))),
                      shape=(self.count, variables))
        return LinearConstraint(a.tocsr(), np.array(self.lo), np.array(self.hi))


def _uniform_links(cluster: Cluster) -> bool:
    """Every link the same and one host (so no cut goes through a host's network interface)."""
    if len(cluster.hosts) > 1:
        return False
    ids = cluster.ids
    links = {(cluster.link(a, b).bandwidth_Bps, cluster.link(a, b).latency_s) for a in ids for b in ids if a != b}
    return len(links) <= 1


class _Program:
    """The stage options and the constraint matrix of one problem."""

    def __init__(self, graph: Graph, cluster: Cluster, options: PlanOptions, scorer: Scorer, upper_s: float):
        self.prob = prob = StateSums(graph, scorer.cost, max_states=MAX_STATES)
        if not prob.states.complete or len(prob.ideals) < len(prob.states):
            raise InfeasibleError(f"milp: graph {graph.name!r} has more than {MAX_STATES:,} cut states, too many "
                                  "to list them all; use dp")
        self.classes = device_classes(cluster)
        self.uniform = _uniform_links(cluster)
        cap = options.max_replicas or len(cluster.devices)
        self.groups = _groups(self.classes, cap, self.uniform)
        self.cost = scorer.cost
        self._options(upper_s)

    def _options(self, upper_s: float) -> None:
        """Arrays over the stage options: states i and j, group index, steady time (the table's
        figures: `StageTable.whole_s` per device, `StageTable.steady_s`, weights against memory)."""
        prob, cost, table = self.prob, self.cost, self.prob.table
        pairs = [(i, j) for j in range(len(prob.ideals)) for i in prob.below[j]]
        if not pairs:
            raise InfeasibleError("milp: the graph has no stages to plan")
        i_arr, j_arr = (np.array(x, dtype=int) for x in zip(*pairs, strict=True))
        kinds = {t: prob.kind_of_type(t) for t in prob.types}
        whole = {t: table.whole_s(k, i_arr, j_arr) for t, k in kinds.items()}
        # what the other stages must do: no device computes faster than the fastest type, so
        # the rest of the work over the devices left takes at least this long per stage
        fastest = np.min([table.whole_s(k, 0, np.arange(len(prob.ideals))) for k in kinds.values()], axis=0)
        rest = fastest[-1] - (fastest[j_arr] - fastest[i_arr])
        total = len(cost.cluster.devices)
        # a cut's lanes are at most the group's size: the heaviest cut it touches at the fastest link
        fast_Bps = max(cost.cluster.link(a, b).bandwidth_Bps for a in cost.cluster.ids for b in cost.cluster.ids
                       if a != b) if total > 1 else math.inf
        touch = np.maximum(np.where(i_arr > 0, prob.cut[i_arr], 0.0),
                           np.where(j_arr < len(prob.ideals) - 1, prob.cut[j_arr], 0.0))
        cols: list[tuple[np.ndarray, ...]] = []
        for g, group in enumerate(self.groups):
            speed = np.zeros(len(pairs))
            for dev in group.devices:
                w = whole[cost.cluster.device(dev).type]
                with np.errstate(divide="ignore"):
                    speed += np.where(w > 0, 1.0 / w, np.inf)
            compute = np.where(np.isfinite(speed), 1.0 / speed, 0.0)
            steady = table.steady_s(compute, group.devices, i_arr, j_arr)
            fits = np.all([table.memory_terms(table.kind((dev,)), i_arr, j_arr)[0] >= 0 for dev in group.devices],
                          axis=0)
            r = len(group.devices)
            others = total - r
            floor = np.maximum(steady, table.steady_lanes_s(touch, fast_Bps, r))
            floor = np.maximum(floor, np.where(rest <= 0, 0.0, rest / others if others else np.inf))
            keep = fits & (floor <= upper_s * (1 + 1e-9))
            cols.append((i_arr[keep], j_arr[keep], np.full(int(keep.sum()), g), steady[keep], floor[keep]))
        self.i, self.j, self.g, self.steady, self.floor = (np.concatenate(x) for x in zip(*cols, strict=True))
        if len(self.i) > MAX_OPTIONS:
            raise InfeasibleError(f"milp: {len(self.i):,} stage options, too many to solve (limit {MAX_OPTIONS:,}); "
                                  "use dp, or --max-replicas to make the problem smaller")

    def cut_values(self) -> list[tuple[int, int, int, int, float]]:
        """(state, link key before, link key after, replicas, seconds) of every cut term
        2 bytes / (bandwidth r) that the options allow, r the replicas of the side it counts."""
        sizes = np.array([len(self.groups[g].devices) for g in self.g])
        keys = np.array([self.groups[g].link_key for g in self.g])
        table, out = self.prob.table, []
        for k in range(1, len(self.prob.ideals) - 1):
            nbytes = float(self.prob.cut[k])
            into, leave = self.j == k, self.i == k
            if nbytes > 0 and into.any() and leave.any():
                for a in np.unique(keys[into]):
                    for b in np.unique(keys[leave]):
                        bw = self._bandwidth(int(a), int(b))
                        for r in np.unique(np.r_[sizes[into & (keys == a)], sizes[leave & (keys == b)]]):
                            out.append((k, int(a), int(b), int(r), float(table.steady_lanes_s(nbytes, bw, r))))
                        cap = self._nic_cap(int(a), int(b))
                        if math.isfinite(cap):  # the hosts' interfaces, whatever the sizes (size 0: any)
                            out.append((k, int(a), int(b), 0, float(table.steady_lanes_s(nbytes, cap, 1))))
        return out

    def _nic_cap(self, a: int, b: int) -> float:
        """`CostModel._nic_cap_Bps` between groups of classes `a` and `b` (bits): it depends on
        their hosts only, so one device per class stands for the class."""
        if self.uniform:
            return math.inf
        one = [members[:1] for members in self.classes]
        senders = [d for c, m in enumerate(one) if a >> c & 1 for d in m]
        receivers = [d for c, m in enumerate(one) if b >> c & 1 for d in m]
        return self.prob.table.nic_cap_Bps(senders, receivers)

    def feasibility(self, limit_s: float, cuts: list) -> tuple[np.ndarray, LinearConstraint, np.ndarray]:
        """The program "a plan whose every stage and cut takes at most limit_s": the options
        allowed (floor <= limit_s), flow, devices, and for every cut term over the limit a
        conflict: the two stages it joins cannot both be chosen. Returns the objective (the sum
        of the chosen stages' times, to prefer short ones), the rows, and the options used."""
        used = np.nonzero(self.floor <= limit_s)[0]
        n, states = len(used), len(self.prob.ideals)
        rows = _Rows()
        option = np.arange(n)
        i, j, g = self.i[used], self.j[used], self.g[used]
        rows.add_block(np.r_[j, i], np.r_[option, option], np.r_[np.ones(n), -np.ones(n)])
        rows.bounds(*([(1.0 if k == states - 1 else 0.0) - (1.0 if k == 0 else 0.0)] * 2 for k in range(states)))
        counts = np.array([self.groups[x].counts for x in g], dtype=float).reshape(n, len(self.classes))
        for c, members in enumerate(self.classes):
            has = np.nonzero(counts[:, c])[0]
            rows.add_row(has, counts[has, c], -np.inf, float(len(members)))
        sizes = np.array([len(self.groups[x].devices) for x in g], dtype=int)
        keys = np.array([self.groups[x].link_key for x in g], dtype=int)
        # sums of the options that end (or start) at a state with a link key (and a size): a
        # variable each, so that a conflict is a row of two entries however many options it covers
        sums: dict[tuple, int] = {}
        variables = n

        def total(at: np.ndarray, k: int, key: int, size: int) -> int | None:
            nonlocal variables
            members = np.nonzero((at == k) & (keys == key) & ((sizes == size) if size else True))[0]
            if not len(members):
                return None
            tag = (at is j, k, key, size)
            if tag not in sums:
                sums[tag] = variables
                rows.add_row(np.r_[members, variables], np.r_[np.ones(len(members)), -1.0], 0.0, 0.0)
                variables += 1
            return sums[tag]

        for k, a, b, r, seconds in cuts:
            if seconds <= limit_s:
                continue
            for mine, other in ((total(j, k, a, r), total(i, k, b, 0)), (total(i, k, b, r), total(j, k, a, 0))):
                if mine is not None and other is not None:
                    rows.add_row(np.array([mine, other]), np.ones(2), -np.inf, 1.0)
        cost = np.r_[self.steady[used], np.zeros(variables - n)]
        return cost, rows.constraint(variables), used

    def _bandwidth(self, a: int, b: int) -> float:
        """The slowest link from a group of classes `a` (bits) to one of classes `b`, as
        `CostModel._slowest_Bps` sees the two stages' devices (within one class: two of its devices)."""
        if self.uniform:
            ids = self.cost.cluster.ids
            return self.prob.table.slowest_Bps(ids[:1], ids[1:2]) if len(ids) > 1 else math.inf
        slowest = math.inf
        for c, one in enumerate(self.classes):
            for d, other in enumerate(self.classes):
                if a >> c & 1 and b >> d & 1:
                    pair = (one[:1], one[1:2]) if c == d else (one, other)
                    if pair[1]:
                        slowest = min(slowest, self.prob.table.slowest_Bps(*pair))
        return slowest

    def bottleneck_of(self, chosen: np.ndarray) -> float:
        """The steady state of the chosen options' plan (`CostModel.bottleneck_s`)."""
        return self.cost.bottleneck_s(self.plan(chosen, 1, PlanOptions()))

    def plan(self, chosen: np.ndarray, m: int, options: PlanOptions) -> Plan:
        """The chain of the chosen options, from the empty state, with devices taken in class order."""
        by_start = {int(self.i[s]): s for s in chosen}
        taken: Counter[str] = Counter()
        stages, state = [], 0
        while state != len(self.prob.ideals) - 1:
            s = by_start[state]
            group = self.groups[int(self.g[s])]
            devices = []
            for members, k in zip(self.classes, group.counts, strict=True):
                key = members[0]
                devices += members[taken[key]:taken[key] + k]
                taken[key] += k
            stages.append(Stage(self.prob.nodes(state, int(self.j[s])), tuple(devices)))
            state = int(self.j[s])
        return Plan(tuple(stages), m, options.schedule, "milp", "throughput")


def milp(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    """The best plan of the space by the steady state, with its certificate in `meta["milp"]`:
    bisection over the values a bottleneck can take, each step a feasibility program solved by
    HiGHS. Every value proven infeasible is a lower bound; every plan found an upper one."""
    if options.objective != "throughput":
        raise HetplanError("milp: solves the throughput objective only; add --objective throughput")
    from hetplan.planners.dp import dp  # the first upper bound, and the answer if nothing better fits

    scorer = Scorer(graph, cluster, options)
    start = time.perf_counter()
    try:
        best = dp(graph, cluster, options)
        upper = scorer.value(best)
    except InfeasibleError:
        best, upper = None, math.inf
    program = _Program(graph, cluster, options, scorer, upper)
    search = _Bisection(program, upper, options.budget_s or DEFAULT_BUDGET_S)
    for chosen in search.run():
        found = _best_m(program, chosen, graph, options, scorer)
        if found is not None and (best is None or scorer.value(found) < scorer.value(best)):
            best = found
    if best is None:
        raise scorer.infeasible([], "milp")
    value = scorer.value(best)
    meta = {"lower_bound_s": search.lower_s, "optimal": value <= search.lower_s * (1 + 1e-9),
            "gap": value / search.lower_s - 1 if search.lower_s > 0 else None, "options": len(program.i),
            "programs": search.solved, "solve_s": time.perf_counter() - start, "stopped": search.stopped,
            "from": best.planner, "dp_s": upper}
    return replace(best, planner="milp", objective="throughput", meta={**best.meta, "milp": meta})


class _Bisection:
    """Bisection over the sorted values a bottleneck can take (the options' times and the cut
    terms) between a proven lower bound and the best plan found."""

    def __init__(self, program: _Program, upper_s: float, budget_s: float) -> None:
        self.program, self.budget_s = program, budget_s
        self.cuts = program.cut_values()
        values = np.unique(np.r_[program.floor, program.steady, [c[-1] for c in self.cuts]])
        self.values = values[values <= upper_s * (1 + 1e-9)] if math.isfinite(upper_s) else values
        self.lower_s = float(self.values[0]) if len(self.values) else upper_s
        self.upper_s, self.solved, self.stopped = upper_s, 0, ""

    def run(self):
        """Yields the options of each plan found (its bottleneck becomes the new upper bound)."""
        deadline = time.perf_counter() + self.budget_s
        lo, hi = 0, len(self.values) - 1 if math.isfinite(self.upper_s) else len(self.values)
        while lo < hi:
            mid = (lo + hi) // 2
            left = deadline - time.perf_counter()
            if left <= 0:
                self.stopped = "time budget"
                return
            res = self._solve(float(self.values[mid]), left)
            if res is None or res.status == 2:  # infeasible: the optimum is above this value
                lo = mid + 1
                self.lower_s = float(self.values[lo]) if lo < len(self.values) else math.inf
            elif res.x is not None:
                chosen = res.chosen
                yield chosen
                reached = max(self.program.bottleneck_of(chosen), 0.0)
                hi = min(mid, int(np.searchsorted(self.values, reached * (1 - 1e-12))))
                self.upper_s = min(self.upper_s, reached)
            else:
                self.stopped = res.message
                return
        self.lower_s = float(self.values[lo]) if lo < len(self.values) else self.lower_s

    def _solve(self, limit_s: float, left_s: float):
        """HiGHS on the feasibility program at limit_s (None: no option is that fast). Its
        presolve is off: on resnet50's 80,000 options it took over 7 GB and did not finish,
        where the branch and bound alone proves infeasibility in 1.5 s."""
        cost, rows, used = self.program.feasibility(limit_s, self.cuts)
        if not len(used):
            return None
        binary = np.r_[np.ones(len(used)), np.zeros(len(cost) - len(used))]
        res = highs_milp(cost, constraints=rows, integrality=binary,
                         bounds=Bounds(np.zeros(len(cost)), np.where(binary > 0, 1.0, np.inf)),
                         options={"time_limit": left_s, "presolve": False})
        self.solved += 1
        res.chosen = used[np.nonzero(res.x[: len(used)] > 0.5)[0]] if res.x is not None else None
        return res


def _best_m(program: _Program, chosen: np.ndarray, graph: Graph, options: PlanOptions,
            scorer: Scorer) -> Plan | None:
    """The program's plan with the micro-batches that fit (the steady state does not depend on
    them), the shortest step among those; None when none fits."""
    plans = [program.plan(chosen, m, options) for m in microbatch_choices(graph, options)]
    fitting = [p for p in plans if math.isfinite(scorer.value(p))]
    return min(fitting, key=lambda p: (scorer.value(p), scorer.estimate(p).step_s), default=None)
