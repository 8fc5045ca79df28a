"""The label program of `hetplan.planners.dp`: Pareto fronts of labels per (cut state, position
in a device order), built from the end of the pipeline backwards. The recurrence, its model of a
step and its assumptions are in `hetplan.planners.dp`'s docstring (after PipeDream's optimizer,
Narayanan et al., SOSP 2019, and Ju et al.'s antichain dynamic program); this module is the
kernel, dp.py the driver (device orders, bounds, pool, re-ranking)."""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import numpy as np

from hetplan.cost import after_stage
from hetplan.cost.formulas import (
    activation_room_bytes,
    stage_memory_bytes,
    steady_cut_s,
    steady_stage_s,
    usd_per_step,
)
from hetplan.plan import Plan, Stage
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import StateSums
from hetplan.schedule import get_schedule

MAX_LABELS = 6
EPSILON = 0.002  # labels closer than this in sum, max and all-reduce are merged
SMALL_CLUSTER = 8  # up to this many devices a stage may take any number of them as replicas
BIG_CLUSTER_REPLICAS = 4  # on bigger clusters, at most this many
USUAL_MICROBATCHES = 32  # see `usual_microbatches`


class Label(NamedTuple):
    """A way to run the nodes after a state on the devices after a position of the order."""

    sum_s: float  # sum over its stages of t_k + 2 c_k
    max_s: float  # P: the slowest stage, link or (1F1B) round trip
    ar_s: float  # the largest all-reduce + optimizer step of a stage
    after: int  # stages in it (1F1B's in-flight bound for the stage before)
    m_req: int  # the fewest micro-batches memory allows
    usd_per_hour: float  # of every device from its first one to the end of the order
    k_first: int  # replicas of its first stage
    lat_s: float  # latencies along its cuts
    stage: tuple[int, int, int, int, bool] | None  # its first stage: (state i, state j, position d, replicas k,
    # whether it recomputes)
    parent: Label | None
    rank: float  # the step at the most micro-batches it can use (times the price for cost): which a full front drops
    k_max: int = 1  # its largest replica group: micro-batches need at least that many rows
    thr_s: float = 0.0  # objective throughput: its slowest stage or cut in PipeDream's steady state
    c_first: float = 0.0  # the transfer time of the cut after its first stage
    fix_sum_s: float = 0.0  # sum over its stages of what a micro-batch pays whatever its rows
    fix_max_s: float = 0.0  # the largest of those


def rows_for_replicas(batch_size: int, m: int, k_max: int, choices: tuple[int, ...]) -> bool:
    """Whether every micro-batch has a row for each of k_max replicas. The runtime (and the
    simulator) split micro-batches in whole rows (`hetplan.rows`): with fewer rows than replicas
    some replica idles in every micro-batch, which the program's model (replicas share each
    micro-batch's time) does not see; such m are left out unless no allowed m has the rows."""
    return batch_size // m >= k_max or not any(batch_size // c >= k_max for c in choices)


def usual_microbatches(choices: tuple[int, ...]) -> tuple[int, ...]:
    """The micro-batch counts the program tries for every label: up to USUAL_MICROBATCHES (its
    model has no fixed part per micro-batch, so it would always prefer the most); more only where
    memory needs them (`useful_microbatches`)."""
    return tuple(m for m in choices if m <= USUAL_MICROBATCHES) or choices[:1]


def useful_microbatches(lab: Label, choices: tuple[int, ...], batch_size: int, many: bool) -> list[int]:
    """The counts a label is tried with: the usual ones that memory and the rows allow or, in the
    pass for labels that memory gives more (`many`), the two fewest that it allows."""
    fit = [m for m in choices if m >= lab.m_req and rows_for_replicas(batch_size, m, lab.k_max, choices)]
    return fit[:2] if many else [m for m in fit if m <= USUAL_MICROBATCHES]


