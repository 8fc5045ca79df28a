"""Plans for big clusters: a stage program over device *counts per type*, not device ids.

After the planners that split language models over tens to thousands of mixed GPUs: Metis (Um
et al., "Metis: Fast Automatic Distributed Training on Heterogeneous GPUs", USENIX ATC 2024:
device groups of one type per stage, in an order of the types, layers balanced to them), Sailor
(Strati et al., "Sailor: Automating Distributed Training over Dynamic, Heterogeneous, and
Geo-distributed Clusters", SOSP 2025: a search over pipeline depth, micro-batch size and
replicas per type) and Alpa's stage program (Zheng et al., OSDI 2022: enumerate the slowest
stage's time, then minimise the sum under it). Identical devices are interchangeable, so the
program counts them: each type's devices are cut into *units* (a device on small clusters,
whole hosts or groups of hosts on big ones, at most `MAX_UNITS` per type), and a stage takes r
consecutive units of one type (r a power of two, or the rest of its type) as data-parallel
replicas, each a device or a tensor-parallel group of devices of one host (`type_degrees`),
recomputing its activations or not. The types come in an order (every order of up to 3 types);
a plan uses a prefix of each type's units and leaves the rest unused.

For each number of micro-batches m (micro-batches of b = ceil(B / m) rows, every b from one row
to the batch by powers of two), each bound P on the slowest stage, each bound A on a stage's
gradient sum and each depth n the memory is sized for, a backward program over (cut state, unit
position) finds the least

    sum_k (tau_k + 2 c_k)        subject to  tau_k <= P,  AR_k <= A,  memory fits

with tau_k a stage's forward and backward of one micro-batch (its fixed part plus its share of
rows, ceil(b / replicas), as the runtime splits them: a stage never has more replicas than a
micro-batch has rows), or, for a stage of tensor-parallel groups where it is longer, what its
groups receive (every value once per device of a group, in from the stage before and back from
the one after, at the speed into its first devices from those before it in the order:
`_received_s`), c_k the transfer of the cut after it (routed between its devices and the
next ones), AR_k its gradient sum and optimizer step and memory as if n micro-batches were in
flight (1F1B: at most min(m, n); GPipe: m), every figure read from the table of stage options
(`hetplan.cost.stage_table`). A plan deeper than n is kept only where its stages fit as they
are. The model's step of such a plan is

    T = sum_k (tau_k + 2 c_k) + (m - 1) max_k tau_k + max_k AR_k,

by which the candidates are ranked; dp scores the best of them with the fast path and the event
simulator (`hetplan.planners.dp.dp`), so this program's simplifications (a cut's bandwidth taken
with the next devices of the order, no latency, no round-trip bound, memory sized for n in
flight) cost candidates, never a promise.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from hetplan.cluster import Cluster
from hetplan.plan import Plan, Stage
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import StateSums
from hetplan.schedule import get_schedule

MAX_UNITS = 16  # units per device type: past it, a unit is several hosts
P_STEPS = 10  # bounds on the slowest stage tried from the first that has a plan, each P_RATIO above the last
P_RATIO = 1.15
P_COARSE = 1.5  # the first bound with a plan is looked for in these steps from the lower bound,
P_MAX_STEPS = 24  # at most this many (1.5^24 is 17,000 times it: memory can leave few devices usable)
AR_SHARES = (math.inf, 0.1)  # bounds on a stage's gradient sum: none, or this share of the pipeline's time
CANDIDATES = 48  # plans returned at most, best first by the model,
WITHIN = 0.10  # those within this of the best model step
FIRST_MICROBATCHES = 32  # micro-batch counts are tried from this one outwards (the best found prunes the rest)


@dataclass(frozen=True)
class Units:
    """The devices of one order of types cut into units: `devices[u]` the ids of unit u, `type_of[u]`
    the index of its type in `StateSums.types`, `block_end[u]` the first unit after its type's."""

    devices: tuple[tuple[str, ...], ...]
    type_of: tuple[int, ...]
    block_end: tuple[int, ...]

    def span(self, d: int, r: int) -> tuple[str, ...]:
        return tuple(x for u in range(d, d + r) for x in self.devices[u])


