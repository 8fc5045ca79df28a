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
consecutive units of one type as data-parallel replicas. The types come in an order (every
order of up to 3 types); a plan uses a prefix of each type's units and leaves the rest unused.

For each number of micro-batches m (micro-batches of b = ceil(B / m) rows, every b from one row
to the batch by powers of two), each bound P on the slowest stage and each bound A on a stage's
gradient sum, a backward program over (cut state, unit position, stages after) finds the
least

    sum_k (tau_k + 2 c_k)        subject to  tau_k <= P,  AR_k <= A,  memory fits

with tau_k a stage's forward and backward of one micro-batch (its fixed part plus its share of
rows, ceil(b / replicas), as the runtime splits them: a stage never has more replicas than a
micro-batch has rows), c_k the transfer of the cut after it (`CostModel.routed_cut_s` between
its devices and the next ones), AR_k its gradient sum and optimizer step (`CostModel.
gradient_sync_s`, `CostModel.optimizer_step_s`) and memory under the schedule (1F1B: a stage
with s stages after it holds min(m, s + 1) micro-batches). The model's step of such a plan is

    T = sum_k (tau_k + 2 c_k) + (m - 1) max_k tau_k + max_k AR_k,

by which the candidates are ranked; dp scores the best of them with the event simulator
(`hetplan.planners.dp.dp`), so this program's simplifications (a cut's bandwidth taken with the
next devices of the order, no latency, no round-trip bound) cost candidates, never a promise.
The work is O(orders x m x P x A x states^2 x units x widths x depth) in numpy, independent of
the number of devices once types have `MAX_UNITS` units.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import after_stage
from hetplan.cost.formulas import action_s, stage_memory_bytes_array
from hetplan.plan import Plan, Stage
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import StateSums
from hetplan.schedule import get_schedule

MAX_UNITS = 16  # units per device type: past it, a unit is several hosts
MAX_DEPTH = 8  # stages in a pipeline
P_STEPS = 10  # bounds on the slowest stage tried from the first that has a plan, each P_RATIO above the last
P_RATIO = 1.15
P_COARSE = 1.5  # the first bound with a plan is looked for in these steps from the lower bound,
P_MAX_STEPS = 24  # at most this many (1.5^24 is 17,000 times it: memory can leave few devices usable)
AR_SHARES = (math.inf, 0.1)  # bounds on a stage's gradient sum: none, or this share of the pipeline's time
CANDIDATES = 12  # plans returned, best first by the model
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


