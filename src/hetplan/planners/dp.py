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
  of every micro-batch is proportional to its speed), or, where they are devices of one type on
  one host and the graph's nodes split so (`tensor_groups.type_degrees`), as replicas of t of
  them each in a tensor-parallel group; devices left at the end stay unused.
  Every assignment of disjoint device groups to stages is such a run of some order, so on small
  clusters, where all orders are tried, the search over devices is complete.
- Communication: the bytes crossing each cut (each tensor once, however many consumers it has
  beyond the cut: `Graph.crossing_bytes`), sent forward and (as gradients) back, always
  counted, routed as the runtime routes rows (`CostModel._routed_cut_s`: replica p sends to the
  replicas of the next stage whose slices of the micro-batch overlap its own, the transfers
  sharing the interfaces they cross, so replicas in line on one host talk inside it); the
  `throughput` objective prices a cut as `CostModel.bottleneck_s` does (`cut_Bps`).
- Every figure of a stage (its time on its group with the runtime's cost per action and
  co-running, its memory, its gradient sum and optimizer step, its cut's time per byte) is read
  from the table of stage options (`hetplan.cost.stage_table`), for every pair of states and
  group of an order at once.
- Memory: a stage whose replica would not fit under the schedule (4x its parameters, an r-th of
  Adam's state where its r replicas shard it, plus its stashed activations: all micro-batches
  under GPipe, min(m, stages after it + 1) under 1F1B) is not allowed. With `--recompute
  where-needed` (the default) every stage is also tried recomputing its
  activations at both units (`Stage.recompute`: its forward's time again; it keeps its cuts'
  bytes, or per block each node's input, per micro-batch in flight and one micro-batch's
  activations of the stage, or of its largest node, the fewest micro-batches that allows
  by `dp_program._recompute_microbatches`), and the fronts keep whichever labels are not
  dominated: dp chooses per stage.
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
  (the runtime splits rows whole, so a replica would idle in every micro-batch).

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
Pairs of states with no subset relation are skipped; the fronts of one state at every position
are made at once in arrays, from every option that starts there (`dp_program`); a partial plan is cut
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
to a thousand GPUs come from (`bench/llm_plans.py`). It ranks by its own model, so an option more
can push out of its best few a plan the simulator prefers: where selective recomputation,
sequence parallelism or split activations of groups are allowed, it runs on the problem without
them too (`_per_type_scorers`).

Finally the best 256 (label, m) pairs by T(m) (or price, for `cost`) over all orders are turned
into plans and re-ranked by the fast path (`hetplan.sim.fast`, the schedule's exact recurrence for
chains), and the TOP_K best of those join the candidates of the other programs and the baselines
(`hetplan.planners.candidates`: all ranked by the fast path, the best that fit scored by the event
simulator, the best by the user's objective polished and returned, with where it came from and why
the runners-up lost in its meta, `meta["dp"]["explain"]`). Assumptions: compute time linear in the
micro-batch size; the latency between the two adjacent devices of two stages stands for all; a
cut's transfers all run at once at its bandwidth (the simulator's interfaces also serialise what
shares a sender, a receiver or a host's interface in time); all-reduces do not overlap anything;
tensors that skip stages are charged on every cut they cross (relayed, as the runtime sends them).
The event simulator's re-scoring corrects these for the plans it sees, not for the ones the
program discarded.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Plan, plan_problems
from hetplan.planners import baselines
from hetplan.planners.candidates import Candidates
from hetplan.planners.devices import device_orders
from hetplan.planners.dp_program import (
    SMALL_CLUSTER,
    label_plan,
    model_step_s,
    order_setup,
    run_order,
    useful_microbatches,
    usual_microbatches,
)
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.objectives import objective
from hetplan.planners.options import PlanOptions
from hetplan.planners.refine import polish
from hetplan.planners.scale import scale_candidates
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import StateSums
from hetplan.planners.tensor_groups import type_degrees

MAX_STATES = 160
TOP_K = 12
BOUND_SLACK = 0.05  # partial plans within this of the best found so far are kept (the model is not exact)
BASELINE_SLACK = 0.25  # the program's model may find a baseline's plan this much slower than simulated
POOL = 256  # candidates the fast path re-ranks before the event simulator scores TOP_K of them
PER_SHAPE = 32  # of those, at most this many with the same replicas per stage (so the pool is not one shape's)
SUB_CLUSTER = 16  # dp also plans on the first hosts of a big cluster, up to this many devices
BIG_CLUSTER_STATES = 64  # past SUB_CLUSTER devices, the whole cluster's program keeps this many cut states
ZOOM_PLANS = 4  # when cut states were left out, a second pass keeps every state near the cuts of this many plans,
ZOOM_WIDTH = 6  # this many on either side of each by compute time
# The program gives each replica its exact share of a micro-batch; the runtime splits whole rows,
# so with few rows per replica the program is optimistic (8 replicas of two speeds sharing 16
# rows: 11%) and such a plan does not tighten the bound unless its replicas get this many rows
ROUNDING_ROWS = 8
DEVICE_PROGRAM = 32  # past this many devices, the device-order program runs on the host prefixes only
SUB_CLUSTER_KEEP = 4  # of each host prefix's candidates, the best this many compete on the whole cluster
SCALE_STATES = 64  # cut states of the per-type program (`hetplan.planners.scale`)


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


def _first_bounds(graph: Graph, cluster: Cluster, options: PlanOptions, scorer: Scorer,
                  known: Sequence[Plan] = ()) -> _Bounds:
    """The first bounds (`Objective.bound`): on the step, the simulated steps of the baselines
    (with slack: the program's model may see them slower) and the program's own steps of the
    `known` plans it made (`model_s`); on the steady state, theirs, simulated (the program's
    model of it is exact); under a floor, the step it allows."""
    kind = objective(options).bound
    bounds = _Bounds(kind)
    if kind == "floor":
        bounds.step_s = graph.batch_size / options.min_samples_per_s
        return bounds
    if kind not in ("step", "steady"):
        return bounds
    if kind == "step":  # the program's own step of the known plans it made (no simulation needed)
        bounds.step_s = min([p.meta["model_s"] * (1.0 + BOUND_SLACK) for p in known
                             if "model_s" in p.meta and options.allows(p)], default=math.inf)
    for plan in [*baseline_plans(graph, cluster, replace(options, microbatches=None)), *known]:
        if not (options.allows(plan) and scorer.fits(plan)) or (kind == "step" and "model_s" in plan.meta):
            continue
        est = scorer.estimate(plan)
        if est.feasible:
            if kind == "steady":
                bounds.steady_s = min(bounds.steady_s, est.bottleneck_s)
            else:
                bounds.step_s = min(bounds.step_s, est.step_s * (1.0 + BASELINE_SLACK))
    return bounds


@dataclass
class _Bounds:
    """What a partial plan must beat (`Objective.bound` says which): the step, the price per step,
    the steady state. A plan found tightens the objective's own."""

    kind: str
    step_s: float = math.inf
    usd: float = math.inf
    steady_s: float = math.inf

    def see(self, lab, m: int, step_s: float, usd: float, batch_size: int) -> None:
        if self.kind == "floor" and step_s <= self.step_s:
            self.usd = min(self.usd, usd * (1.0 + BOUND_SLACK))
        elif self.kind == "steady":
            self.steady_s = min(self.steady_s, lab.thr_s)
        elif self.kind == "step" and batch_size // m >= ROUNDING_ROWS * lab.k_max:
            self.step_s = min(self.step_s, step_s * (1.0 + BOUND_SLACK))


def _pool(prob: StateSums, scorer: Scorer, orders: list[tuple[str, ...]], choices: tuple[int, ...],
          options: PlanOptions, known: Sequence[Plan] = (), stats: dict | None = None) -> list[tuple]:
    """(key, order, label, m) of every front label and allowed m over all orders, best first by
    the program's model (`Objective.rank`). Bounds cut every partial plan that cannot beat the
    best found so far: the first bounds, then what the orders done found. Each order runs with
    the usual micro-batch counts, and again with every count where memory cut a label that more
    micro-batches would have let fit (in one pass, those would crowd the fronts: the model is
    optimistic about many small ones)."""
    graph, table = scorer.graph, prob.table
    bounds = _first_bounds(graph, scorer.cluster, options, scorer, known)
    degrees = type_degrees(graph, scorer.cluster, options.max_tp)
    usual = max(usual_microbatches(choices))
    floor = (options.min_samples_per_s or 0) * 0.9
    pool, cache = [], {}
    for order in orders:
        setup = order_setup(prob, scorer, order, options, degrees, cache)
        passes = [(usual, False)]
        while passes:
            m_max, many = passes.pop(0)
            labels, program = run_order(prob, scorer, order, options, m_max, bounds.step_s, bound_usd=bounds.usd,
                                        bound_thr=bounds.steady_s, setup=setup)
            if stats is not None:
                stats["labels_extended"] = stats.get("labels_extended", 0) + program.extended
            if not many and program.short_of_microbatches and max(choices) > usual:
                passes.append((max(choices), True))
            for lab in labels:
                for m in useful_microbatches(lab, choices, graph.batch_size, many) if lab.m_req > usual or not many \
                        else ():
                    t = float(model_step_s(lab, m))
                    usd = float(table.usd_per_step(lab.usd_per_hour, t))
                    pool.append((objective(options).rank(t, usd, lab.thr_s, graph.batch_size / max(t, 1e-30) < floor),
                                 order, lab, m))
                    bounds.see(lab, m, t, usd, graph.batch_size)
    pool.sort(key=lambda x: x[0])
    return pool


def dp_candidates(graph: Graph, cluster: Cluster, options: PlanOptions, scorer: Scorer | None = None,
                  top_k: int = TOP_K, max_states: int = MAX_STATES,
                  known: Sequence[Plan] = ()) -> tuple[list[Plan], dict]:
    """The dynamic program's best plans by its own model (at most `top_k`), and facts about the
    run for the plan's meta. The program's model ranks the pool; the fast path re-ranks the best
    POOL of them; the event simulator (the caller) scores the top_k of those. `known` plans (of
    this cluster) tighten the first bound, as the baselines do."""
    scorer = scorer or Scorer(graph, cluster, options)
    prob = StateSums(graph, scorer.cost, max_states)
    table = prob.table
    speed = {t: 1.0 / max(float(table.whole_s(prob.kind_of_type(t), 0, table.last)), 1e-30) for t in prob.types}
    orders = device_orders(cluster, speed, objective(options).cheap_first)
    stats: dict = {}
    plans = scorer.shortlist(_program_plans(prob, scorer, orders, options, known, stats), top_k)
    meta = {"states": len(prob.states), "states_used": len(prob.ideals), "all_cuts": prob.states.complete,
            "device_orders": len(orders), **stats}
    if len(prob.ideals) < len(prob.states) and plans:
        # states were left out: a second pass over every state near where the best plans cut
        around = sorted({i for p in plans[:ZOOM_PLANS] for i in prob.cut_indices([s.nodes for s in p.stages])})
        near = StateSums(graph, scorer.cost, max_states, around=around, width=ZOOM_WIDTH)
        plans = scorer.shortlist(plans + _program_plans(near, scorer, orders, options, known, stats), top_k)
        meta["zoom_states"] = len(near.ideals)
    meta["candidates"] = len(plans)
    return plans, meta


def _program_plans(prob: StateSums, scorer: Scorer, orders: list[tuple[str, ...]], options: PlanOptions,
                   known: Sequence[Plan], stats: dict) -> list[Plan]:
    """The plans of the pool's best labels (at most POOL, at most PER_SHAPE of one shape), each
    with the program's step in its meta (`model_s`)."""
    plans, seen, shapes = [], set(), Counter()
    for _, order, lab, m in _pool(prob, scorer, orders, microbatch_choices(scorer.graph, options), options, known,
                                  stats):
        plan = label_plan(prob, order, lab, m, options)
        k, shape = Scorer.key(plan), tuple(len(st.devices) for st in plan.stages)
        if k not in seen and shapes[shape] < PER_SHAPE:
            seen.add(k)
            shapes[shape] += 1
            plans.append(replace(plan, meta={"model_s": round(float(model_step_s(lab, m)), 9)}))
            if len(plans) >= POOL:
                break
    return plans


def host_prefixes(cluster: Cluster) -> list[Cluster]:
    """The clusters of the first 1, 2, 4, ... hosts (in the cluster's order) of a cluster bigger
    than SMALL_CLUSTER, with at most SUB_CLUSTER devices and fewer than it has. dp plans on each
    too: there a stage may take all the devices as replicas (on the big cluster at most
    BIG_CLUSTER_REPLICAS), so adding hosts never makes dp's plan worse than the smaller
    cluster's (resnet50: 40.5 ms on 8 V100s, 88.6 ms once 8 more devices were added)."""
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
    found = Candidates(scorer)
    subs, meta = _programs(graph, cluster, options, scorer, found)
    for name, plan in _baselines_as_dp(graph, cluster, options):
        found.add([plan], f"baseline {name}")
    if not any(scorer.estimate(p).feasible for p in found.simulated()) and not options.microbatches:
        # nothing fits: so that the error names the shortfall at the smallest micro-batch, the
        # time-balanced pipeline with one row per micro-batch is tried too
        for name, plan in _baselines_as_dp(graph, cluster, replace(options, microbatches=graph.batch_size)):
            found.add([plan], f"baseline {name}, one row a micro-batch")
    picked = found.best("dp")
    best = polish(scorer, picked, microbatch_choices(graph, options))
    meta["sub_clusters"] = [len(sub.devices) for sub in subs]
    meta["explain"] = found.explanation(best, picked)
    return replace(best, meta={**{k: v for k, v in best.meta.items() if k != "model_s"}, "dp": meta})


def _programs(graph: Graph, cluster: Cluster, options: PlanOptions, scorer: Scorer,
              found: Candidates) -> tuple[list[Cluster], dict]:
    """The programs' candidates into `found`: the label program on the first hosts, smallest
    first (each bounded by the ones before: their plans run here too), and on the cluster; the
    per-type program past SMALL_CLUSTER devices; under a floor, the fastest plans too."""
    states = MAX_STATES if len(cluster.devices) <= SUB_CLUSTER else BIG_CLUSTER_STATES
    subs, known = host_prefixes(cluster), []
    for sub in subs:
        plans = dp_candidates(graph, sub, options, known=known)[0][:SUB_CLUSTER_KEEP]
        found.add(plans, f"label program on the first {len(sub.devices)} devices")
        known += plans + [p for _, p in _baselines_as_dp(graph, sub, options)]
    device_program = len(cluster.devices) <= DEVICE_PROGRAM
    meta: dict = {"states": 0, "states_used": 0, "all_cuts": False, "device_orders": 0}
    if device_program:
        plans, meta = dp_candidates(graph, cluster, options, scorer, max_states=states, known=known)
        found.add(plans, "label program")
    if len(cluster.devices) > SMALL_CLUSTER:  # wide stages of one type, counted per type (`scale`)
        meta["scale_candidates"] = 0
        for sc, label in _per_type_scorers(scorer):
            wide = scale_candidates(sc, StateSums(sc.graph, sc.cost, SCALE_STATES),
                                    type_degrees(graph, cluster, options.max_tp))
            found.add(wide, label)
            meta["scale_candidates"] += len(wide)
    if objective(options).cheap_first and device_program:
        # the fastest plans are candidates too: the program's model, against which the floor is
        # checked first, can see a plan that reaches it as too slow (ctr-dnn on eight CPU
        # workers: 154,000 samples/s simulated, and nothing found at a floor of 145,000)
        fastest, _ = dp_candidates(graph, cluster, replace(options, objective="time", min_samples_per_s=None),
                                   max_states=states, known=known)
        found.add([replace(p, objective=options.objective) for p in fastest], "label program, fastest plans")
    return subs, meta


def _per_type_scorers(scorer: Scorer) -> list[tuple[Scorer, str]]:
    """The per-type program's problems: the one asked, and where it may recompute selectively,
    make groups sequence-parallel or split a group's activations, the same without those, each
    group's activations counted whole on every device (its plans are plans of the graph asked).
    The program ranks by its own model, which puts deep tensor-parallel layouts ahead of what the
    simulator finds, so what lets more of them fit can push a plan the simulator prefers out of
    its best few (BENCHMARKS.md: the 70B problem; Llama-3-8B bf16 on 32 + 96 once the head's
    logits split); with both sets the candidates of the narrower one are still simulated."""
    graph, options = scorer.graph, scorer.options
    split = any(n.act_split_share or n.act_sequence_share for n in graph.nodes)
    if not (graph.selective_measured or options.sp or split):
        return [(scorer, "per-type program")]
    plain = replace(graph, nodes=tuple(replace(n, selective_keep_bytes=None, selective_rebuilt_bytes=None,
                                               act_split_share=0.0, act_sequence_share=0.0) for n in graph.nodes))
    narrow = Scorer(plain, scorer.cluster, replace(options, sequence_parallel="never"))
    return [(scorer, "per-type program"),
            (narrow, "per-type program, without selective recomputation, sequence parallelism nor split "
                     "activations")]


def _baselines_as_dp(graph: Graph, cluster: Cluster, options: PlanOptions) -> list[tuple[str, Plan]]:
    """The baselines' plans, as dp's candidates (with their names): the program's model can rank
    a pipeline above data parallelism that the simulator finds slower (resnet18 on 8 V100s:
    108.7 ms against 100.2 ms). Not under a floor, which the program applies itself."""
    if objective(options).floor:
        return []
    return [(p.planner, replace(p, planner="dp", objective=options.objective))
            for p in baseline_plans(graph, cluster, options)]


def warm_start(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan | None:
    """dp's plan, where the searching planners start (so that they never return a worse one), or
    None when dp finds nothing feasible."""
    try:
        return dp(graph, cluster, options)
    except InfeasibleError:
        return None