def unit_size(count: int, host_size: int) -> int:
    """Devices per unit for a type with `count` devices in hosts of `host_size`: one device while
    there are at most MAX_UNITS, else the fewest whole hosts that leave at most MAX_UNITS units."""
    if count <= MAX_UNITS:
        return 1
    if host_size >= count:
        return math.ceil(count / MAX_UNITS)
    return host_size * math.ceil(count / host_size / MAX_UNITS)


def type_units(cluster: Cluster, type_name: str) -> list[tuple[str, ...]]:
    """The devices of one type, host by host, cut into units of `unit_size`."""
    ids = [d.id for h in cluster.hosts for d in cluster.devices if d.host == h and d.type == type_name]
    per_host = max(sum(1 for d in cluster.devices if d.host == h and d.type == type_name) for h in cluster.hosts)
    size = unit_size(len(ids), per_host)
    return [tuple(ids[k:k + size]) for k in range(0, len(ids), size)]


def unit_orders(cluster: Cluster, types: list[str], names: list[str]) -> list[Units]:
    """One `Units` per order of the types (all orders of up to 3 types; else fastest first and
    its reverse, `types` being sorted fastest first); `type_of` indexes `names`."""
    per_type = {t: type_units(cluster, t) for t in types}
    orders = list(itertools.permutations(types)) if len(types) <= 3 else [tuple(types), tuple(reversed(types))]
    out = []
    for order in orders:
        devices, type_of, block_end = [], [], []
        for t in order:
            devices += per_type[t]
            type_of += [names.index(t)] * len(per_type[t])
            block_end += [len(devices)] * len(per_type[t])
        out.append(Units(tuple(devices), tuple(type_of), tuple(block_end)))
    return out


@dataclass(frozen=True)
class _Option:
    """A stage on units d .. d+r-1 as replicas of `tp` devices each, recomputing or not; `key`
    indexes the figures of its type, degree and choice, `replicas` its replicas."""

    d: int
    r: int
    tp: int
    recompute: str
    key: int
    replicas: int
    devices: tuple[str, ...]
    index: int = 0


def _widths(d: int, end: int) -> list[int]:
    """The unit counts a stage from unit d may take: powers of two, and the rest of its type's units."""
    rest = end - d
    return sorted({*(1 << k for k in range(rest.bit_length()) if 1 << k <= rest), rest})