class _Tables:
    """What the program needs per cut state j and (unit position d, width r), for one order."""

    def __init__(self, prob: StateSums, scorer: Scorer, units: Units) -> None:
        self.prob, self.units, self.cost = prob, units, scorer.cost
        self.shard = scorer.options.shard != "never"  # replicated stages shard their optimizer state
        self.U = len(units.devices)
        self.R = max(e - d for d, e in enumerate(units.block_end))
        self.n = len(prob.ideals)
        self.blocks = sorted({(units.block_end.index(e), e) for e in units.block_end})  # each type's units
        types = prob.types
        mem = {t: min(scorer.cluster.device(x).mem_bytes for x in scorer.cluster.ids
                      if scorer.cluster.device(x).type == t) for t in types}
        # per (d, r): valid, type, replicas, memory, cut bandwidth
        shape = (self.U, self.R)
        self.valid = np.zeros(shape, dtype=bool)
        self.ti = np.zeros(shape, dtype=int)
        self.reps = np.ones(shape)
        self.mem = np.zeros(shape)
        self.bw = np.full(shape, math.inf)
        self.spans: dict[tuple[int, int], tuple[str, ...]] = {}
        for d in range(self.U):
            for r in range(1, units.block_end[d] - d + 1):
                devs = units.span(d, r)
                self.spans[(d, r)] = devs
                k = (d, r - 1)
                self.valid[k], self.ti[k], self.reps[k] = True, units.type_of[d], len(devs)
                self.mem[k] = mem[types[units.type_of[d]]]
                nxt = self._next_devices(d + r, len(devs))
                per_byte = self.cost.routed_cut_s(devs, nxt) if nxt else 0.0
                self.bw[k] = 1.0 / per_byte if per_byte > 0 else math.inf
        # per state pair: whole-batch time and fixed part per type, params, activations
        self.W = np.stack([prob.time[t][None, :] - prob.time[t][:, None] for t in types])  # (types, i, j)
        self.F = np.stack([prob.fixed[t][None, :] - prob.fixed[t][:, None] for t in types])
        self.params = prob.params[None, :] - prob.params[:, None]
        self.acts = prob.acts[None, :] - prob.acts[:, None]
        self.casts = prob.casts[None, :] - prob.casts[:, None]
        # (i, j) whose gradients are dense: their replicas can shard the optimizer's state
        self.dense = (prob.updated[None, :] - prob.updated[:, None]) >= self.params - 0.5
        self.ar = self._gradient_sums(scorer)

    def _next_devices(self, e: int, k: int) -> tuple[str, ...]:
        """The devices a stage ending before unit e most likely sends to: the next k of the order."""
        out = self.units.span(e, self.U - e) if e < self.U else ()
        return out[:k]

    def _gradient_sums(self, scorer: Scorer) -> np.ndarray:
        """(d, r, i, j): the gradient sum and optimizer step of stage i -> j on units d .. d+r-1."""
        prob = self.prob
        upd = np.maximum(prob.updated[None, :] - prob.updated[:, None], 0.0)
        idx = np.maximum(prob.indices[None, :] - prob.indices[:, None], 0.0)
        opt = {t: o[None, :] - o[:, None] for t, o in prob.opt.items()}
        out = np.full((self.U, self.R, self.n, self.n), math.inf)
        for (d, r), devs in self.spans.items():
            per_step = max(scorer.cluster.device(x).step_overhead_s for x in devs)
            after = after_stage(self.cost, devs, per_step)
            sync = self.cost.gradient_sync_s(upd, idx, devs)
            shards = self.shards(len(devs), self.dense)
            out[d, r - 1] = after(sync, (upd / shards, {t: o / shards for t, o in opt.items()}, idx))
        return out

    def shards(self, replicas, dense: np.ndarray) -> np.ndarray | float:
        """Over how many replicas stages shard their optimizer state (`refine.shardable`): all
        `replicas` where they are `dense`, else 1 (arrays broadcast)."""
        if not self.shard:
            return 1.0
        return np.where(dense, np.asarray(replicas, dtype=float), 1.0)


def _stage_terms(tab: _Tables, j: int, below: np.ndarray, m: int, batch: int, held: np.ndarray):
    """For stages below -> j on every (d, r): tau (d, r, i), and whether it fits with a stages
    after it (d, r, i, a)."""
    rows = math.ceil(batch / m)
    frac = np.ceil(rows / tab.reps) / batch  # the slowest replica's share of the batch per micro-batch
    W = tab.W[:, below, j][tab.ti]  # (d, r, i)
    F = tab.F[:, below, j][tab.ti]
    tau = action_s(F, W - F, frac[..., None])  # a pass's fixed part, then its rows' share
    ok = tab.valid & (tab.reps <= rows)
    shards = tab.shards(tab.reps[..., None], tab.dense[below, j][None, None, :])  # (d, r, i)
    need = stage_memory_bytes_array(tab.params[below, j][None, None, :, None], tab.acts[below, j][None, None, :, None],
                                    frac[..., None, None] * held[None, None, None, :],
                                    tab.casts[below, j][None, None, :, None],
                                    np.asarray(shards)[..., None])
    fits = need <= tab.mem[..., None, None]
    return np.where(ok[..., None], tau, math.inf), fits


