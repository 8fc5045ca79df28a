"""A plan's step lowered to a table of costs: the work of each stage replica per micro-batch and
action kind, the messages between replicas with their bytes and times, the gradient sums and the
optimizer steps, built once from a graph, a cluster and a plan. The event simulator
(`hetplan.sim.engine`) puts these together into a timeline and computes no cost of its own
(`tests/test_cost_formulas.py` fails if it does).

- Micro-batches split the batch as `torch.tensor_split` does (sizes differ by at most one,
  larger ones first), and a stage's time for a micro-batch is its fixed part (what calling its
  operators costs whatever the size, when the profiler measured it) plus the rest of its batch
  time scaled by the micro-batch's share of the samples.
- Replicas of a stage take contiguous slices of every micro-batch, sized in proportion to their
  speed (`CostModel._replica_shares`) in whole rows (`hetplan.rows`, the split the runtime makes),
  so that they finish together. A replica receives from each replica of a producer stage the part
  of the tensor whose samples the two slices share, and sends gradients back the same way; a
  replica with no row of a micro-batch does nothing for it.
- On a calibrated cluster a CPU replica's compute and optimizer step are slowed by the other CPU
  workers of the plan on its host (`CostModel._corun_factor`), its optimizer step is read off
  what was measured on it, and all-reduces off the measured curves (`CostModel._allreduce_s`).
- Routing: `direct` sends a tensor from the stage that makes it to every stage that uses it, so
  stages form a DAG and independent branches run in parallel. `relay` models a runtime that only
  connects neighbouring stages (hetplan's runtime): a tensor that skips stages is
  passed through each stage in between, and each stage waits for the one before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel, formulas, in_flight_share, microbatch_fractions, weight_bytes
from hetplan.cost.formulas import (
    action_s,
    recomputed_backward_s,
    replica_passes_s,
    replica_tail_s,
    rerun_passes_s,
    split_backward_s,
)
from hetplan.cost.syncs import SyncCost, plan_syncs
from hetplan.cost.tensor import tp_bytes, tp_times_s
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.plan import Plan
from hetplan.rows import StepRows
from hetplan.schedule import get_schedule

ROUTINGS = ("direct", "relay")


def stage_pair_bytes(graph: Graph, plan: Plan, routing: str) -> dict[tuple[int, int], int]:
    """Bytes per batch sent from stage p to stage s, for every pair that communicates.

    Under `relay` every pair of neighbouring stages communicates, even with no bytes to send,
    because the runtime's stage s waits for stage s - 1."""
    if routing not in ROUTINGS:
        raise HetplanError(f"routing {routing!r} is unknown (allowed: {', '.join(ROUTINGS)})")
    where = plan.stage_of()
    crossing: dict[tuple[int, int], list] = {}
    if routing == "relay":
        crossing = {(k, k + 1): [] for k in range(len(plan.stages) - 1)}
    for e in graph.edges:
        p, s = where[e.src], where[e.dst]
        if p == s:
            continue
        if routing == "direct":
            crossing.setdefault((p, s), []).append(e)
        else:
            for k in range(p, s):
                crossing[(k, k + 1)].append(e)
    # each source's tensors once per pair of stages (`Graph.crossing_bytes`)
    return {pair: round(graph.crossing_bytes(edges)) for pair, edges in crossing.items()}


@dataclass(frozen=True)
class Replica:
    """One device's part of a stage, for the whole batch; the per-micro-batch tuples hold what
    its slice of each micro-batch costs (`hetplan.rows`: a slice with no row costs nothing)."""

    device: str
    share: float  # of the batch's samples (its rows over all micro-batches / batch size)
    fwd_s: float  # the part of its forward time that scales with the samples, whole batch
    bwd_s: float
    act_bytes: float  # its stashed activations, whole batch
    fwd_fixed_s: float = 0.0  # per forward action, whatever its size (calling the operators)
    bwd_fixed_s: float = 0.0
    optimizer_s: float = 0.0  # the optimizer step on this replica's weights, and the runtime's per-step cost
    fwd_mb_s: tuple[float, ...] = ()  # per micro-batch: its forward action
    bwd_mb_s: tuple[float, ...] = ()
    act_mb_bytes: tuple[float, ...] = ()
    # under a schedule that splits the backward (`Schedule.split_backward`): per micro-batch,
    # its inputs' gradients (I) and its weights' (W), which replace bwd_mb_s
    bwd_input_mb_s: tuple[float, ...] = ()
    bwd_weight_mb_s: tuple[float, ...] = ()
    weight_share: float = 0.0  # of its backward, the weights' part (W) where the schedule splits it
    # a stage that recomputes (`Stage.recompute`): per micro-batch, the activations its backward
    # (B, or I) rebuilds and holds while it runs; act_mb_bytes is then what it keeps between passes
    rebuilt_mb_bytes: tuple[float, ...] = ()
    # a tensor-parallel group (`hetplan.cost.tensor`): what each of its devices holds of the
    # stage's weights, gradients and optimizer state (None: the stage's `weight_bytes`)
    weight_bytes: int | None = None