class _Tables:
    """What the program needs per stage option (`_Option`) and pair of cut states, for one order,
    read from the table of stage options."""

    def __init__(self, prob: StateSums, scorer: Scorer, units: Units, degrees: dict[str, tuple[int, ...]]) -> None:
        self.prob, self.units, self.table = prob, units, prob.table
        self.cluster = scorer.cluster
        self.shard = scorer.options.shard != "never"  # replicated stages shard their optimizer state
        self.recompute = scorer.options.recompute_units(scorer.graph)
        self.sp = scorer.options.sp  # tensor-parallel groups are sequence-parallel too
        self.U, self.n = len(units.devices), len(prob.ideals)
        # each type's units (first, end), the last type first
        self.blocks = sorted({(units.block_end.index(e), e) for e in units.block_end}, reverse=True)
        n = self.n
        self.I, self.J = np.arange(n)[:, None], np.arange(n)[None, :]
        self.keys: list[tuple[str, int, str]] = []  # (type, degree, recompute)
        self.scaled, self.fixed, self.per_batch, self.rebuilt, self.valid = [], [], [], [], []
        self._rooms: dict[tuple, np.ndarray] = {}
        self._tails: dict[tuple, np.ndarray] = {}
        self._bws: dict[tuple[int, int], float] = {}
        self.options = [replace(o, index=k) for k, o in
                        enumerate(o for d in range(self.U) for o in self._options_at(d, degrees))]
        self.opt_d = np.array([o.d for o in self.options])
        self.opt_e = np.array([o.d + o.r for o in self.options])
        self.opt_key = np.array([o.key for o in self.options])
        self.opt_replicas = np.array([o.replicas for o in self.options], dtype=float)
        self.room = np.stack([self._room(o) for o in self.options])  # (options, i, j)
        self.ar = np.stack([self._tail(o) for o in self.options])
        self.bw = np.array([self._bandwidth(o) for o in self.options])
        self.bw_in = np.array([self._in_bandwidth(o) for o in self.options])
        self.scaled, self.fixed = np.stack(self.scaled), np.stack(self.fixed)
        self.per_batch, self.rebuilt = np.stack(self.per_batch), np.stack(self.rebuilt)
        self.valid = np.stack(self.valid) & prob.inside[None]

    def _options_at(self, d: int, degrees: dict[str, tuple[int, ...]]) -> list[_Option]:
        units, out = self.units, []
        type_name = self.prob.types[units.type_of[d]]
        for r in _widths(d, units.block_end[d]):
            devs = units.span(d, r)
            for tp in (1, *degrees.get(type_name, ())):
                groups = [devs[x:x + tp] for x in range(0, len(devs), tp)]
                if len(devs) % tp or any(len({self.cluster.device(x).host for x in g}) > 1 for g in groups):
                    continue
                plain_fits = False  # recomputing only adds time where every stage fits as it is
                for rc in self.recompute if tp == 1 else ("none",):
                    if plain_fits:
                        continue
                    out.append(_Option(d, r, tp, rc, self._key(type_name, groups[0], rc), len(groups),
                                       tuple(g[0] for g in groups)))
                    plain_fits = rc == "none" and self._fits_whole_batch(out[-1])
        return out

    def _key(self, type_name: str, group: tuple[str, ...], rc: str) -> int:
        key = (type_name, len(group), rc)
        if key not in self.keys:
            kind = self.table.kind(group, self.sp)
            scaled, fixed = self.table.compute_s(kind, self.I, self.J, rc)
            _, per_batch, rebuilt = self.table.memory_terms(kind, self.I, self.J, rc)
            self.keys.append(key)
            shape = np.broadcast(self.I, self.J).shape
            self.scaled.append(np.broadcast_to(scaled, shape))
            self.fixed.append(np.broadcast_to(fixed, shape))
            self.per_batch.append(np.broadcast_to(per_batch, shape))
            self.rebuilt.append(np.broadcast_to(rebuilt, shape))
            self.valid.append(np.broadcast_to(self.table.tp_valid(len(group), self.I, self.J), shape))
        return self.keys.index(key)

    def _fits_whole_batch(self, o: _Option) -> bool:
        """Whether every stage on the option (not recomputing) fits, or does not fit at all, with
        the whole batch's activations held."""
        room = self._room(o)
        per_batch = self.per_batch[o.key]
        return bool(np.all(~(self.valid[o.key] & self.prob.inside) | (room <= 0) | (per_batch <= room)))

    def sharding(self, o: _Option) -> bool:
        """Whether stages on the option shard their optimizer state where their gradients are
        dense (`refine.shardable`: replicated, not tensor-parallel)."""
        return self.shard and o.tp == 1 and o.replicas > 1

    def shards(self, o: _Option) -> np.ndarray | int:
        """Over how many replicas stages on the option shard their optimizer state."""
        return np.where(self.table.dense(self.I, self.J), o.replicas, 1) if self.sharding(o) else 1

    def _room(self, o: _Option) -> np.ndarray:
        """Memory left on the option's devices once the stage's weights are in, per (i, j)."""
        type_name = self.prob.types[self.units.type_of[o.d]]
        key = (type_name, o.tp, o.replicas if self.sharding(o) else 1)
        if key not in self._rooms:
            kind = self.table.kind(self.units.span(o.d, o.r)[:o.tp])
            room = self.table.memory_terms(kind, self.I, self.J, "none", self.shards(o))[0]
            self._rooms[key] = np.broadcast_to(room, np.broadcast(self.I, self.J).shape)
        return self._rooms[key]

    def _tail(self, o: _Option) -> np.ndarray:
        """The stage's gradient sum over its replicas, optimizer step and cost per step (`tail_s`);
        spans of one type over as many hosts cost the same."""
        hosts = len({self.cluster.device(x).host for x in o.devices})
        key = (self.units.type_of[o.d], o.tp, o.replicas, hosts)
        if key not in self._tails:
            tail = self.table.tail_s(o.devices, self.I, self.J, self.shards(o), degree=o.tp)
            self._tails[key] = np.broadcast_to(tail, np.broadcast(self.I, self.J).shape)
        return self._tails[key]

    def _bandwidth(self, o: _Option) -> float:
        """A byte's speed across the cut after a stage on the option, to the devices a stage
        after it most likely takes: the next as many of the order (`StageTable.cut_per_byte_s`)."""
        if (o.d, o.r) not in self._bws:
            self._bws[(o.d, o.r)] = self._span_bandwidth(o)
        return self._bws[(o.d, o.r)]

    def _in_bandwidth(self, o: _Option) -> float:
        """A byte's speed into the option's replicas (each group's first device, which the rows
        are routed to) from the devices a stage before it most likely takes (the as many before
        them in the order); the speed out where it is the first."""
        before = self.units.span(0, o.d)[-len(self.units.span(o.d, o.r)):]
        per_byte = self.table.cut_per_byte_s(before, o.devices) if before else 0.0
        return 1.0 / per_byte if per_byte > 0 else self._bandwidth(o)

    def _span_bandwidth(self, o: _Option) -> float:
        e = o.d + o.r
        devs = self.units.span(o.d, o.r)
        nxt = self.units.span(e, self.U - e)[:len(devs)] if e < self.U else ()
        per_byte = self.table.cut_per_byte_s(devs, nxt) if nxt else 0.0
        return 1.0 / per_byte if per_byte > 0 else math.inf


