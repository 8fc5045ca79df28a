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
  speed (`CostModel.replica_shares`) in whole rows (`hetplan.rows`, the split the runtime makes),
  so that they finish together. A replica receives from each replica of a producer stage the part
  of the tensor whose samples the two slices share, and sends gradients back the same way; a
  replica with no row of a micro-batch does nothing for it.
- On a calibrated cluster a CPU replica's compute and optimizer step are slowed by the other CPU
  workers of the plan on its host (`CostModel.corun_factor`), its optimizer step is read off
  what was measured on it, and all-reduces off the measured curves (`CostModel.allreduce_s`).
- Routing: `direct` sends a tensor from the stage that makes it to every stage that uses it, so
  stages form a DAG and independent branches run in parallel. `relay` models a runtime that only
  connects neighbouring stages (hetplan's runtime): a tensor that skips stages is
  passed through each stage in between, and each stage waits for the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.cluster import Cluster
from hetplan.cost import CostModel, formulas, microbatch_fractions, weight_bytes
from hetplan.cost.formulas import action_s, replica_passes_s, replica_tail_s, split_backward_s
from hetplan.cost.syncs import SyncCost, plan_syncs
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


@dataclass(frozen=True)
class StageWork:
    index: int
    replicas: tuple[Replica, ...]
    param_bytes: int  # its parameters, on each replica
    allreduce_s: float  # the replicas' sum of the gradients only this stage has (`hetplan.cost.syncs`; 0 for one)

    @property
    def weight_bytes(self) -> int:
        """Parameters, gradients and optimizer state, on each replica."""
        return weight_bytes(self.param_bytes)


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
        params: dict[str, int] = {}
        for st in self.stages:
            for rep in st.replicas:
                params[rep.device] = params.get(rep.device, 0) + st.param_bytes
        return {d: formulas.stage_memory_bytes(params[d], acts, 1.0) for d, acts in peak_act_bytes.items()}


def _replica(cm: CostModel, cluster: Cluster, stage, rows: StepRows, k: int, p: int, acts: int,
             used: tuple[str, ...], split: bool, first_of_worker: bool) -> Replica:
    d = stage.devices[p]
    dtype = cluster.device(d).type
    slow = cm.corun_factor(d, used)  # other CPU workers of the plan on its host (calibrated clusters)
    dev = cluster.device(d)
    fwd, bwd, ffix, bfix = replica_passes_s(*cm.stage_times_s(stage.nodes, dtype),
                                            *cm.stage_fixed_s(stage.nodes, dtype), slow, dev.action_overhead_s)
    frac = [rows.rows(k, j, p) / rows.batch_size for j in range(len(rows.micro))]
    share = sum(frac)
    halves: tuple[tuple[float, ...], ...] = ((), ())
    weights = cm.stage_weight_share(stage.nodes, dtype, k == 0) if split else 0.0
    if split:
        i_s, i_fix, w_s, w_fix = split_backward_s(bwd, bfix, weights, dev.action_overhead_s)
        halves = tuple(tuple(action_s(fix, scaled, f) if f > 0 else 0.0 for f in frac)
                       for fix, scaled in ((i_fix, i_s), (w_fix, w_s)))
    return Replica(d, share, share * fwd, share * bwd, share * acts, ffix, bfix,
                   # a worker holding several stages (interleaved) pays the runtime's per-step cost once
                   replica_tail_s(cm.stage_optimizer_s(stage.nodes, d), slow,
                                  dev.step_overhead_s if first_of_worker else 0.0),
                   tuple(action_s(ffix, fwd, f) if f > 0 else 0.0 for f in frac),
                   tuple(action_s(bfix, bwd, f) if f > 0 else 0.0 for f in frac),
                   tuple(acts * f for f in frac), *halves, weights)


def _transfers_s(cluster: Cluster, src: str, dst: str, per_mb: tuple[float | None, ...]) -> tuple[float, ...]:
    """Each micro-batch's transfer on the link from src to dst (`formulas.transfer_s`); none on
    one device."""
    if src == dst:
        return ()
    link = cluster.link(src, dst)
    bw, latency, transfer_s = link.bandwidth_Bps, link.latency_s, formulas.transfer_s
    return tuple(0.0 if b is None else transfer_s(b, bw, latency) for b in per_mb)


def step_costs(graph: Graph, cluster: Cluster, plan: Plan, routing: str = "direct",
                     cost: CostModel | None = None) -> StepCosts:
    """The work and messages of one training step of a (valid) plan."""
    cm = cost or CostModel(graph, cluster)
    by_id = graph.by_id
    rows = cm.plan_rows(plan)
    syncs = plan_syncs(cm, plan)
    split = get_schedule(plan.schedule).split_backward
    own = {s.members[0][0]: s.seconds for s in syncs if len({k for k, _ in s.members}) == 1}
    holder = plan.stage_ranks
    firsts = {held[0] for held in plan.rank_stages}
    stages = []
    for k, stage in enumerate(plan.stages):
        acts = sum(by_id[n].act_bytes for n in stage.nodes)
        replicas = tuple(_replica(cm, cluster, stage, rows, k, p, acts, plan.devices, split, k in firsts)
                         for p in range(len(stage.devices)))
        stages.append(StageWork(k, replicas, graph.param_bytes_of(stage.nodes), own.get(k, 0.0)))
    messages = []
    for (a, b), nbytes in sorted(stage_pair_bytes(graph, plan, routing).items()):
        for p, src in enumerate(plan.stages[a].devices):
            for q, dst in enumerate(plan.stages[b].devices):
                shared = [rows.shared_rows(a, j, p, b, q) for j in range(plan.microbatches)]
                per_mb = tuple(nbytes * (hi - lo) / graph.batch_size if hi > lo else None for lo, hi in shared)
                secs = [_transfers_s(cluster, a_dev, b_dev, per_mb) for a_dev, b_dev in ((src, dst), (dst, src))]
                if any(x is not None for x in per_mb):
                    messages.append(Message(a, b, src, dst, per_mb, *secs))
    return StepCosts(tuple(stages), tuple(messages), microbatch_fractions(graph.batch_size, plan.microbatches),
                     plan.schedule, routing, graph.batch_size, holder, syncs)