@dataclass(frozen=True)
class StageWork:
    index: int
    replicas: tuple[Replica, ...]
    param_bytes: int  # its parameters, on each replica
    allreduce_s: float  # the replicas' sum of the gradients only this stage has (`hetplan.cost.syncs`; 0 for one)
    cast_bytes: int = 0  # the 16-bit copies of its weights kept for the step (mixed precision)
    sharded_bytes: int = 0  # the parameters its replicas shard (`Stage.shard`)
    shard_level: int = 1  # what they shard of them (ZeRO's level: `formulas.SHARDED_COPIES`)
    unit_bytes: int = 0  # its largest node's parameters, held whole meanwhile (levels 2 and 3)

    @property
    def weight_bytes(self) -> int:
        """Parameters, gradients and optimizer state, and any 16-bit copies, on each replica."""
        return int(weight_bytes(self.param_bytes, self.cast_bytes, len(self.replicas), self.sharded_bytes,
                                self.shard_level, self.unit_bytes))


@dataclass(frozen=True)
class Message:
    """Part of a stage-to-stage tensor between two replicas: per micro-batch, the bytes of the
    rows their slices share, or None where they share none (then nothing is sent); and the time
    of the activations' transfer (src to dst) and of the gradients' (back): 0 for nothing, empty
    on one device."""

    src_stage: int
    dst_stage: int
    src: str
    dst: str
    bytes_mb: tuple[float | None, ...]
    seconds_mb: tuple[float, ...] = ()
    back_seconds_mb: tuple[float, ...] = ()

    @property
    def bytes_per_batch(self) -> float:
        return sum(b for b in self.bytes_mb if b is not None)


@dataclass(frozen=True)
class StepCosts:
    """Everything the simulators need about one plan, in seconds and bytes."""

    stages: tuple[StageWork, ...]
    messages: tuple[Message, ...]
    fractions: tuple[float, ...]  # micro-batch shares of the batch
    schedule: str
    routing: str
    batch_size: int
    stage_ranks: tuple[int, ...]  # per stage, the pipeline rank holding it (`Plan.stage_ranks`)
    syncs: tuple[SyncCost, ...] = ()  # every gradient sum, in the order the ranks run them

    @property
    def microbatches(self) -> int:
        return len(self.fractions)

    @property
    def ranks(self) -> int:
        """Pipeline ranks (fewer than the stages where they interleave)."""
        return max(self.stage_ranks) + 1

    def peak_memory_bytes(self, peak_act_bytes: dict[str, float]) -> dict[str, int]:
        """Per device, from the activations it held at its peak: the weights, gradients and
        optimizer state of every stage it holds, plus those activations."""
        held: dict[str, int] = {}
        for st in self.stages:
            for rep in st.replicas:
                held[rep.device] = held.get(rep.device, 0) + (st.weight_bytes if rep.weight_bytes is None
                                                              else rep.weight_bytes)
        return {d: formulas.held_memory_bytes(held[d], acts) for d, acts in peak_act_bytes.items()}