def _received_s(tab: _Tables, share: float) -> np.ndarray:
    """(options, i, j): how long a micro-batch (`share` of the batch) keeps busy what a stage's
    groups receive through: a group's values arrive once per device of it (the stage before
    sends its activations to each, the stage after its gradients: `hetplan.cost.table.step_costs`),
    both ways in through the group's host, at the speed into the option's devices
    (`_in_bandwidth`). Where it is longer than the stage's compute it is the stage's period. 0 for
    a stage without groups."""
    cut = np.asarray(tab.prob.cut, dtype=float) * share
    both = cut[:, None] + cut[None, :]  # (i, j): the values in before the stage and back after it
    degree = np.array([o.tp if o.tp > 1 else 0 for o in tab.options], dtype=float)
    return degree[:, None, None] * both[None] / tab.bw_in[:, None, None]


def _terms(tab: _Tables, m: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(tau, held): per option and pair of states, a stage's forward and backward of one
    micro-batch on its slowest replica (inf where it cannot run: a split the stage cannot make,
    more replicas than rows, no room for its weights), and the most micro-batches it can hold in
    flight (memory: its per-batch figures times its share of a micro-batch each)."""
    rows = math.ceil(batch / m)
    frac = (np.ceil(rows / tab.opt_replicas) / batch)[:, None, None]  # the slowest replica's share
    k = tab.opt_key
    tau = np.maximum(tab.fixed[k] + tab.scaled[k] * frac, _received_s(tab, rows / batch))
    with np.errstate(divide="ignore", invalid="ignore"):
        held = np.where(tab.per_batch[k] > 0, (tab.room - tab.rebuilt[k] * frac) / (tab.per_batch[k] * frac), np.inf)
    ok = tab.valid[k] & (tab.opt_replicas <= rows)[:, None, None] & (held >= 1.0)
    return np.where(ok, tau, math.inf), held


@dataclass(frozen=True)
class _Live:
    """Per state j, what the program weighs into it (the rest costs nothing): the states i < j
    from which some option can run a stage to j, the options that can run one of those (with a
    micro-batch count and the in-flight count memory is sized for), their figures, and per unit
    the options of those that start there (padded with -1: none)."""

    below: tuple[np.ndarray, ...]  # per j: the states i
    options: tuple[np.ndarray, ...]  # per j: indices into `_Tables.options`
    tau: tuple[np.ndarray, ...]  # per j: (options, i)
    ar: tuple[np.ndarray, ...]
    at_d: tuple[np.ndarray, ...]  # per j: (units, most options of a unit), positions in options[j]

    @classmethod
    def of(cls, tab: _Tables, tau: np.ndarray) -> _Live:
        below, options, taus, ars, at_ds = [], [], [], [], []
        for j in range(tab.n):
            cand = tab.prob.below_arr[j]
            t = tau[:, cand, j]  # (options, i)
            finite = np.isfinite(t)
            keep_i = finite.any(axis=0)
            ob = np.flatnonzero(finite[:, keep_i].any(axis=1))
            below.append(cand[keep_i])
            options.append(ob)
            taus.append(t[ob][:, keep_i])
            ars.append(tab.ar[ob[:, None], cand[keep_i][None, :], j])
            at_ds.append(_by_unit(tab.opt_d[ob], tab.U))  # options come in the order of their units
        return cls(tuple(below), tuple(options), tuple(taus), tuple(ars), tuple(at_ds))


def _by_unit(d: np.ndarray, units: int) -> np.ndarray:
    """(units, most of one unit): the positions of the entries of `d` (sorted unit numbers) by
    unit, padded with -1."""
    counts = np.bincount(d, minlength=units)
    at = np.full((units, max(int(counts.max(initial=0)), 1)), -1)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    at[d, np.arange(len(d)) - first[d]] = np.arange(len(d))
    return at


def _program(tab: _Tables, m: int, batch: int, live: _Live, bound_p: np.ndarray,
             bound_ar: np.ndarray) -> tuple[np.ndarray, ...]:
    """For each pair of bounds (b: the slowest stage `bound_p[b]`, a stage's gradient sum
    `bound_ar[b]`), G[b, i, d]: the least sum of the stages after state i on units d.. and the
    choice that makes it: the state j after its first stage and that stage's option (-1: the rest
    of unit d's type left unused). The bounds are run together: one array pass per state."""
    n, U, B = tab.n, tab.U, len(bound_p)  # noqa: N806
    G = np.full((B, n, U + 1), math.inf)  # noqa: N806
    CJ = np.zeros((B, n, U + 1), dtype=int)  # noqa: N806
    CO = np.full((B, n, U + 1), -1, dtype=int)  # noqa: N806
    G[:, n - 1, :] = 0.0
    rows = math.ceil(batch / m)
    for j in range(n - 1, -1, -1):
        _leave_unused(tab, G, CJ, CO, j)
        below, opts = live.below[j], live.options[j]
        if not len(below):
            continue
        cut = tab.prob.cut[j] * rows / batch if j != n - 1 else 0.0
        t = live.tau[j]  # (options, i)
        ok = (t[None] <= bound_p[:, None, None]) & (live.ar[j][None] <= bound_ar[:, None, None])
        cand = np.where(ok, t[None] + (2 * cut / tab.bw[opts])[None, :, None] + G[:, j, tab.opt_e[opts]][:, :, None],
                        math.inf)
        cand = np.concatenate([cand, np.full((B, 1, len(below)), math.inf)], axis=1)[:, live.at_d[j]]
        arg = np.argmin(cand, axis=2)  # (B, units, i): the best option of each unit
        best = np.take_along_axis(cand, arg[:, :, None], axis=2)[:, :, 0]
        chosen = live.at_d[j][np.arange(U)[None, :, None], arg]
        pick = np.where(np.isfinite(best) & (chosen >= 0), opts[np.maximum(chosen, 0)], -1) if len(opts) else \
            np.full(best.shape, -1)
        old = G[:, below, :U]
        better = old > best.transpose(0, 2, 1)
        G[:, below, :U] = np.where(better, best.transpose(0, 2, 1), old)
        CJ[:, below, :U] = np.where(better, j, CJ[:, below, :U])
        CO[:, below, :U] = np.where(better, pick.transpose(0, 2, 1), CO[:, below, :U])
    return G, CJ, CO


def _leave_unused(tab: _Tables, G: np.ndarray, CJ: np.ndarray, CO: np.ndarray, j: int) -> None:  # noqa: N803
    """From state j on, a plan may leave the rest of a type's units unused and go on with the next type."""
    for start, end in tab.blocks:
        best = np.minimum(G[:, j, start:end], G[:, j, end][:, None])
        better = best < G[:, j, start:end]
        G[:, j, start:end] = best
        CJ[:, j, start:end][better] = j
        CO[:, j, start:end][better] = -1


def _stages(tab: _Tables, CJ: np.ndarray, CO: np.ndarray) -> list[tuple[int, int, _Option]]:  # noqa: N803
    """(i, j, option) of each stage of the program's plan from (state 0, unit 0), for one bound."""
    out, i, d = [], 0, 0
    while i != tab.n - 1:
        j, o = int(CJ[i, d]), int(CO[i, d])
        if o < 0:
            d = tab.units.block_end[d]
            continue
        out.append((i, j, tab.options[o]))
        i, d = j, d + tab.options[o].r
    return out


def _model_s(tab: _Tables, stages: list, tau: np.ndarray, m: int, batch: int) -> float:
    """The program's step of a plan (the module's T)."""
    rows = math.ceil(batch / m)
    taus = [float(tau[o.index, i, j]) for i, j, o in stages]
    cuts = [2 * tab.prob.cut[j] * rows / batch / tab.bw[o.index] if j != tab.n - 1 else 0.0 for i, j, o in stages]
    ar = max(float(tab.ar[o.index, i, j]) for i, j, o in stages)
    return sum(taus) + sum(cuts) + (m - 1) * max(taus) + ar


def _fits_as_planned(tab: _Tables, stages: list, m: int, batch: int, bounded: bool) -> bool:
    """Whether each stage of a plan fits with the micro-batches it really holds in flight."""
    rows = math.ceil(batch / m)
    for k, (i, j, o) in enumerate(stages):
        held = min(m, len(stages) - k) if bounded else m
        frac = math.ceil(rows / o.replicas) / batch
        need = tab.per_batch[o.key, i, j] * frac * held + tab.rebuilt[o.key, i, j] * frac
        if need > tab.room[o.index, i, j]:
            return False
    return True


def scale_candidates(scorer: Scorer, prob: StateSums, degrees: dict[str, tuple[int, ...]] | None = None) -> list[Plan]:
    """The program's best plans over every order of the types, number of micro-batches, bound and
    depth, best first by its model: those within WITHIN of the best, at most CANDIDATES, each
    with its model step in its meta (`model_s`)."""
    graph, options = scorer.graph, scorer.options
    batch = graph.batch_size
    table = prob.table
    speed = {t: 1.0 / max(float(table.whole_s(prob.kind_of_type(t), 0, table.last)), 1e-30) for t in prob.types}
    types = sorted(prob.types, key=lambda t: (-speed[t], t))
    bounded = get_schedule(options.schedule).bounded
    found: dict[tuple, tuple[float, Plan]] = {}
    for units in unit_orders(scorer.cluster, types, list(prob.types)):
        tab = _Tables(prob, scorer, units, degrees or {})
        total_speed = sum(len(x) * speed[prob.types[t]] for x, t in zip(units.devices, units.type_of, strict=True))
        for m in sorted(microbatch_choices(graph, options), key=lambda m: (abs(math.log2(m / FIRST_MICROBATCHES)), m)):
            tau, held = _terms(tab, m, batch)
            for h in _depths(held, tau, m, tab.U, bounded):
                fits = np.where(held >= h, tau, math.inf)
                if np.isfinite(fits).any():
                    _search_bounds(tab, m, batch, h, fits, total_speed, options, found, bounded)
    ranked = sorted(found.values(), key=lambda x: x[0])
    best = ranked[0][0] if ranked else math.inf
    return [replace(plan, meta={"model_s": round(float(t), 9)}) for t, plan in ranked[:CANDIDATES]
            if t <= best * (1 + WITHIN)]


def _depths(held: np.ndarray, tau: np.ndarray, m: int, units: int, bounded: bool) -> list[float]:
    """The micro-batches in flight the program sizes memory for: m under a schedule that holds
    all of them; under 1F1B at most min(m, units) (a pipeline of n stages holds at most n), and
    where that leaves a stage option unable to fit that fits with fewer, a half and a quarter of it."""
    if not bounded:
        return [float(m)]
    most = min(m, units)
    if (held[np.isfinite(tau)] >= most).all():
        return [float(most)]
    return [float(h) for h in sorted({most, max(1, most // 2), max(1, most // 4)}, reverse=True)]


def _search_bounds(tab: _Tables, m: int, batch: int, held: float, tau: np.ndarray, total_speed: float,
                   options: PlanOptions, found: dict, bounded: bool) -> None:
    """Run the program for the bounds on the slowest stage (from the lower bound: the micro-batch's
    work over every device) and on the gradient sum; keep each plan it finds with its model step.
    The first bound with a plan is found on a coarse ladder (P_COARSE apart), then P_STEPS finer
    ones above the last without (P_RATIO apart) are run, all of a ladder at once. A plan first
    found under a bound has a stage slower than the bound before, so its step is more than (m - 1)
    times that: bounds whose plans could not beat the best step found are not run."""
    low = math.ceil(batch / m) / batch / total_speed
    best = min((t for t, _ in found.values()), default=math.inf)
    live = _Live.of(tab, tau)
    for share in AR_SHARES:
        coarse = low * P_COARSE ** np.arange(1, P_MAX_STEPS + 1)
        coarse = coarse[(m - 1) * coarse / P_COARSE < best]
        if not len(coarse):
            continue
        G = _program(tab, m, batch, live, coarse, share * m * coarse)[0]  # noqa: N806
        hit = np.flatnonzero(np.isfinite(G[:, 0, 0]))
        if not len(hit):
            continue
        start = coarse[hit[0]] / P_COARSE
        fine = start * P_RATIO ** np.arange(1, P_STEPS + 1)
        fine = fine[(m - 1) * fine / P_RATIO < best]
        if not len(fine):
            continue
        G, CJ, CO = _program(tab, m, batch, live, fine, share * m * fine)  # noqa: N806
        for b in np.flatnonzero(np.isfinite(G[:, 0, 0])):
            t = _keep(tab, CJ[b], CO[b], m, batch, held, tau, options, found, bounded)
            best = min(best, t)


def _keep(tab: _Tables, CJ: np.ndarray, CO: np.ndarray, m: int, batch: int, held: float, tau: np.ndarray,  # noqa: N803
          options: PlanOptions, found: dict, bounded: bool) -> float:
    """The program's plan of one bound, kept in `found` with its model step (returned; inf when
    it is not kept: memory sized for fewer in flight than it holds, or too many replicas)."""
    stages = _stages(tab, CJ, CO)
    if len(stages) > held and not _fits_as_planned(tab, stages, m, batch, bounded):
        return math.inf  # sized for `held` in flight, it holds more: a run with more held covers it
    plan = Plan(tuple(Stage(tab.prob.nodes(i, j), o.devices, o.recompute,
                            shard=tab.sharding(o) and bool(tab.table.dense(i, j)),
                            tp=o.tp, tp_devices=_groups(tab, o) if o.tp > 1 else (),
                            sequence_parallel=options.sp and o.tp > 1)
                      for i, j, o in stages), m, options.schedule, "dp", options.objective)
    if not options.allows(plan):
        return math.inf
    t = _model_s(tab, stages, tau, m, batch)
    key = Scorer.key(plan)
    if key not in found or t < found[key][0]:
        found[key] = (t, plan)
    return t


def _groups(tab: _Tables, o: _Option) -> tuple[tuple[str, ...], ...]:
    devs = tab.units.span(o.d, o.r)
    return tuple(devs[x:x + o.tp] for x in range(0, len(devs), o.tp))
