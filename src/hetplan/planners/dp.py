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
- Communication: the bytes crossing each cut, sent forward and (as gradients) back over the link
  between the two stages' devices, always counted; split over max(k, k') parallel links when
  either side is replicated.
- Memory: a stage whose replica would not fit under the schedule (4x its parameters plus its
  stashed activations: all micro-batches under GPipe, min(m, stages after it + 1) under 1F1B)
  is not allowed.
- The objective of a flushed pipeline. With t_k a stage's time for the whole batch, c_k the
  transfer time across cut k for the whole batch and m micro-batches,

      T(m) = ( sum_k (t_k + 2 c_k) + (m - 1) * P ) / m  +  2 sum latency  +  max_k (AR_k + OPT_k)
      P    = max( t_k, c_k, and under 1F1B  sum_{j >= k} (t_j + 2 c_j) / (n - k) )

  where AR_k is the ring all-reduce of a replicated stage, OPT_k its optimizer step (Adam,
  memory-bound, on the slowest replica), and the last term of P says that under
  1F1B stage k has at most n - k micro-batches in flight, so one round trip through the rest of
  the pipeline is shared by at most n - k of them (it matters when links are slow). T is not a
  sum of per-stage terms, so the program keeps, per state, a Pareto front of labels (sum, P,
  all-reduce, stages after, the fewest micro-batches memory allows, price per hour when the
  objective is cost) instead of one number, and m is chosen at the end from {1, 2, 4, ..., 32}
  (or the user's m).

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

Finally the best 256 (label, m) pairs by T(m) (or price, for `cost`) over all orders are turned
into plans and re-ranked by the fast path (`hetplan.sim.fast`, the schedule's exact recurrence
for chains), the TOP_K best of those are re-scored by the event simulator, and the best by the
user's objective is returned. Assumptions: compute time linear in the micro-batch size; the
link between the two adjacent devices of two stages stands for all links between them;
all-reduces do not overlap anything; tensors that skip stages are charged on every cut they
cross (relayed, as the runtime sends them). The event simulator's re-scoring corrects these for
the plans it sees, not for the ones the program discarded.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import WEIGHT_COPIES
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage
from hetplan.planners import baselines
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import coarsen, cut_states
from hetplan.sim.fast import fast_step_s

MAX_STATES = 160
MAX_LABELS = 6
EPSILON = 0.002  # labels closer than this in sum, max and all-reduce are merged
TOP_K = 12
BOUND_SLACK = 0.05  # partial plans within this of the best found so far are kept (the model is not exact)
BASELINE_SLACK = 0.25  # the program's model may find a baseline's plan this much slower than simulated
POOL = 256  # candidates the fast path re-ranks before the event simulator scores TOP_K of them
MAX_ORDERS = 24
SMALL_CLUSTER = 8  # up to this many devices a stage may take any number of them as replicas
BIG_CLUSTER_REPLICAS = 4  # on bigger clusters, at most this many


def device_classes(cluster: Cluster) -> list[list[str]]:
    """Groups of interchangeable devices: same type, host, memory, price and threads, and no
    link of their own."""
    special = {d for o in cluster.links for d in o.between}
    classes: dict[tuple, list[str]] = {}
    for d in cluster.devices:
        key = (d.type, d.host, d.mem_bytes, d.usd_per_hour, d.threads, d.id if d.id in special else "")
        classes.setdefault(key, []).append(d.id)
    return list(classes.values())


def distinct_permutations(items: list) -> Iterator[list]:
    """The distinct orders of a sorted multiset, in lexicographic order (the classic next-
    permutation step), each made in O(n): 16 identical devices have one order, not 16! tuples
    to deduplicate."""
    seq = list(items)
    while True:
        yield list(seq)
        i = len(seq) - 2
        while i >= 0 and seq[i] >= seq[i + 1]:
            i -= 1
        if i < 0:
            return
        j = len(seq) - 1
        while seq[j] <= seq[i]:
            j -= 1
        seq[i], seq[j] = seq[j], seq[i]
        seq[i + 1:] = reversed(seq[i + 1:])


def device_orders(cluster: Cluster, speed: dict[str, float], objective: str,
                  limit: int = MAX_ORDERS) -> list[tuple[str, ...]]:
    """Sequences of all devices: every distinct order of device classes (`device_classes`) when
    there are at most `limit`, else a few orders that keep types and hosts together."""
    classes = {(cluster.device(ids[0]).type, cluster.device(ids[0]).host, k): ids
               for k, ids in enumerate(device_classes(cluster))}  # (type, host, number) -> ids
    counts = Counter({c: len(ids) for c, ids in classes.items()})
    n_orders = math.factorial(sum(counts.values()))
    for c in counts.values():
        n_orders //= math.factorial(c)

    def realise(seq: list[tuple[str, str, int]]) -> tuple[str, ...]:
        taken: dict[tuple[str, str, int], int] = {}
        out = []
        for c in seq:
            out.append(classes[c][taken.get(c, 0)])
            taken[c] = taken.get(c, 0) + 1
        return tuple(out)

    if n_orders <= limit:
        return [realise(s) for s in distinct_permutations(sorted(c for c, k in counts.items() for _ in range(k)))]
    types = sorted({c[0] for c in classes}, key=lambda t: (-speed[t], t))
    type_orders = list(itertools.permutations(types)) if len(types) <= 3 else [tuple(types), tuple(reversed(types))]
    orders = []
    for tord in type_orders:
        seq = []
        for t in tord:
            for key, ids in sorted(classes.items(), key=lambda kv: kv[0][1:]):
                if key[0] == t:
                    seq += [key] * len(ids)
        orders.append(realise(seq))
    if objective == "cost":  # cheapest work first: price per unit of speed
        seq = sorted(classes, key=lambda c: (cluster.device(classes[c][0]).usd_per_hour / speed[c[0]], c))
        orders.append(realise([c for c in seq for _ in classes[c]]))
    return list(dict.fromkeys(orders))[:limit]


class _Problem:
    """Per-state sums (time per device type, parameters, activations, bytes across the cut)."""

    def __init__(self, graph: Graph, scorer: Scorer, max_states: int) -> None:
        self.graph = graph
        cm = scorer.cost
        states = cut_states(graph)
        mat = states.matrix().astype(float)
        by_id = graph.by_id
        order = states.order
        self.types = sorted({d.type for d in scorer.cluster.devices})
        node_t = {t: cm.node_times_s(t) for t in self.types}
        self.time = {t: mat @ np.array([sum(node_t[t][v]) for v in order]) for t in self.types}
        ref = self.types[0]
        index = {v: k for k, v in enumerate(order)}
        src = np.array([index[e.src] for e in graph.edges], dtype=int)
        dst = np.array([index[e.dst] for e in graph.edges], dtype=int)
        nbytes = np.array([float(e.bytes) for e in graph.edges])
        cut = ((mat[:, src] > 0) & (mat[:, dst] == 0)) @ nbytes if len(graph.edges) else np.zeros(len(states))
        keep = coarsen(states, self.time[ref], cut, max_states)
        self.ideals = [states.ideals[k] for k in keep]
        self.time = {t: v[keep] for t, v in self.time.items()}
        self.params = (mat @ np.array([float(by_id[v].param_bytes) for v in order]))[keep]
        self.acts = (mat @ np.array([float(by_id[v].act_bytes) for v in order]))[keep]
        self.cut = cut[keep]
        self.states = states
        n = len(self.ideals)
        self.below = [[i for i in range(j) if self.ideals[i] & ~self.ideals[j] == 0 and i != j] for j in range(n)]
        self.below_arr = [np.array(b, dtype=int) for b in self.below]

    def nodes(self, i: int, j: int) -> tuple[str, ...]:
        return self.states.members(self.ideals[j] & ~self.ideals[i])


def _run_order(prob: _Problem, scorer: Scorer, order: tuple[str, ...], options: PlanOptions,
               m_max: int, bound_s: float, max_labels: int = MAX_LABELS,
               bound_usd_s: float = math.inf) -> list[tuple]:
    """The Pareto front at ({}, device 0) for one device order. A label is
    (sum, max, ar, r, mreq, price, kfirst, lat, stage, parent, rank)."""
    cluster = scorer.cluster
    D = len(order)
    n = len(prob.ideals)
    dev = [cluster.device(x) for x in order]
    tindex = {t: k for k, t in enumerate(prob.types)}
    dtype = [tindex[d.type] for d in dev]
    times = np.array([prob.time[t] for t in prob.types])  # (types, states)
    gpipe = options.schedule == "gpipe"
    max_replicas = D if D <= SMALL_CLUSTER else BIG_CLUSTER_REPLICAS
    # the stages after a stage matter only through 1F1B's memory; skip them when all fits anyway
    fits_anywhere = WEIGHT_COPIES * prob.params[-1] + prob.acts[-1] <= min(d.mem_bytes for d in dev)
    track_r = not gpipe and not fits_anywhere
    track_price = options.objective == "cost"
    usd_prefix = [0.0]
    for d in dev:
        usd_prefix.append(usd_prefix[-1] + d.usd_per_hour)
    # per group (d, k): type counts, smallest memory per type, ring all-reduce parameters
    groups: dict[tuple[int, int], tuple] = {}
    for d in range(D):
        for k in range(1, D - d + 1):
            members = order[d:d + k]
            cnt = [0] * len(prob.types)
            mem: dict[int, float] = {}
            for x in range(d, d + k):
                cnt[dtype[x]] += 1
                mem[dtype[x]] = min(mem.get(dtype[x], math.inf), dev[x].mem_bytes)
            if k > 1:
                ring = [cluster.link(members[a], members[(a + 1) % k]) for a in range(k)]
                ar = (min(li.bandwidth_Bps for li in ring), max(li.latency_s for li in ring))
            else:
                ar = None
            opt_per_byte = max(scorer.cost.optimizer_s(1.0, dev[x].type) for x in range(d, d + k))
            per_step = max(dev[x].step_overhead_s for x in range(d, d + k))
            groups[(d, k)] = (cnt, mem, ar, opt_per_byte, per_step)
    links = [cluster.link(order[p], order[p + 1]) if p + 1 < D else None for p in range(D)]

    front: dict[tuple[int, int], list[tuple]] = {}
    # rest[i][d]: the least time the nodes of state i can take on devices 0 .. d-1 working together
    speed_prefix = np.zeros((D + 1, len(prob.types)))
    for x in range(D):
        speed_prefix[x + 1] = speed_prefix[x]
        speed_prefix[x + 1][dtype[x]] += 1
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(times > 0, 1.0 / times, 0.0)  # (types, states)
        total_speed = speed_prefix @ inv  # (D + 1, states)
        rest = np.where(total_speed > 0, 1.0 / total_speed, 0.0).T.tolist()  # [state][d]

    def add(key: tuple[int, int], lab: tuple) -> None:
        labels = front.setdefault(key, [])
        s, mx, ar, r, mreq, price = lab[:6]
        # epsilon-dominance: a label within EPSILON of another in time is as good as it
        se, mxe, are = s * (1 + EPSILON), mx * (1 + EPSILON), ar * (1 + EPSILON)
        for o in labels:
            if (o[0] <= se and o[1] <= mxe and o[2] <= are and o[4] <= mreq
                    and (not track_r or o[3] <= r) and (not track_price or o[5] <= price)):
                return
        labels[:] = [o for o in labels if not (
            s <= o[0] and mx <= o[1] and ar <= o[2] and mreq <= o[4]
            and (not track_r or r <= o[3]) and (not track_price or price <= o[5]))]
        labels.append(lab)
        if len(labels) > max_labels:  # keep the most promising: drop the worst by the step at m_max
            labels.remove(max(labels, key=lambda o: o[10]))

    for e in range(1, D + 1):
        front[(n - 1, e)] = [(0.0, 0.0, 0.0, 0, 1, usd_prefix[e], 0, 0.0, None, None, 0.0)]
    rest_arr = np.array(rest)  # (states, D + 1)
    for j in range(n - 1, 0, -1):
        below = prob.below_arr[j]
        if not len(below):
            continue
        last = j == n - 1
        diff = times[:, j][:, None] - times[:, below]  # (types, candidates): the stage's time per type
        w_stage = prob.params[j] - prob.params[below]
        a_stage = prob.acts[j] - prob.acts[below]
        for e in range(1, D + 1):
            labels = front.get((j, e))
            if not labels:
                continue
            for k in range(1, min(e, max_replicas) + 1):
                d = e - k
                cnt, mem, ar_link, opt_per_byte, per_step = groups[(d, k)]
                with np.errstate(divide="ignore", invalid="ignore"):
                    used = [ti for ti, c in enumerate(cnt) if c]
                    speed = sum(cnt[ti] / diff[ti] for ti in used)  # inf where a type needs no time
                    t = np.where(np.isfinite(speed) & (speed > 0), 1.0 / speed, 0.0)
                    # memory of each replica type: its share of every micro-batch's activations
                    ratio = np.zeros(len(below))  # needed / free, the worst replica type
                    fits = np.ones(len(below), dtype=bool)
                    for ti in used:
                        share = np.where(np.isfinite(speed) & (diff[ti] > 0), t / diff[ti], 1.0 / k)
                        room = mem[ti] - WEIGHT_COPIES * w_stage
                        need = a_stage * share
                        fits &= room > 0
                        ratio = np.maximum(ratio, np.where(room > 0, need / np.maximum(room, 1.0), np.inf))
                ok = (t <= bound_s) & fits & ((ratio <= 1.0) | (not gpipe))
                if d == 0:
                    ok &= below == 0  # no devices are left for nodes before this stage
                else:
                    ok &= below != 0
                ok &= rest_arr[below, d] <= bound_s  # the slowest stage before takes at least that
                cand = np.nonzero(ok)[0]
                if not len(cand):
                    continue
                if ar_link is not None:
                    ar_all = np.where(w_stage > 0, 2 * (k - 1) * (ar_link[1] + w_stage / k / ar_link[0]), 0.0)
                else:
                    ar_all = np.zeros(len(below))
                ar_all = ar_all + w_stage * opt_per_byte + per_step  # then the optimizer step, slowest replica
                link = links[e - 1] if not last else None
                cut_j = prob.cut[j]
                for c_idx in cand.tolist():
                    i = int(below[c_idx])
                    ts = float(t[c_idx])
                    rt = float(ratio[c_idx])
                    ar = float(ar_all[c_idx])
                    r_i = rest[i][d]
                    for lab in labels:
                        s, mx, lar, r, mreq, price, kfirst, lat = lab[:8]
                        mr = mreq
                        if rt > 1.0:  # 1F1B: this stage holds min(m, r + 1) micro-batches; m must exceed r + 1
                            mr = max(mr, math.floor((r + 1) * rt) + 1)
                            if mr > m_max:
                                continue
                        c_s = lt = 0.0
                        if link is not None and cut_j > 0:
                            c_s = cut_j / (link.bandwidth_Bps * max(k, kfirst))
                            lt = link.latency_s
                        s2 = s + ts + 2 * c_s
                        mx2 = max(mx, ts, c_s)
                        if not gpipe:
                            # 1F1B lets this stage have r + 1 micro-batches in flight, so one round
                            # trip through the rest of the pipeline is shared by at most r + 1 of them
                            mx2 = max(mx2, s2 / (r + 1))
                        # a lower bound on the whole step: the stages still to come take at least r_i
                        # in all and the slowest of them at least r_i too (their devices are disjoint,
                        # so max(w_k / speed_k) >= sum(w_k) / sum(speed_k)); the best m is the largest
                        low = (s2 + r_i + (m_max - 1) * max(mx2, r_i)) / m_max
                        if low > bound_s or (track_price and price * low > bound_usd_s):
                            continue
                        ar2, lat2 = max(lar, ar), lat + lt
                        rank = ((s2 + (m_max - 1) * mx2) / m_max + 2 * lat2 + ar2) * (price if track_price else 1.0)
                        add((i, d), (s2, mx2, ar2, r + 1, mr, price, k, lat2, (i, j, d, k), lab, rank))
    return front.get((0, 0), [])


def _plan(prob: _Problem, order: tuple[str, ...], lab: tuple, m: int, options: PlanOptions) -> Plan:
    stages = []
    while lab is not None and lab[8] is not None:
        i, j, d, k = lab[8]
        stages.append(Stage(prob.nodes(i, j), order[d:d + k]))
        lab = lab[9]
    return Plan(tuple(stages), m, options.schedule, "dp", options.objective)


def dp_candidates(graph: Graph, cluster: Cluster, options: PlanOptions, scorer: Scorer | None = None,
                  top_k: int = TOP_K, max_states: int = MAX_STATES) -> tuple[list[Plan], dict]:
    """The dynamic program's best plans by its own model (at most `top_k`), and facts about the
    run for the plan's meta."""
    scorer = scorer or Scorer(graph, cluster, options)
    prob = _Problem(graph, scorer, max_states)
    choices = microbatch_choices(graph, options)
    m_max = max(choices)
    speed = {t: 1.0 / max(float(prob.time[t][-1]), 1e-30) for t in prob.types}
    orders = device_orders(cluster, speed, options.objective)
    # Bounds cut every partial plan that cannot beat the best found so far: for time, the
    # baselines' simulated steps (with slack: the program's model may see them slower), then the
    # best step found in the orders done; for cost, the floor (slower plans are infeasible) and the
    # best price x step found so far above it.
    bound = graph.batch_size / options.min_samples_per_s if options.objective == "cost" else math.inf
    bound_usd = math.inf
    if options.objective == "time":
        for make in (baselines.single, baselines.data_parallel, baselines.balanced_time):
            try:
                est = scorer.estimate(make(graph, cluster, replace(options, microbatches=None)))
            except HetplanError:
                continue
            if est.feasible:
                bound = min(bound, est.step_s * (1.0 + BASELINE_SLACK))
    pool = []
    for order in orders:
        for lab in _run_order(prob, scorer, order, options, m_max, bound, bound_usd_s=bound_usd):
            for m in choices:
                if m < lab[4]:
                    continue
                t = (lab[0] + (m - 1) * lab[1]) / m + 2 * lab[7] + lab[2]
                if options.objective == "cost":
                    fast_enough = graph.batch_size / max(t, 1e-30) >= 0.9 * (options.min_samples_per_s or 0)
                    key = (0 if fast_enough else 1, lab[5] * t)
                    if t <= bound:
                        bound_usd = min(bound_usd, lab[5] * t * (1.0 + BOUND_SLACK))
                else:
                    key = (0, t)
                    if options.objective == "time":
                        bound = min(bound, t * (1.0 + BOUND_SLACK))
                pool.append((key, order, lab, m))
    pool.sort(key=lambda x: x[0])
    # the program's model ranks the pool; the fast path (the exact recurrence of the schedule,
    # with latencies and uneven micro-batches) re-ranks the best POOL of them; the event simulator
    # scores the top_k of those
    plans, seen = [], set()
    for _, order, lab, m in pool:
        plan = _plan(prob, order, lab, m, options)
        k = Scorer.key(plan)
        if k not in seen:
            seen.add(k)
            plans.append(plan)
            if len(plans) >= POOL:
                break
    if len(plans) > top_k:
        fast = fast_step_s(graph, cluster, plans)
        if options.objective == "cost":
            usd = np.array([sum(cluster.device(d).usd_per_hour for d in p.devices) for p in plans])
            slow = graph.batch_size / fast < (options.min_samples_per_s or 0) * 0.9
            rank = np.where(slow, np.inf, usd * fast)
        else:
            rank = fast
        keep = np.argsort(rank, kind="stable")[:top_k]
        plans = [plans[int(k)] for k in keep]
    meta = {"states": len(prob.states), "states_used": len(prob.ideals), "all_cuts": prob.states.complete,
            "device_orders": len(orders), "candidates": len(plans)}
    return plans, meta


def dp(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    scorer = Scorer(graph, cluster, options)
    plans, meta = dp_candidates(graph, cluster, options, scorer)
    if not plans and options.objective == "cost":  # the floor cut everything: say how fast it can go
        fastest, _ = dp_candidates(graph, cluster, replace(options, objective="time", min_samples_per_s=None))
        raise scorer.infeasible(fastest, "dp")
    best = scorer.best(plans, "dp")
    return replace(best, meta={**best.meta, "dp": meta})


def warm_start(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan | None:
    """dp's plan, where the searching planners start (so that they never return a worse one), or
    None when dp finds nothing feasible."""
    try:
        return dp(graph, cluster, options)
    except InfeasibleError:
        return None