def _replica_passes(cm: CostModel, plan: Plan, k: int, p: int, split: bool, share: float) -> tuple:
    """What one replica of stage k costs whatever its rows: its passes for the whole batch and
    their fixed parts as the runtime runs them (a tensor-parallel group's all-reduces of its
    `share` of the batch's rows), the weights' share of its backward (a schedule that splits it),
    its optimizer step and the weights it holds (a tensor-parallel group's share; None: the
    stage's). Replicas of one type, group size and runtime costs (and share, for groups) share
    these."""
    stage, cluster = plan.stages[k], cm.cluster
    d = stage.devices[p]
    dev = cluster.device(d)
    slow = cm._corun_factor(d, plan.devices)  # other CPU workers of the plan on its host (calibrated clusters)
    passes = replica_passes_s(*tp_times_s(cm, stage.nodes, dev.type, stage.groups[p], plan.microbatches, share),
                              slow, dev.action_overhead_s)
    gather_s, reduce_s = cm.shard_passes_s(plan, k)  # the rings of sharded gradients or weights, per pass
    passes = (passes[0], passes[1], passes[2] + gather_s, passes[3] + reduce_s)
    if stage.recompute in ("block", "selective"):  # what its backward adds: as measured per node
        again, again_fix = cm.rebuilt_forward_s(stage.nodes, dev.type, stage.recompute)
        rebuilt = rerun_passes_s(again, again_fix, slow, dev.action_overhead_s)
    else:
        rebuilt = (passes[0], passes[2])
    weights = cm._stage_weight_share(stage.nodes, dev.type, k == 0) if split else 0.0
    group, held, optimizer_s = stage.groups[p], None, cm.replica_optimizer_s(plan, k, d)
    if len(group) > 1:  # each device holds and updates its share of the weights (`cost.tensor`)
        params, casts = tp_bytes(cm.graph, stage.nodes, len(group))
        held = int(weight_bytes(params, casts, 1, 0))
        optimizer_s *= params / max(cm.graph.param_bytes_of(stage.nodes), 1)
    return passes, rebuilt, weights, optimizer_s, slow, held


def _replica(cm: CostModel, plan: Plan, rows: StepRows, k: int, p: int, kept: tuple[float, float], split: bool,
             first_of_worker: bool, alike: dict, per_mb: bool = True) -> Replica:
    """One replica of stage k: its whole batch's figures and (`per_mb`) each micro-batch's."""
    stage = plan.stages[k]
    d = stage.devices[p]
    dev = cm.cluster.device(d)
    frac = [rows.rows(k, j, p) / rows.batch_size for j in range(len(rows.micro))]
    share = sum(frac)
    key = (dev.type, len(stage.groups[p]), dev.action_overhead_s, dev.step_overhead_s, dev.optimizer_points,
           dev.host, share if len(stage.groups[p]) > 1 else None)
    if key not in alike:
        alike[key] = _replica_passes(cm, plan, k, p, split, share)
    (fwd, bwd, ffix, bfix), (rerun, rerun_fix), weights, optimizer_s, slow, held = alike[key]
    if not per_mb:  # the fast path's fold reads the whole batch's figures only
        frac = []
    halves: tuple[tuple[float, ...], ...] = ((), ())
    if split:
        i_s, i_fix, w_s, w_fix = split_backward_s(bwd, bfix, weights, dev.action_overhead_s)
        if stage.recomputes:  # the inputs' half runs the forward again first
            i_s, i_fix = recomputed_backward_s(i_s, i_fix, rerun, rerun_fix, dev.action_overhead_s)
        halves = tuple(tuple(action_s(fix, scaled, f) if f > 0 else 0.0 for f in frac)
                       for fix, scaled in ((i_fix, i_s), (w_fix, w_s)))
    acts, again = kept  # per batch: kept between its passes; rebuilt in its backward (`CostModel.held_bytes`)
    rebuilt: tuple[float, ...] = ()
    if stage.recomputes:
        bwd, bfix = recomputed_backward_s(bwd, bfix, rerun, rerun_fix, dev.action_overhead_s)
        rebuilt = tuple(again * f for f in frac)
    return Replica(d, share, share * fwd, share * bwd, share * acts, ffix, bfix,
                   # a worker holding several stages (interleaved) pays the runtime's per-step cost once
                   replica_tail_s(optimizer_s, slow, dev.step_overhead_s if first_of_worker else 0.0),
                   tuple(action_s(ffix, fwd, f) if f > 0 else 0.0 for f in frac),
                   tuple(action_s(bfix, bwd, f) if f > 0 else 0.0 for f in frac),
                   tuple(acts * f for f in frac), *halves, weights, rebuilt, held)


def _transfers_s(cluster: Cluster, src: str, dst: str, per_mb: tuple[float | None, ...]) -> tuple[float, ...]:
    """Each micro-batch's transfer on the link from src to dst (`formulas.transfer_s`); none on
    one device."""
    if src == dst:
        return ()
    link = cluster.link(src, dst)
    bw, latency, transfer_s = link.bandwidth_Bps, link.latency_s, formulas.transfer_s
    return tuple(0.0 if b is None else transfer_s(b, bw, latency) for b in per_mb)