def model_step_s(lab: Label, m: int) -> float:
    """T(m) of the module's docstring: the program's step time of a label with m micro-batches,
    with what every micro-batch pays whatever its rows (the profile's fixed parts)."""
    return (lab.sum_s + (m - 1) * lab.max_s) / m + lab.fix_sum_s + (m - 1) * lab.fix_max_s + 2 * lab.lat_s + lab.ar_s


class _Order:
    """What the program needs about one device order: device types, replica groups (type counts,
    smallest memory per type, all-reduce ring, optimizer and per-step costs), links, prices and
    the least time the work of each state can take on the first d devices."""

    def __init__(self, prob: StateSums, scorer: Scorer, order: tuple[str, ...], options: PlanOptions) -> None:
        cluster = scorer.cluster
        self.order, self.D = order, len(order)
        self.dev = [cluster.device(x) for x in order]
        tindex = {t: k for k, t in enumerate(prob.types)}
        self.dtype = [tindex[d.type] for d in self.dev]
        self.times = np.array([prob.time[t] for t in prob.types])  # (types, states)
        self.fixed = np.array([prob.fixed[t] for t in prob.types])
        # recomputation (`Stage.recompute`): what it adds to a stage, and whether stages may or must
        self.fwd = np.array([prob.fwd[t] for t in prob.types])
        self.fwd_fixed = np.array([prob.fwd_fixed[t] for t in prob.types])
        self.recompute = {"never": (False,), "where-needed": (False, True), "always": (True,)}[options.recompute]
        self.shard = options.shard != "never"  # stages of several replicas shard their optimizer state
        self.bounded = get_schedule(options.schedule).bounded  # in flight bounded by the stages after
        # a full front drops the label whose step is worst at the most micro-batches it can use:
        # the most whose micro-batches have a row for each replica of its widest stage
        choices = usual_microbatches(microbatch_choices(scorer.graph, options))
        self.rank_m = [max([m for m in choices if rows_for_replicas(scorer.graph.batch_size, m, k, choices)],
                           default=max(choices)) for k in range(self.D + 1)]
        # the user's --max-replicas raises the cap of big clusters too (slower: more widths to try)
        self.max_replicas = min(options.max_replicas or (self.D if self.D <= SMALL_CLUSTER else BIG_CLUSTER_REPLICAS),
                                self.D)
        # the stages after a stage matter only through 1F1B's memory; skip them when all fits anyway
        fits_anywhere = stage_memory_bytes(prob.params[-1], prob.acts[-1], 1.0, prob.casts[-1]) <= min(
            d.mem_bytes for d in self.dev)
        self.track_r = self.bounded and not fits_anywhere
        self.track_price = options.objective == "cost"
        self.track_thr = options.objective == "throughput"
        self.cost = scorer.cost
        self.usd_prefix = [0.0]
        for d in self.dev:
            self.usd_prefix.append(self.usd_prefix[-1] + d.usd_per_hour)
        self.groups = {(d, k): self._group(prob, scorer, d, k) for d in range(self.D) for k in range(1, self.D - d + 1)}
        self.links = [cluster.link(order[p], order[p + 1]) if p + 1 < self.D else None for p in range(self.D)]
        self.rest = self._rest(len(prob.types))
        self._ending: tuple = (-1, None)
        self._rebuilt: tuple = (-1, None)
        self._cut_Bps: dict[tuple[int, int, int], float] = {}
        self._cut_s: dict[tuple[int, int, int], float] = {}
        # replicas' shares of a micro-batch, by their type's speed on the whole model
        self.weight = [1.0 / max(float(prob.time[d.type][-1]), 1e-30) for d in self.dev]

    def cut_Bps(self, d: int, e: int, k_next: int) -> float:
        """The cut's bandwidth (`CostModel.cut_Bps`) from the devices d .. e-1 of the order to
        the k_next after them."""
        key = (d, e, k_next)
        if key not in self._cut_Bps:
            self._cut_Bps[key] = self.cost.cut_Bps(self.order[d:e], self.order[e:e + k_next])
        return self._cut_Bps[key]

    def cut_s_per_byte(self, d: int, e: int, k_next: int) -> float:
        """Seconds per byte of the cut from the devices d .. e-1 of the order to the k_next after
        them, routed as the runtime routes rows (`CostModel.routed_cut_s`)."""
        key = (d, e, k_next)
        if key not in self._cut_s:
            self._cut_s[key] = self.cost.routed_cut_s(self.order[d:e], self.order[e:e + k_next],
                                                      self.weight[d:e], self.weight[e:e + k_next])
        return self._cut_s[key]

    def ending_at(self, prob: StateSums, j: int) -> tuple[np.ndarray, ...]:
        """For stages S_j - S_i over every earlier state i: the i, the stage's time per device
        type (types, candidates), its parameter bytes, its activation bytes and what its optimizer
        step and its replicas' gradient sum need (the bytes it updates, its measured time per
        device type where the profiler measured it, the bytes of its sparse rows' indices) (kept
        for the last j)."""
        if self._ending[0] != j:
            below = prob.below_arr[j]
            opt = (prob.updated[j] - prob.updated[below], {t: o[j] - o[below] for t, o in prob.opt.items()},
                   prob.indices[j] - prob.indices[below])
            self._ending = (j, (below, self.times[:, j][:, None] - self.times[:, below],
                                (prob.params[j] - prob.params[below], prob.casts[j] - prob.casts[below]),
                                prob.acts[j] - prob.acts[below], opt))
        return self._ending[1]

    def rebuilt_at(self, prob: StateSums, j: int) -> tuple[np.ndarray, ...]:
        """For the same stages, what recomputing adds: the forward's time and its fixed part per
        device type (types, candidates), and the bytes it keeps instead of its activations (the
        cut before it and the cut after it, `CostModel.kept_bytes`) (kept for the last j)."""
        if self._rebuilt[0] != j:
            below = prob.below_arr[j]
            kept = np.where(below > 0, prob.cut[below], 0.0) + (prob.cut[j] if j != len(prob.ideals) - 1 else 0.0)
            self._rebuilt = (j, (self.fwd[:, j][:, None] - self.fwd[:, below],
                                 self.fwd_fixed[:, j][:, None] - self.fwd_fixed[:, below], kept))
        return self._rebuilt[1]

    def _group(self, prob: StateSums, scorer: Scorer, d: int, k: int) -> tuple:
        cnt = [0] * len(prob.types)
        mem: dict[int, float] = {}
        for x in range(d, d + k):
            cnt[self.dtype[x]] += 1
            mem[self.dtype[x]] = min(mem.get(self.dtype[x], math.inf), self.dev[x].mem_bytes)
        devices = tuple(self.order[d:d + k])
        per_step = max(self.dev[x].step_overhead_s for x in range(d, d + k))
        return cnt, mem, after_stage(scorer.cost, devices, per_step), devices

    def _rest(self, types: int) -> np.ndarray:
        """rest[i, d]: the least time the nodes of state i can take on devices 0 .. d-1 together."""
        speed_prefix = np.zeros((self.D + 1, types))
        for x in range(self.D):
            speed_prefix[x + 1] = speed_prefix[x]
            speed_prefix[x + 1][self.dtype[x]] += 1
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(self.times > 0, 1.0 / self.times, 0.0)  # (types, states)
            total_speed = speed_prefix @ inv  # (D + 1, states)
            return np.where(total_speed > 0, 1.0 / total_speed, 0.0).T


