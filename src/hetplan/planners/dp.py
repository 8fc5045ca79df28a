"""`dp`: the antichain dynamic program for pipelines on heterogeneous devices.

After PipeDream's optimizer (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for
DNN Training", SOSP 2019) and Ju et al.'s task segmentation and parallel optimisation of DNN
models: the graph's cut states (down-sets, `hetplan.planners.states`) are sorted topologically
and a pipeline is a chain of states  {} = S_0 < S_1 < ... < S_n = V,  stage k being the convex
set S_k minus S_(k-1). We extend both papers:

- Devices. Candidate *device orders* are sequences of the cluster's devices: all distinct
  orders of its device classes (devices of one type, host, memory and price) when there are at
  most 24; otherwise orders that keep types and hosts together, one per order of the types
  (fastest first, ...), plus cheapest-per-speed first for cost. Along an order, each stage
  takes the next k >= 1 devices as data-parallel replicas (mixed types allowed: a replica's share
  of every micro-batch is proportional to its speed) and devices left at the end stay unused.
  Every assignment of disjoint device groups to stages is such a run of some order, so on small
  clusters, where all orders are tried, the search over devices is complete.
- Communication: the bytes crossing each cut (each tensor once, however many consumers it has
  beyond the cut: `Graph.crossing_bytes`), sent forward and (as gradients) back, always
  counted, routed as the runtime routes rows (`CostModel.routed_cut_s`: replica p sends to the
  replicas of the next stage whose slices of the micro-batch overlap its own, the transfers
  sharing the interfaces they cross, so replicas in line on one host talk inside it); the
  `throughput` objective prices a cut as `CostModel.bottleneck_s` does (`cut_Bps`).
- Memory: a stage whose replica would not fit under the schedule (4x its parameters plus its
  stashed activations: all micro-batches under GPipe, min(m, stages after it + 1) under 1F1B)
  is not allowed.
- The objective of a flushed pipeline. With t_k a stage's time for the whole batch, c_k the
  transfer time across cut k for the whole batch and m micro-batches,

      T(m) = ( sum_k (t_k + 2 c_k) + (m - 1) * P ) / m  +  2 sum latency  +  max_k (AR_k + OPT_k)
      P    = max( t_k, c_(k-1) + c_k, and under 1F1B  sum_{j >= k} (t_j + 2 c_j) / (n - k) )

  where AR_k is the ring all-reduce of a replicated stage, OPT_k its optimizer step (Adam,
  memory-bound, on the slowest replica), c_(k-1) + c_k says that a stage's devices receive the
  activations of the cut before them and the gradients of the cut after them through one
  interface (and send through one), and the last term of P says that under
  1F1B stage k has at most n - k micro-batches in flight, so one round trip through the rest of
  the pipeline is shared by at most n - k of them (it matters when links are slow). T is not a
  sum of per-stage terms, so the program keeps, per state, a Pareto front of labels (sum, P,
  all-reduce, stages after, the fewest micro-batches memory allows, price per hour when the
  objective is cost) instead of one number, and m is chosen at the end from {1, 2, 4, ..., 32}
  (or the user's m), leaving out m whose micro-batches have fewer rows than a stage has replicas
  (the runtime splits rows whole, so a replica would idle in every micro-batch; issue 14's note).

The `throughput` objective (PipeDream's own question: the steady state of a pipeline that never
flushes) adds one more label entry, the slowest stage (its time plus its all-reduce shared by its
replicas, `formulas.steady_stage_s`) or cut (`formulas.steady_cut_s`) so far; it is a maximum of
per-stage terms, so it is exact in the program, and ranks labels and plans first (the step, second).
`--max-replicas` caps k.

Recurrence, from the end of the pipeline backwards: F(j, e) is the front of ways to run the
nodes outside S_j on devices e, e+1, ... of the order (devices after the last stage unused), with
F(V, e) = {empty} for e >= 1 and

    F(i, d) = Pareto( label + stage(S_j - S_i on devices d .. d+k-1)  for S_i < S_j, k >= 1,
                      label in F(j, d + k) ),

answer F({}, 0). With S states (at most 160 after `coarsen`), D devices, O orders and fronts
capped at L labels (6, after merging labels within 0.2%), the work is O(O * S^2 * D * K * L)
label extensions in the worst case, K the largest replica group (D up to 8 devices, then 4).
Pairs of states with no subset relation are skipped; the transitions of one (state, position,
group size) are computed for all earlier states at once with numpy; and a partial plan is cut
when a lower bound on its step (the work left, spread over the devices left, is at least the
slowest stage still to come) exceeds the best step found so far (the baselines' simulated
steps, then the best of the orders already done, with 5% slack because the model is not exact).

Micro-batches: the program tries every label with the usual counts, 1 to 32 (its model has no
fixed cost per micro-batch beyond the profile's fixed parts, and is optimistic about many small
ones), then in a second pass the labels that memory allows only with more, each with the two
fewest counts of `kit.microbatch_choices` it allows (up to one row per micro-batch). A plan
tightens the bound only when its replicas get at least ROUNDING_ROWS rows of a micro-batch (the
program splits micro-batches exactly, the runtime in whole rows).

Cut states: at most 160 after `coarsen` (one per slice of the compute time, the cheapest cut in
each). When some were left out, a second pass keeps only the states within ZOOM_WIDTH (by
compute time) of the cuts of the first pass's best ZOOM_PLANS plans, and the candidates of both
passes compete: resnet50 (242 states) as a straight pipeline on 8 V100s reaches the bottleneck
of the program over every state, 3% below the first pass's. A zoom, not a proof: a better cut far
from all of those can still be missed.

Big clusters: past 8 devices a stage takes at most 4 replicas (or `--max-replicas`), past 16
the program keeps 64 cut states, and past 32 it runs on the host prefixes only. So that more
devices never give a worse plan, dp also plans on the first 1, 2, 4, ... hosts of a cluster of
more than 8 devices, up to 16 devices (`host_prefixes`), smallest first, and the best candidates
of every run compete in the end, with the baselines' plans (one device, data parallelism,
time-balanced stages, with the user's micro-batches) of every cluster, which dp simulates
anyway for its first bound: so it never returns a plan worse than theirs. The plans of the
smaller clusters also tighten the bigger ones' first bound (`bench/dp_scale.py`). Past 8
devices the per-type program of `hetplan.planners.scale` adds its candidates: wide stages of
one device type, any number of replicas, every micro-batch size; that is where plans for tens
to a thousand GPUs come from (`bench/llm_plans.py`).

Finally the best 256 (label, m) pairs by T(m) (or price, for `cost`) over all orders are turned
into plans and re-ranked by the fast path (`hetplan.sim.fast`, the schedule's exact recurrence
for chains), the TOP_K best of those are re-scored by the event simulator, and the best by the
user's objective is returned. Assumptions: compute time linear in the micro-batch size; the
latency between the two adjacent devices of two stages stands for all; a cut's transfers all
run at once at its bandwidth (the simulator's interfaces also serialise what shares a sender,
a receiver or a host's interface in time); all-reduces do not overlap anything; tensors that
skip stages are charged on every cut they cross (relayed, as the runtime sends them). The event
simulator's re-scoring corrects these for the plans it sees, not for the ones the program discarded.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel, after_stage
from hetplan.cost.formulas import (
    activation_room_bytes,
    stage_memory_bytes,
    steady_cut_s,
    steady_stage_s,
    usd_per_step,
)
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage, plan_problems
from hetplan.planners import baselines
from hetplan.planners.devices import device_orders
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.refine import polish
from hetplan.planners.scale import scale_candidates
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import StateSums
from hetplan.schedule import get_schedule
from hetplan.sim.fast import fast_step_s

MAX_STATES = 160
MAX_LABELS = 6
EPSILON = 0.002  # labels closer than this in sum, max and all-reduce are merged
TOP_K = 12
BOUND_SLACK = 0.05  # partial plans within this of the best found so far are kept (the model is not exact)
BASELINE_SLACK = 0.25  # the program's model may find a baseline's plan this much slower than simulated
POOL = 256  # candidates the fast path re-ranks before the event simulator scores TOP_K of them
PER_SHAPE = 32  # of those, at most this many with the same replicas per stage (so the pool is not one shape's)
SMALL_CLUSTER = 8  # up to this many devices a stage may take any number of them as replicas
BIG_CLUSTER_REPLICAS = 4  # on bigger clusters, at most this many
SUB_CLUSTER = 16  # dp also plans on the first hosts of a big cluster, up to this many devices
BIG_CLUSTER_STATES = 64  # past SUB_CLUSTER devices, the whole cluster's program keeps this many cut states
USUAL_MICROBATCHES = 32  # see `usual_microbatches`
ZOOM_PLANS = 4  # when cut states were left out, a second pass keeps every state near the cuts of this many plans,
ZOOM_WIDTH = 6  # this many on either side of each by compute time
# The program gives each replica its exact share of a micro-batch; the runtime splits whole rows,
# so with few rows per replica the program is optimistic (8 replicas of two speeds sharing 16
# rows: 11%) and such a plan does not tighten the bound unless its replicas get this many rows
ROUNDING_ROWS = 8
DEVICE_PROGRAM = 32  # past this many devices, the device-order program runs on the host prefixes only
SUB_CLUSTER_KEEP = 4  # of each host prefix's candidates, the best this many compete on the whole cluster
SCALE_STATES = 64  # cut states of the per-type program (`hetplan.planners.scale`)


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
    stage: tuple[int, int, int, int] | None  # its first stage: (state i, state j, position d, replicas k)
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
        fits_anywhere = stage_memory_bytes(prob.params[-1], prob.acts[-1], 1.0) <= min(d.mem_bytes for d in self.dev)
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
                                prob.params[j] - prob.params[below], prob.acts[j] - prob.acts[below], opt))
        return self._ending[1]

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


def _stage_options(prob: StateSums, setup: _Order, j: int, d: int, k: int, bound_s: float) -> tuple:
    """For the stage S_j - S_i on devices d .. d+k-1, over every earlier state i at once: which
    i are allowed (time bound, memory, devices left), the stage's time, its memory need over
    what is free (the worst replica type), its all-reduce + optimizer step, and (objective
    throughput) its steady-state time per batch, and what each micro-batch costs it whatever its
    rows (its slowest replica type's fixed parts)."""
    below, diff, w_stage, a_stage, opt_needs = setup.ending_at(prob, j)
    cnt, mem, after_stage, devices = setup.groups[(d, k)]
    with np.errstate(divide="ignore", invalid="ignore"):
        used = [ti for ti, c in enumerate(cnt) if c]
        speed = sum(cnt[ti] / diff[ti] for ti in used)  # inf where a type needs no time
        t = np.where(np.isfinite(speed) & (speed > 0), 1.0 / speed, 0.0)
        # memory of each replica type: its share of every micro-batch's activations
        ratio = np.zeros(len(below))  # needed / free, the worst replica type
        fits = np.ones(len(below), dtype=bool)
        for ti in used:
            share = np.where(np.isfinite(speed) & (diff[ti] > 0), t / diff[ti], 1.0 / k)
            room = activation_room_bytes(mem[ti], w_stage)
            fits &= room > 0
            ratio = np.maximum(ratio, np.where(room > 0, a_stage * share / np.maximum(room, 1.0), np.inf))
    ok = (t <= bound_s) & fits & ((ratio <= 1.0) | setup.bounded)
    ok &= (below == 0) if d == 0 else (below != 0)  # with d == 0 no devices are left for nodes before
    ok &= setup.rest[below, d] <= bound_s  # the slowest stage before takes at least that
    sync = setup.cost.gradient_sync_s(opt_needs[0], opt_needs[2], devices)  # bytes updated, index bytes
    ar = after_stage(sync, opt_needs)
    steady = steady_stage_s(t, setup.cost.steady_sync_s(opt_needs[0], devices), k) if setup.track_thr else t
    fixed = np.max([setup.fixed[ti, j] - setup.fixed[ti, below] for ti in used], axis=0)
    return np.nonzero(ok)[0], below, t, ratio, ar, steady, fixed


def _extend(lab: Label, stage: tuple[int, int, int, int], ts: float, rt: float, ar: float, c_s: float, lt: float,
            r_i: float, setup: _Order, m_max: int, bounds: tuple[float, float, float],
            steady_s: float = 0.0, fixed_s: float = 0.0) -> Label | None:
    """The label of `lab` with one more stage in front (time ts, memory ratio rt, all-reduce ar,
    transfer c_s and latency lt across its cut; its steady-state time, or its cut's if slower,
    steady_s), or None when memory or the bounds cut it."""
    bound_s, bound_usd, bound_thr = bounds
    thr = max(lab.thr_s, steady_s)
    if thr > bound_thr:
        return None
    mr = lab.m_req
    if rt > 1.0:  # 1F1B: this stage holds min(m, r + 1) micro-batches; m must exceed r + 1
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


def _run_order(prob: StateSums, scorer: Scorer, order: tuple[str, ...], options: PlanOptions,
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
    """Every stage S_j - S_i on the k devices before position e, put in front of every label of
    (j, e), into the front of (i, e - k)."""
    d = e - k
    cand, below, t, ratio, ar_all, steady, fixed = _stage_options(prob, setup, j, d, k, bounds[0])
    link = setup.links[e - 1] if j != len(prob.ideals) - 1 else None
    cut_j = prob.cut[j]
    for c_idx in cand.tolist():
        i = int(below[c_idx])
        ts, rt, ar, r_i = float(t[c_idx]), float(ratio[c_idx]), float(ar_all[c_idx]), float(setup.rest[i, d])
        for lab in labels:
            c_s = lt = steady_cut = 0.0
            if link is not None and cut_j > 0:
                c_s = cut_j * setup.cut_s_per_byte(d, e, lab.k_first)
                lt = link.latency_s
                if setup.track_thr:  # PipeDream's question: the cut as `CostModel.bottleneck_s` sees it
                    steady_cut = steady_cut_s(cut_j, setup.cut_Bps(d, e, lab.k_first))
            out = _extend(lab, (i, j, d, k), ts, rt, ar, c_s, lt, r_i, setup, m_max, bounds,
                          max(float(steady[c_idx]), steady_cut), float(fixed[c_idx]))
            if out is not None:
                front.add((i, d), out)


def _plan(prob: StateSums, order: tuple[str, ...], lab: Label, m: int, options: PlanOptions) -> Plan:
    stages = []
    while lab is not None and lab.stage is not None:
        i, j, d, k = lab.stage
        stages.append(Stage(prob.nodes(i, j), order[d:d + k]))
        lab = lab.parent
    return Plan(tuple(stages), m, options.schedule, "dp", options.objective)


def baseline_plans(graph: Graph, cluster: Cluster, options: PlanOptions) -> list[Plan]:
    """The valid plans of the baselines dp bounds itself with and competes with at the end (one
    device, data parallelism, torchgpipe's time-balanced split), with the user's micro-batches."""
    plans = []
    for make in (baselines.single, baselines.data_parallel, baselines.balanced_time):
        try:
            plan = make(graph, cluster, options)
        except HetplanError:
            continue
        if not plan_problems(plan, graph, cluster):
            plans.append(plan)
    return plans


def _baseline_bound_s(graph: Graph, cluster: Cluster, options: PlanOptions, scorer: Scorer,
                      known: Sequence[Plan] = ()) -> float:
    """The first bound on the step: for time, the simulated steps of the baselines and of the
    `known` plans (with slack: the program's model may see them slower); for cost, the floor
    (slower plans are infeasible); for throughput, the bound on the steady state: theirs."""
    if options.objective == "cost":
        return graph.batch_size / options.min_samples_per_s
    bound = math.inf
    if options.objective in ("time", "throughput"):
        for plan in [*baseline_plans(graph, cluster, replace(options, microbatches=None)), *known]:
            est = scorer.estimate(plan)
            if est.feasible and options.allows(plan):
                # the steady state is the program's exact model; the step is not (slack)
                bound = min(bound, est.bottleneck_s if options.objective == "throughput"
                            else est.step_s * (1.0 + BASELINE_SLACK))
    return bound


def _pool(prob: StateSums, scorer: Scorer, orders: list[tuple[str, ...]], choices: tuple[int, ...],
          options: PlanOptions, known: Sequence[Plan] = ()) -> list[tuple]:
    """(key, order, label, m) of every front label and allowed m over all orders, best first by
    the program's model. Bounds cut every partial plan that cannot beat the best found so far:
    the first bound, then the best step (time) or price x step above the floor (cost) of the
    orders done."""
    graph = scorer.graph
    bound, bound_usd, bound_thr = _baseline_bound_s(graph, scorer.cluster, options, scorer, known), math.inf, math.inf
    if options.objective == "throughput":
        bound, bound_thr = math.inf, bound
    pool = []
    # two passes: the usual micro-batch counts, then labels that memory allows only more of (in
    # one pass, those would crowd the fronts: the model is optimistic about many small ones)
    passes = [(max(usual_microbatches(choices)), False)]
    if max(choices) > passes[0][0]:
        passes.append((max(choices), True))
    for order, (m_max, many) in itertools.product(orders, passes):
        for lab in _run_order(prob, scorer, order, options, m_max, bound, bound_usd=bound_usd,
                              bound_thr=bound_thr):
            if many and lab.m_req <= passes[0][0]:
                continue
            for m in useful_microbatches(lab, choices, graph.batch_size, many):
                t = model_step_s(lab, m)
                if options.objective == "cost":
                    fast_enough = graph.batch_size / max(t, 1e-30) >= 0.9 * (options.min_samples_per_s or 0)
                    key = (0 if fast_enough else 1, usd_per_step(lab.usd_per_hour, t))
                    if t <= bound:
                        bound_usd = min(bound_usd, usd_per_step(lab.usd_per_hour, t) * (1.0 + BOUND_SLACK))
                elif options.objective == "throughput":
                    key = (0, lab.thr_s, t)
                    bound_thr = min(bound_thr, lab.thr_s)
                else:
                    key = (0, t)
                    if options.objective == "time" and graph.batch_size // m >= ROUNDING_ROWS * lab.k_max:
                        bound = min(bound, t * (1.0 + BOUND_SLACK))
                pool.append((key, order, lab, m))
    pool.sort(key=lambda x: x[0])
    return pool


def _rerank(graph: Graph, cluster: Cluster, plans: list[Plan], options: PlanOptions, top_k: int,
            cost: CostModel) -> list[Plan]:
    """The top_k of the plans by the fast path (the exact recurrence of the schedule, with
    latencies and uneven micro-batches), by step or, for cost, by price above the floor."""
    if len(plans) <= top_k:
        return plans
    fast = fast_step_s(graph, cluster, plans)
    if options.objective == "throughput":  # the steady state first (the program's, exact), then the step
        steady = np.array([cost.bottleneck_s(p) for p in plans])
        keep = np.lexsort((fast, steady))[:top_k]
        return [plans[int(k)] for k in keep]
    if options.objective == "cost":
        usd = usd_per_step(np.array([sum(cluster.device(d).usd_per_hour for d in p.devices) for p in plans]), fast)
        slow = graph.batch_size / fast < (options.min_samples_per_s or 0) * 0.9
        rank = np.where(slow, np.inf, usd)
    else:
        rank = fast
    keep = np.argsort(rank, kind="stable")[:top_k]
    return [plans[int(k)] for k in keep]


def dp_candidates(graph: Graph, cluster: Cluster, options: PlanOptions, scorer: Scorer | None = None,
                  top_k: int = TOP_K, max_states: int = MAX_STATES,
                  known: Sequence[Plan] = ()) -> tuple[list[Plan], dict]:
    """The dynamic program's best plans by its own model (at most `top_k`), and facts about the
    run for the plan's meta. The program's model ranks the pool; the fast path re-ranks the best
    POOL of them; the event simulator (the caller) scores the top_k of those. `known` plans (of
    this cluster) tighten the first bound, as the baselines do."""
    scorer = scorer or Scorer(graph, cluster, options)
    prob = StateSums(graph, scorer.cost, max_states)
    speed = {t: 1.0 / max(float(prob.time[t][-1]), 1e-30) for t in prob.types}
    orders = device_orders(cluster, speed, options.objective)
    plans = _rerank(graph, cluster, _program_plans(prob, scorer, orders, options, known), options, top_k,
                    scorer.cost)
    meta = {"states": len(prob.states), "states_used": len(prob.ideals), "all_cuts": prob.states.complete,
            "device_orders": len(orders)}
    if len(prob.ideals) < len(prob.states) and plans:
        # states were left out: a second pass over every state near where the best plans cut
        around = sorted({i for p in plans[:ZOOM_PLANS] for i in prob.cut_indices([s.nodes for s in p.stages])})
        near = StateSums(graph, scorer.cost, max_states, around=around, width=ZOOM_WIDTH)
        plans = _rerank(graph, cluster, plans + _program_plans(near, scorer, orders, options, known), options,
                        top_k, scorer.cost)
        meta["zoom_states"] = len(near.ideals)
    meta["candidates"] = len(plans)
    return plans, meta


def _program_plans(prob: StateSums, scorer: Scorer, orders: list[tuple[str, ...]], options: PlanOptions,
                   known: Sequence[Plan]) -> list[Plan]:
    """The plans of the pool's best labels (at most POOL, at most PER_SHAPE of one shape)."""
    plans, seen, shapes = [], set(), Counter()
    for _, order, lab, m in _pool(prob, scorer, orders, microbatch_choices(scorer.graph, options), options, known):
        plan = _plan(prob, order, lab, m, options)
        k, shape = Scorer.key(plan), tuple(len(st.devices) for st in plan.stages)
        if k not in seen and shapes[shape] < PER_SHAPE:
            seen.add(k)
            shapes[shape] += 1
            plans.append(plan)
            if len(plans) >= POOL:
                break
    return plans


def host_prefixes(cluster: Cluster) -> list[Cluster]:
    """The clusters of the first 1, 2, 4, ... hosts (in the cluster's order) of a cluster bigger
    than SMALL_CLUSTER, with at most SUB_CLUSTER devices and fewer than it has. dp plans on each
    too: there a stage may take all the devices as replicas (on the big cluster at most
    BIG_CLUSTER_REPLICAS), so adding hosts never makes dp's plan worse than the smaller
    cluster's (issue 16: 40.5 ms on 8 V100s, 88.6 ms once 8 more devices were added)."""
    if len(cluster.devices) <= SMALL_CLUSTER:
        return []
    out, hosts = [], 1
    while hosts < len(cluster.hosts):
        ids = [d.id for d in cluster.devices if d.host in cluster.hosts[:hosts]]
        if len(ids) > SUB_CLUSTER:
            break
        out.append(cluster.subset(ids))
        hosts *= 2
    return out


def dp(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    scorer = Scorer(graph, cluster, options)
    states = MAX_STATES if len(cluster.devices) <= SUB_CLUSTER else BIG_CLUSTER_STATES
    # the smaller clusters first, each bounded by the ones before (their plans run here too)
    subs, found = host_prefixes(cluster), []
    for sub in subs:
        found += dp_candidates(graph, sub, options, known=found)[0][:SUB_CLUSTER_KEEP]
        found += _baselines_as_dp(graph, sub, options)
    device_program = len(cluster.devices) <= DEVICE_PROGRAM
    plans, meta = dp_candidates(graph, cluster, options, scorer, max_states=states, known=found) \
        if device_program else ([], {"states": 0, "states_used": 0, "all_cuts": False, "device_orders": 0})
    plans += found
    if len(cluster.devices) > SMALL_CLUSTER:  # wide stages of one type, counted per type (`scale`)
        wide = scale_candidates(scorer, StateSums(graph, scorer.cost, SCALE_STATES))
        plans += wide
        meta["scale_candidates"] = len(wide)
    meta["sub_clusters"] = [len(sub.devices) for sub in subs]
    plans += _baselines_as_dp(graph, cluster, options)
    if options.objective == "cost" and device_program:
        # the fastest plans are candidates too: the program's model, against which the floor is
        # checked first, can see a plan that reaches it as too slow (ctr-dnn on eight CPU
        # workers: 154,000 samples/s simulated, and nothing found at a floor of 145,000)
        fastest, _ = dp_candidates(graph, cluster, replace(options, objective="time", min_samples_per_s=None),
                                   max_states=states, known=found)
        plans += [replace(p, objective="cost") for p in fastest]
    if not any(scorer.estimate(p).feasible for p in plans) and not options.microbatches:
        # nothing fits: so that the error names the shortfall at the smallest micro-batch, the
        # time-balanced pipeline with one row per micro-batch is tried too
        plans += _baselines_as_dp(graph, cluster, replace(options, microbatches=graph.batch_size))
    best = polish(scorer, scorer.best(plans, "dp"), microbatch_choices(graph, options))
    return replace(best, meta={**best.meta, "dp": meta})


def _baselines_as_dp(graph: Graph, cluster: Cluster, options: PlanOptions) -> list[Plan]:
    """The baselines' plans, as dp's candidates: the program's model can rank a pipeline above
    data parallelism that the simulator finds slower (resnet18 on 8 V100s: 108.7 ms against
    100.2 ms). Not for cost, whose floor the program applies itself."""
    if options.objective == "cost":
        return []
    return [replace(p, planner="dp", objective=options.objective) for p in baseline_plans(graph, cluster, options)]


def warm_start(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan | None:
    """dp's plan, where the searching planners start (so that they never return a worse one), or
    None when dp finds nothing feasible."""
    try:
        return dp(graph, cluster, options)
    except InfeasibleError:
        return None