def _stage_works(cm: CostModel, plan: Plan, rows: StepRows, syncs: tuple[SyncCost, ...],
                 per_mb: bool = True) -> tuple[StageWork, ...]:
    """Every stage's replicas (`_replica`), its own gradient sum and its memory's figures."""
    split = get_schedule(plan.schedule).split_backward
    own = {s.members[0][0]: s.seconds for s in syncs if len({k for k, _ in s.members}) == 1}
    firsts = {held[0] for held in plan.rank_stages}
    stages = []
    for k, stage in enumerate(plan.stages):
        kept = {t: cm.held_bytes(plan, k, t) for t in set(stage.degrees)}
        alike: dict = {}
        replicas = tuple(_replica(cm, plan, rows, k, p, kept[len(stage.groups[p])], split, k in firsts, alike, per_mb)
                         for p in range(len(stage.devices)))
        stages.append(StageWork(k, replicas, cm.graph.param_bytes_of(stage.nodes), own.get(k, 0.0),
                                cm.graph.cast_bytes_of(stage.nodes), cm.sharded_bytes(plan, k), stage.shard or 1,
                                cm.shard_unit_bytes(plan, k)))
    return tuple(stages)


def _shared_rows(rows: StepRows, a: int, b: int) -> np.ndarray:
    """(micro-batch, replica p of stage a, replica q of stage b): the rows the two replicas'
    slices of each micro-batch share (`StepRows.shared_rows`, for every pair at once)."""
    first, other = np.asarray(rows.slices[a]), np.asarray(rows.slices[b])  # (m, replicas, 2)
    lo = np.maximum(first[:, :, None, 0], other[:, None, :, 0])
    hi = np.minimum(first[:, :, None, 1], other[:, None, :, 1])
    return np.maximum(hi - lo, 0)


def step_costs(graph: Graph, cluster: Cluster, plan: Plan, routing: str = "direct",
                     cost: CostModel | None = None) -> StepCosts:
    """The work and messages of one training step of a (valid) plan."""
    cm = cost or CostModel(graph, cluster)
    rows = cm.plan_rows(plan)
    syncs = plan_syncs(cm, plan)
    stages = _stage_works(cm, plan, rows, syncs)
    messages = []
    for (a, b), nbytes in sorted(stage_pair_bytes(graph, plan, routing).items()):
        shared = _shared_rows(rows, a, b)
        for p, q in zip(*(x.tolist() for x in np.nonzero(shared.any(axis=0))), strict=True):
            per_mb = [nbytes * int(n) / graph.batch_size if n else None for n in shared[:, p, q]]
            src, dst = plan.stages[a].devices[p], plan.stages[b].devices[q]
            # a tensor-parallel group's first device sends to every device of the other's group
            copies = (len(plan.stages[b].groups[q]), len(plan.stages[a].groups[p]))
            secs = [_transfers_s(cluster, a_dev, b_dev, tuple(None if x is None else x * c for x in per_mb))
                    for (a_dev, b_dev), c in zip(((src, dst), (dst, src)), copies, strict=True)]
            messages.append(Message(a, b, src, dst, tuple(per_mb), *secs))
    return StepCosts(stages, tuple(messages), microbatch_fractions(graph.batch_size, plan.microbatches),
                     plan.schedule, routing, graph.batch_size, plan.stage_ranks, syncs)