class _Front:
    """Pareto fronts of labels per (state, position), at most `max_labels` each."""

    def __init__(self, setup: _Order, max_labels: int) -> None:
        self.labels: dict[tuple[int, int], list[Label]] = {}
        self.track_r, self.track_price, self.max_labels = setup.track_r, setup.track_price, max_labels
        self.track_thr = setup.track_thr

    def _covers(self, o: Label, lab: Label, slack: float) -> bool:
        """o is at least as good as lab in every tracked dimension (times within `slack`)."""
        return (o.sum_s <= lab.sum_s * slack and o.max_s <= lab.max_s * slack and o.ar_s <= lab.ar_s * slack
                and o.m_req <= lab.m_req and o.k_max <= lab.k_max and (not self.track_r or o.after <= lab.after)
                and (not self.track_price or o.usd_per_hour <= lab.usd_per_hour)
                and (not self.track_thr or o.thr_s <= lab.thr_s * slack))

    def add(self, key: tuple[int, int], lab: Label) -> None:
        labels = self.labels.setdefault(key, [])
        # epsilon-dominance: a label within EPSILON of another in time is as good as it
        if any(self._covers(o, lab, 1 + EPSILON) for o in labels):
            return
        labels[:] = [o for o in labels if not self._covers(lab, o, 1.0)]
        labels.append(lab)
        if len(labels) > self.max_labels:  # keep the most promising: drop the worst by its rank,
            # but keep the best of each first-stage width (the model can misjudge one width for
            # all its labels: resnet50 on 4 V100 at 1 GB/s, bench/dp_no_miss.py)
            widths = Counter(o.k_first for o in labels)
            shared = [o for o in labels if widths[o.k_first] > 1] or labels
            labels.remove(max(shared, key=lambda o: o.rank))