def _program(tab: _Tables, m: int, batch: int, bound_p: float, bound_ar: float, held: np.ndarray,
             terms: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """G[i, d, a]: the least sum of the nodes after state i on units d.. in a stages, and the choice
    that makes it: the state j after its first stage and that stage's width r (r = 0: the rest of
    unit d's type left unused)."""
    n, U, A = tab.n, tab.U, len(held)
    G = np.full((n, U + 1, A + 1), math.inf)
    CJ = np.zeros((n, U + 1, A + 1), dtype=int)
    CR = np.zeros((n, U + 1, A + 1), dtype=int)
    G[n - 1, :, 0] = 0.0
    rows = math.ceil(batch / m)
    for j in range(n - 1, -1, -1):
        _leave_unused(tab, G, CJ, CR, j)
        below, tau, fits = terms[j]
        if not len(below):
            continue
        cut = tab.prob.cut[j] * rows / batch if j != n - 1 else 0.0
        comm = 2 * cut / tab.bw  # (d, r)
        ok = (tau <= bound_p) & (tab.ar[:, :, below, j] <= bound_ar)  # (d, r, i)
        nxt = np.full((U, tab.R, A), math.inf)  # G[j, d + r, a - 1]
        for r in range(1, tab.R + 1):
            nxt[:U - r + 1, r - 1] = G[j, r:U + 1, :A]
        cand = np.where(ok[..., None] & fits, tau[..., None] + comm[..., None, None] + nxt[:, :, None, :], math.inf)
        best_r = np.argmin(cand, axis=1)  # (d, i, a)
        best = np.take_along_axis(cand, best_r[:, None], axis=1)[:, 0].transpose(1, 0, 2)  # (i, d, a)
        old = G[below, :U, 1:]
        better = best < old
        G[below, :U, 1:] = np.where(better, best, old)
        CJ[below, :U, 1:] = np.where(better, j, CJ[below, :U, 1:])
        CR[below, :U, 1:] = np.where(better, best_r.transpose(1, 0, 2) + 1, CR[below, :U, 1:])
    return G, CJ, CR


def _leave_unused(tab: _Tables, G: np.ndarray, CJ: np.ndarray, CR: np.ndarray, j: int) -> None:
    """From state j on, a plan may leave the rest of a type's units unused and go on with the next type."""
    for start, end in reversed(tab.blocks):
        best = np.minimum(G[j, start:end], G[j, end])
        better = best < G[j, start:end]
        G[j, start:end] = best
        CJ[j, start:end][better] = j
        CR[j, start:end][better] = 0


def _stages(tab: _Tables, CJ: np.ndarray, CR: np.ndarray, a: int) -> list[tuple[int, int, int, int]]:
    """(i, j, d, r) of each stage of the plan with a stages from (state 0, unit 0)."""
    out, i, d = [], 0, 0
    while a > 0:
        j, r = int(CJ[i, d, a]), int(CR[i, d, a])
        if r == 0:
            d = tab.units.block_end[d]
            continue
        out.append((i, j, d, r))
        i, d, a = j, d + r, a - 1
    return out


def _model_s(tab: _Tables, stages: list, m: int, batch: int) -> float:
    """The program's step of a plan (the module's T)."""
    rows = math.ceil(batch / m)
    taus, total, ar = [], 0.0, 0.0
    for i, j, d, r in stages:
        frac = math.ceil(rows / tab.reps[d, r - 1]) / batch
        t = tab.ti[d, r - 1]
        tau = action_s(tab.F[t, i, j], tab.W[t, i, j] - tab.F[t, i, j], frac)
        cut = tab.prob.cut[j] * rows / batch if j != tab.n - 1 else 0.0
        taus.append(tau)
        total += tau + 2 * cut / tab.bw[d, r - 1]
        ar = max(ar, tab.ar[d, r - 1, i, j])
    return total + (m - 1) * max(taus) + ar


def scale_candidates(scorer: Scorer, prob: StateSums) -> list[Plan]:
    """The program's best plans (at most CANDIDATES, best first by its model) over every order of
    the types, number of micro-batches and bound."""
    graph, options = scorer.graph, scorer.options
    batch = graph.batch_size
    speed = {t: 1.0 / max(float(prob.time[t][-1]), 1e-30) for t in prob.types}
    types = sorted(prob.types, key=lambda t: (-speed[t], t))
    bounded = get_schedule(options.schedule).bounded
    depth = min(MAX_DEPTH, len(graph.nodes))
    found: dict[tuple, tuple[float, Plan]] = {}
    for units in unit_orders(scorer.cluster, types, list(prob.types)):
        tab = _Tables(prob, scorer, units)
        total_speed = sum(len(x) * speed[prob.types[t]] for x, t in zip(units.devices, units.type_of, strict=True))
        for m in sorted(microbatch_choices(graph, options), key=lambda m: (abs(math.log2(m / FIRST_MICROBATCHES)), m)):
            held = np.array([min(m, a + 1) if bounded else m for a in range(depth)], dtype=float)
            terms = [(prob.below_arr[j], *_stage_terms(tab, j, prob.below_arr[j], m, batch, held))
                     if len(prob.below_arr[j]) else (prob.below_arr[j], None, None) for j in range(tab.n)]
            _search_bounds(tab, m, batch, held, terms, total_speed, options, found)
    ranked = sorted(found.values(), key=lambda x: x[0])
    return [plan for _, plan in ranked[:CANDIDATES]]


def _search_bounds(tab: _Tables, m: int, batch: int, held: np.ndarray, terms: list, total_speed: float,
                   options: PlanOptions, found: dict) -> None:
    """Run the program for the bounds on the slowest stage (from the lower bound: the micro-batch's
    work over every device) and on the gradient sum; keep each plan it finds with its model step.
    A plan first found under a bound has a stage slower than the bound before, so its step is more
    than (m - 1) times that: once that passes the best step found, larger bounds are not tried."""
    low = math.ceil(batch / m) / batch / total_speed
    best = min((t for t, _ in found.values()), default=math.inf)
    for share in AR_SHARES:
        start = _first_bound(tab, m, batch, held, terms, low, share, best)
        for step in range(P_STEPS if start is not None else 0):
            if (m - 1) * start * P_RATIO ** step >= best:
                break
            bound_p = start * P_RATIO ** (step + 1)
            G, CJ, CR = _program(tab, m, batch, bound_p, share * m * bound_p, held, terms)
            for a in range(1, len(held) + 1):
                if not math.isfinite(G[0, 0, a]):
                    continue
                stages = _stages(tab, CJ, CR, a)
                plan = Plan(tuple(Stage(tab.prob.nodes(i, j), tab.spans[(d, r)],
                                        shard=tab.shard and len(tab.spans[(d, r)]) > 1 and bool(tab.dense[i, j]))
                                  for i, j, d, r in stages), m, options.schedule, "dp", options.objective)
                if not options.allows(plan):
                    continue
                key = Scorer.key(plan)
                t = _model_s(tab, stages, m, batch)
                best = min(best, t)
                if key not in found or t < found[key][0]:
                    found[key] = (t, plan)


def _first_bound(tab: _Tables, m: int, batch: int, held: np.ndarray, terms: list, low: float, share: float,
                 best: float) -> float | None:
    """The last bound without a plan before the first with one, in P_COARSE steps from `low`; None
    when there is none or it cannot beat `best`."""
    bound = low
    for _ in range(P_MAX_STEPS):
        if (m - 1) * bound >= best:
            return None
        G = _program(tab, m, batch, bound * P_COARSE, share * m * bound * P_COARSE, held, terms)[0]
        if np.isfinite(G[0, 0, 1:]).any():
            return bound
        bound *= P_COARSE
    return None