def fold_plan(cm: CostModel, plan: Plan) -> dict[str, np.ndarray]:
    """`lower_chain`'s inputs for any plan as a chain (the fast path, `hetplan.sim.fast`):
    replicated stages folded into one stage (the slowest replica; a cut's transfers as long as
    its busiest interface is busy, `CostModel._busiest_interface_s`, each way) and skipping
    tensors relayed (an approximation where the plan has either; exact otherwise). The stages are the event
    simulator's (`step_costs`); the messages are summed per pair of devices, never listed."""
    graph, cluster = cm.graph, cm.cluster
    rows = cm.plan_rows(plan)
    syncs = plan_syncs(cm, plan)
    stages = _stage_works(cm, plan, rows, syncs, per_mb=False)
    n = len(stages)
    pairs: list[dict[tuple[str, str], float]] = [{} for _ in range(n - 1)]  # the activations
    backs: list[dict[tuple[str, str], float]] = [{} for _ in range(n - 1)]  # their gradients
    lat = np.zeros(n - 1)
    for (a, b), nbytes in stage_pair_bytes(graph, plan, "relay").items():
        totals = _shared_rows(rows, a, b).sum(axis=0) * (nbytes / graph.batch_size)
        for p, q in zip(*(x.tolist() for x in np.nonzero(totals)), strict=True):
            src, dst, total = plan.stages[a].devices[p], plan.stages[b].devices[q], float(totals[p, q])
            if src != dst and total > 0:
                # a group's first device sends to every device of the other's group (`step_costs`):
                # the activations as many times as the receiving group has devices, the gradients
                # back as many as the sending one
                for way, pair, copies in ((pairs, (src, dst), len(plan.stages[b].groups[q])),
                                          (backs, (dst, src), len(plan.stages[a].groups[p]))):
                    way[a][pair] = way[a].get(pair, 0.0) + total * copies
                lat[a] = max(lat[a], cluster.link(src, dst).latency_s)

    def slowest(field: str) -> np.ndarray:
        return np.array([max(getattr(r, field) for r in st.replicas) for st in stages])

    spanning = [sync for sync in syncs if len({k for k, _ in sync.members}) > 1]  # tied parameters
    members = np.zeros((len(spanning), n), dtype=bool)
    for g, sync in enumerate(spanning):
        members[g, [k for k, _ in sync.members]] = True
    split = {}
    if get_schedule(plan.schedule).split_backward:  # as replica 0 of each stage splits it
        split = {"weight_share": np.array([st.replicas[0].weight_share for st in stages]),
                 "action_overhead_s": np.array([cluster.device(st.replicas[0].device).action_overhead_s
                                                for st in stages])}
    return {"fwd_s": slowest("fwd_s"), "bwd_s": slowest("bwd_s"),
            "send_s": np.array([cm._busiest_interface_s(p) for p in pairs]),
            "back_send_s": np.array([cm._busiest_interface_s(p) for p in backs]), "latency_s": lat,
            "fwd_fixed_s": slowest("fwd_fixed_s"), "bwd_fixed_s": slowest("bwd_fixed_s"),
            "allreduce_s": np.array([st.allreduce_s for st in stages]),
            "optimizer_s": slowest("optimizer_s"), "tied_members": members,
            "tied_s": np.array([sync.seconds for sync in spanning]), **split}


# The array form: P plans at once, each a chain of stages on one device each (a replicated
# stage folded into one by its caller), for the fast path (`hetplan.sim.fast`). Arrays put the
# plans last, so that one micro-batch's action is one row of P numbers.

@dataclass(frozen=True)
class ChainCosts:
    """P chain plans' steps: every action and transfer per micro-batch, the tail of each stage.

    actions_s: per block of the schedule's action kinds (F, then B, or I and W), (stages, m, P).
    transfer_s: (stages - 1, m, P): a micro-batch's activations across boundary r; back_s: its
    gradients back (None: as long; a tensor-parallel group's first device sends to each device of
    the other's group, so they differ where the two stages' groups do); sent: (stages - 1, P),
    False where nothing crosses. After a stage's last
    action: allreduce_s (stages, P), the tied sums (tied_members (G, stages, P) over tied_s
    (G, P), one after the other), then optimizer_s (stages, P)."""

    actions_s: tuple[np.ndarray, ...]
    transfer_s: np.ndarray
    sent: np.ndarray
    optimizer_s: np.ndarray | None = None
    allreduce_s: np.ndarray | None = None
    tied_members: np.ndarray | None = None
    tied_s: np.ndarray | None = None
    back_s: np.ndarray | None = None

    @property
    def stages(self) -> int:
        return self.actions_s[0].shape[0]


def _plans_last(x, p: int, n: int) -> np.ndarray | None:
    return None if x is None else np.asarray(x, dtype=float).reshape(p, n).T