def _stage_options(prob: StateSums, setup: _Order, j: int, d: int, k: int, bound_s: float,
                   recompute: bool = False) -> tuple:
    """For the stage S_j - S_i on devices d .. d+k-1, over every earlier state i at once: which
    i are allowed (time bound, memory, devices left), the stage's time, its memory need over
    what is free (the worst replica type), its all-reduce + optimizer step, and (objective
    throughput) its steady-state time per batch, and what each micro-batch costs it whatever its
    rows (its slowest replica type's fixed parts). A stage that recomputes runs its forward again
    and keeps its cuts' bytes instead of its activations, of which it holds one micro-batch's:
    its memory need is then the kept bytes' ratio plus, last, the activations' ratio."""
    below, diff, w_stage, a_stage, opt_needs = setup.ending_at(prob, j)
    cnt, mem, after_stage, devices = setup.groups[(d, k)]
    used = [ti for ti, c in enumerate(cnt) if c]
    shards = _shards(setup, k, opt_needs[0], w_stage[0])
    if recompute:
        fwd, fwd_fixed, kept = setup.rebuilt_at(prob, j)
        diff, held = diff + fwd, kept
    else:
        held = a_stage
    with np.errstate(divide="ignore", invalid="ignore"):
        speed = sum(cnt[ti] / diff[ti] for ti in used)  # inf where a type needs no time
        t = np.where(np.isfinite(speed) & (speed > 0), 1.0 / speed, 0.0)
        # memory of each replica type: its share of every micro-batch's activations
        ratio = np.zeros(len(below))  # needed / free, the worst replica type
        rebuilt = np.zeros(len(below))  # recomputing: one micro-batch's activations over what is free
        fits = np.ones(len(below), dtype=bool)
        for ti in used:
            share = np.where(np.isfinite(speed) & (diff[ti] > 0), t / diff[ti], 1.0 / k)
            room = activation_room_bytes(mem[ti], *w_stage, shards)
            fits &= room > 0
            ratio = np.maximum(ratio, np.where(room > 0, held * share / np.maximum(room, 1.0), np.inf))
            if recompute:
                rebuilt = np.maximum(rebuilt, np.where(room > 0, a_stage * share / np.maximum(room, 1.0), np.inf))
    ok = (t <= bound_s) & fits & ((ratio <= 1.0) | setup.bounded)
    ok &= (below == 0) if d == 0 else (below != 0)  # with d == 0 no devices are left for nodes before
    ok &= setup.rest[below, d] <= bound_s  # the slowest stage before takes at least that
    sync = setup.cost.gradient_sync_s(opt_needs[0], opt_needs[2], devices)  # bytes updated, index bytes
    ar = after_stage(sync, (opt_needs[0] / shards, {t: o / shards for t, o in opt_needs[1].items()}, opt_needs[2]))
    steady = steady_stage_s(t, setup.cost.steady_sync_s(opt_needs[0], devices), k) if setup.track_thr else t
    fixed = np.max([setup.fixed[ti, j] - setup.fixed[ti, below] + (fwd_fixed[ti] if recompute else 0.0)
                    for ti in used], axis=0)
    return np.nonzero(ok)[0], below, t, ratio, ar, steady, fixed, rebuilt


def _shards(setup: _Order, k: int, updated: np.ndarray, params: np.ndarray) -> np.ndarray | int:
    """Over how many replicas each candidate stage shards its optimizer state: all k where
    sharding is on and its gradients are dense (`refine.shardable`), else 1."""
    if not setup.shard or k < 2:
        return 1
    return np.where(updated < params - 0.5, 1, k)  # fewer bytes updated than held: a sparse table


def _extend(lab: Label, stage: tuple[int, int, int, int, bool], ts: float, memory: tuple[float, float], ar: float,
            c_s: float, lt: float, r_i: float, setup: _Order, m_max: int, bounds: tuple[float, float, float],
            steady_s: float = 0.0, fixed_s: float = 0.0) -> Label | None:
    """The label of `lab` with one more stage in front (time ts, memory ratios (what it holds per
    batch, what it rebuilds of one micro-batch when it recomputes; `_stage_options`), all-reduce
    ar, transfer c_s and latency lt across its cut; its steady-state time, or its cut's if
    slower, steady_s), or None when memory or the bounds cut it."""
    bound_s, bound_usd, bound_thr = bounds
    thr = max(lab.thr_s, steady_s)
    if thr > bound_thr:
        return None
    mr, (rt, rebuilt) = lab.m_req, memory
    if stage[4]:
        mr = max(mr, _recompute_microbatches(lab.after, rt, rebuilt, setup.bounded))
        if mr > m_max:
            return None
    elif rt > 1.0:  # 1F1B: this stage holds min(m, r + 1) micro-batches; m must exceed r + 1
        mr = max(mr, math.floor((lab.after + 1) * rt) + 1)
        if mr > m_max:
            return None
    s2 = lab.sum_s + ts + 2 * c_s
    # a device sends and receives through one interface each: the first stage of `lab` receives
    # the activations of this cut and the gradients of its next one, one after the other
    mx2 = max(lab.max_s, ts, c_s + lab.c_first)
    if setup.bounded:
        # 1F1B lets this stage have r + 1 micro-batches in flight, so one round trip through the
        # rest of the pipeline is shared by at most r + 1 of them
        mx2 = max(mx2, s2 / (lab.after + 1))
    # a lower bound on the whole step: the stages still to come take at least r_i in all and the
    # slowest of them at least r_i too (their devices are disjoint, so max(w_k / speed_k) >=
    # sum(w_k) / sum(speed_k)); the best m is the largest
    low = (s2 + r_i + (m_max - 1) * max(mx2, r_i)) / m_max
    if low > bound_s or (setup.track_price and usd_per_step(lab.usd_per_hour, low) > bound_usd):
        return None
    out = Label(s2, mx2, max(lab.ar_s, ar), lab.after + 1, mr, lab.usd_per_hour, stage[3], lab.lat_s + lt, stage,
                lab, 0.0, max(lab.k_max, stage[3]), thr, c_s, lab.fix_sum_s + fixed_s, max(lab.fix_max_s, fixed_s))
    m = min(m_max, max(mr, setup.rank_m[out.k_max]))
    rank = thr if setup.track_thr else model_step_s(out, m) * (out.usd_per_hour if setup.track_price else 1.0)
    return out._replace(rank=rank)