def lower_chain(schedule: str, fractions: Sequence[float], fwd_s, bwd_s, send_s, latency_s, *, fwd_fixed_s=None,
                bwd_fixed_s=None, allreduce_s=None, optimizer_s=None, tied_members=None, tied_s=None,
                weight_share=None, action_overhead_s=None, back_send_s=None) -> ChainCosts:
    """P chains' whole-batch figures, (P, stages) each, lowered to every micro-batch's action
    and transfer: fwd_s, bwd_s the parts that scale with the samples (fixed parts apart, None for
    0); send_s (P, stages - 1) the batch's bytes over each boundary's bandwidth (back_send_s the
    gradients', where they differ), latency_s 0 where nothing is sent; weight_share and
    action_overhead_s for a schedule that splits the backward (`formulas.split_backward_s`;
    bwd_fixed_s then includes the overhead)."""
    f = np.asarray(fractions, dtype=float)[None, :, None]
    fwd = np.atleast_2d(np.asarray(fwd_s, dtype=float))
    p, n = fwd.shape
    actions = []
    for scaled, fixed in _pass_blocks(schedule, fwd, fwd_fixed_s, bwd_s, bwd_fixed_s, weight_share, action_overhead_s):
        fixed = 0.0 if fixed is None else np.asarray(fixed, dtype=float).reshape(p, n).T[:, None, :]
        scaled = np.atleast_2d(np.asarray(scaled, dtype=float)).T[:, None, :]
        actions.append(np.broadcast_to(action_s(fixed, scaled, f), (n, f.size, p)))
    send = np.asarray(send_s, dtype=float).reshape(p, n - 1).T
    lat = np.broadcast_to(np.asarray(latency_s, dtype=float), (p, n - 1)).T
    members = None if tied_members is None else np.asarray(tied_members, dtype=bool).reshape(p, -1, n)
    back = None if back_send_s is None else np.asarray(back_send_s, dtype=float).reshape(p, n - 1).T
    return ChainCosts(tuple(actions), action_s(lat[:, None, :], send[:, None, :], f), send > 0,
                      _plans_last(optimizer_s, p, n), _plans_last(allreduce_s, p, n),
                      None if members is None else members.transpose(1, 2, 0),
                      None if tied_s is None else np.asarray(tied_s, dtype=float).reshape(p, -1).T,
                      None if back is None else action_s(lat[:, None, :], back[:, None, :], f))


def _pass_blocks(schedule: str, fwd, fwd_fixed, bwd, bwd_fixed, weight_share, overhead) -> list[tuple]:
    """(scaled, fixed) of each block of actions: F, then B or I and W."""
    if not get_schedule(schedule).split_backward:
        return [(fwd, fwd_fixed), (bwd, bwd_fixed)]
    p = fwd.shape[0]
    share = np.zeros(fwd.shape) if weight_share is None else np.asarray(weight_share, dtype=float).reshape(p, -1)
    fixed = 0.0 if bwd_fixed is None else np.asarray(bwd_fixed, dtype=float)
    over = 0.0 if overhead is None else np.asarray(overhead, dtype=float)
    i_s, i_fix, w_s, w_fix = split_backward_s(np.atleast_2d(np.asarray(bwd, dtype=float)), fixed, share, over)
    return [(fwd, fwd_fixed), (i_s, np.broadcast_to(i_fix, fwd.shape)), (w_s, np.broadcast_to(w_fix, fwd.shape))]


@dataclass(frozen=True)
class ChainStages:
    """P chains of n stages, one device each (an index of `cluster.devices`, (P, n)), as the sums
    of each stage's nodes on its device's type, for the whole batch: what a caller adds up along
    a topological order (`hetplan.sim.chains`)."""

    devices: np.ndarray
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    fwd_fixed_s: np.ndarray
    bwd_fixed_s: np.ndarray
    bwd_weighted_s: np.ndarray  # the backward of its nodes with weights
    optimizer_s: np.ndarray  # its weights' optimizer step on its device (`CostModel._optimizer_step_s`)
    param_bytes: np.ndarray  # a tied parameter once
    act_bytes: np.ndarray
    cut_bytes: np.ndarray  # (P, n - 1): a batch's bytes across each boundary
    tied_members: np.ndarray | None = None  # (P, G, n): the stages each tied parameter spans
    tied_s: np.ndarray | None = None  # (P, G): its sum (`CostModel._gradient_sync_s`)
    cast_bytes: np.ndarray | float = 0.0  # 16-bit copies of its weights (mixed precision)


@dataclass(frozen=True)
class ChainResources:
    """What P chains hold and cost besides time: per stage its peak memory, whether every stage
    fits, the devices' price per hour, the busiest link's time sending in a step, and PipeDream's
    steady state (`CostModel.bottleneck_s`)."""

    peak_memory_bytes: np.ndarray  # (P, n)
    fits: np.ndarray  # (P,)
    usd_per_hour: np.ndarray  # (P,)
    link_busy_s: np.ndarray  # (P,)
    bottleneck_s: np.ndarray  # (P,)

    def usd_per_step(self, step_s: np.ndarray) -> np.ndarray:
        return formulas.usd_per_step(self.usd_per_hour, step_s)