def _recompute_microbatches(after: int, rt: float, rebuilt: float, bounded: bool) -> float:
    """The fewest micro-batches m with which a recomputing stage fits: rt of its room per batch
    kept for each micro-batch in flight (all m under GPipe, min(m, after + 1) under 1F1B) plus
    `rebuilt` for one micro-batch's activations, over m (conservative by one where exact)."""
    few = 1 if rt + rebuilt <= 1.0 else (math.floor(rebuilt / (1.0 - rt)) + 1 if rt < 1.0 else math.inf)
    if not bounded or few <= after + 1:
        return few
    return max(after + 2, math.floor(rt * (after + 1) + rebuilt) + 1)


def run_order(prob: StateSums, scorer: Scorer, order: tuple[str, ...], options: PlanOptions,
               m_max: int, bound_s: float, max_labels: int = MAX_LABELS,
               bound_usd: float = math.inf, bound_thr: float = math.inf) -> list[Label]:
    """The Pareto front at ({}, device 0) for one device order."""
    setup = _Order(prob, scorer, order, options)
    front = _Front(setup, max_labels)
    n = len(prob.ideals)
    for e in range(1, setup.D + 1):
        front.labels[(n - 1, e)] = [Label(0.0, 0.0, 0.0, 0, 1, setup.usd_prefix[e], 0, 0.0, None, None, 0.0)]
    for j in range(n - 1, 0, -1):
        if not len(prob.below_arr[j]):
            continue
        for e in range(1, setup.D + 1):
            labels = front.labels.get((j, e))
            for k in range(1, min(e, setup.max_replicas) + 1) if labels else ():
                _stages_into(front, labels, prob, setup, j, e, k, m_max, (bound_s, bound_usd, bound_thr))
    return front.labels.get((0, 0), [])


def _stages_into(front: _Front, labels: list[Label], prob: StateSums, setup: _Order, j: int, e: int, k: int,
                 m_max: int, bounds: tuple[float, float, float]) -> None:
    """Every stage S_j - S_i on the k devices before position e (recomputing or not, as the
    options allow), put in front of every label of (j, e), into the front of (i, e - k)."""
    d = e - k
    link = setup.links[e - 1] if j != len(prob.ideals) - 1 else None
    cut_j = prob.cut[j]
    for recompute in setup.recompute:
        cand, below, t, ratio, ar_all, steady, fixed, rebuilt = _stage_options(prob, setup, j, d, k, bounds[0],
                                                                               recompute)
        for c_idx in cand.tolist():
            i = int(below[c_idx])
            ts, ar, r_i = float(t[c_idx]), float(ar_all[c_idx]), float(setup.rest[i, d])
            memory = (float(ratio[c_idx]), float(rebuilt[c_idx]))
            for lab in labels:
                c_s = lt = steady_cut = 0.0
                if link is not None and cut_j > 0:
                    c_s = cut_j * setup.cut_s_per_byte(d, e, lab.k_first)
                    lt = link.latency_s
                    if setup.track_thr:  # PipeDream's question: the cut as `CostModel.bottleneck_s` sees it
                        steady_cut = steady_cut_s(cut_j, setup.cut_Bps(d, e, lab.k_first))
                out = _extend(lab, (i, j, d, k, recompute), ts, memory, ar, c_s, lt, r_i, setup, m_max, bounds,
                              max(float(steady[c_idx]), steady_cut), float(fixed[c_idx]))
                if out is not None:
                    front.add((i, d), out)


def label_plan(prob: StateSums, order: tuple[str, ...], lab: Label, m: int, options: PlanOptions) -> Plan:
    stages = []
    while lab is not None and lab.stage is not None:
        i, j, d, k, recompute = lab.stage
        dense = prob.updated[j] - prob.updated[i] >= prob.params[j] - prob.params[i] - 0.5
        stages.append(Stage(prob.nodes(i, j), order[d:d + k], recompute,
                            shard=options.shard != "never" and k > 1 and bool(dense)))
        lab = lab.parent
    return Plan(tuple(stages), m, options.schedule, "dp", options.objective)