class ChainDevices:
    """A cluster's devices as arrays by index of `cluster.devices`, for lowering chains."""

    def __init__(self, cm: CostModel) -> None:
        cluster = cm.cluster
        ids = cluster.ids
        self.bandwidth_Bps = np.array([[cluster.link(a, b).bandwidth_Bps for b in ids] for a in ids])
        self.latency_s = np.array([[cluster.link(a, b).latency_s for b in ids] for a in ids])
        self.mem_bytes = np.array([d.mem_bytes for d in cluster.devices], dtype=float)
        self.usd_per_hour = np.array([d.usd_per_hour for d in cluster.devices])
        self.action_overhead_s = np.array([d.action_overhead_s for d in cluster.devices])
        self.step_overhead_s = np.array([d.step_overhead_s for d in cluster.devices])
        self._host = np.array([cluster.hosts.index(d.host) for d in cluster.devices])
        self._cpu = np.array([cm._is_cpu(d.id) for d in cluster.devices])
        slowdown = cluster.calibration.corun_slowdown if cluster.calibration is not None else ()
        self._corun = np.array([formulas.corun_factor(k, slowdown) for k in range(len(ids) + 2)]) if slowdown else None

    def corun(self, devices: np.ndarray) -> np.ndarray:
        """(P, n) `CostModel._corun_factor` of each stage's device among the plan's devices."""
        if self._corun is None:
            return np.ones(devices.shape)
        same = (self._host[devices][:, :, None] == self._host[devices][:, None, :]) & self._cpu[devices][:, None, :]
        # distinct devices only: a device holding two stages is one worker
        dup = np.triu(devices[:, :, None] == devices[:, None, :], 1).any(axis=1)
        busy = (same & ~dup[:, None, :]).sum(axis=2)
        return np.where(self._cpu[devices], self._corun[busy], 1.0)


def chain_costs(dev: ChainDevices, st: ChainStages, schedule: str, batch_size: int,
                microbatches: int) -> tuple[ChainCosts, ChainResources]:
    """P chains lowered as `step_costs` lowers one plan (the same formulas, in arrays)."""
    p, n = st.devices.shape
    slow = dev.corun(st.devices)
    overhead = dev.action_overhead_s[st.devices]
    fwd, bwd, ffix, bfix = replica_passes_s(st.fwd_s, st.bwd_s, st.fwd_fixed_s, st.bwd_fixed_s, slow, overhead)
    src, dst = st.devices[:, :-1], st.devices[:, 1:]
    send = formulas.wire_s(st.cut_bytes, dev.bandwidth_Bps[src, dst])
    lat = np.where(st.cut_bytes > 0, dev.latency_s[src, dst], 0.0)
    split = {}
    if get_schedule(schedule).split_backward:
        split = {"weight_share": formulas.weight_share(st.bwd_weighted_s, st.bwd_s, np.arange(n)[None, :] == 0),
                 "action_overhead_s": overhead}
    costs = lower_chain(schedule, microbatch_fractions(batch_size, microbatches), fwd, bwd, send, lat,
                        fwd_fixed_s=ffix, bwd_fixed_s=bfix, tied_members=st.tied_members, tied_s=st.tied_s,
                        optimizer_s=replica_tail_s(st.optimizer_s, slow, dev.step_overhead_s[st.devices]), **split)
    share = np.array([in_flight_share(schedule, n, r, batch_size, microbatches) for r in range(n)])
    peak = formulas.stage_memory_bytes_array(st.param_bytes, st.act_bytes, share, st.cast_bytes)
    # each boundary's link carries the batch's activations one way and its gradients (as many
    # bytes) the other, one message per micro-batch
    busy = (send + microbatches * lat).max(axis=1) if n > 1 else np.zeros(p)
    # one device per stage: no all-reduce, one lane per cut
    steady = np.maximum((st.fwd_s + st.bwd_s).max(axis=1),
                        formulas.steady_cut_s(st.cut_bytes, dev.bandwidth_Bps[src, dst], 1).max(axis=1)
                        if n > 1 else 0.0)
    return costs, ChainResources(peak, (peak <= dev.mem_bytes[st.devices]).all(axis=1),
                                 dev.usd_per_hour[st.devices].sum(axis=1), busy, steady)
