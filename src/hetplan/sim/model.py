"""What a simulated training step is made of: the work of each stage replica and the messages
between them, built once from a graph, a cluster and a plan by the cost model.

- Micro-batches split the batch as `torch.tensor_split` does (sizes differ by at most one,
  larger ones first), and a stage's time for a micro-batch is its fixed part (what calling its
  operators costs whatever the size, when the profiler measured it) plus the rest of its batch
  time scaled by the micro-batch's share of the samples.
- Replicas of a stage take contiguous slices of every micro-batch, sized in proportion to their
  speed (`CostModel.replica_shares`), so that they finish together. A replica receives from each
  replica of a producer stage the part of the tensor whose samples the two slices share, and
  sends gradients back the same way.
- Routing: `direct` sends a tensor from the stage that makes it to every stage that uses it, so
  stages form a DAG and independent branches run in parallel. `relay` models a runtime that only
  connects neighbouring stages (torch.distributed.pipelining): a tensor that skips stages is
  passed through each stage in between, and each stage waits for the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.cluster import Cluster
from hetplan.cost import WEIGHT_COPIES, CostModel, microbatch_fractions
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.plan import Plan

ROUTINGS = ("direct", "relay")


def stage_pair_bytes(graph: Graph, plan: Plan, routing: str) -> dict[tuple[int, int], int]:
    """Bytes per batch sent from stage p to stage s, for every pair that communicates.

    Under `relay` every pair of neighbouring stages communicates, even with no bytes to send,
    because the runtime's stage s waits for stage s - 1."""
    if routing not in ROUTINGS:
        raise HetplanError(f"routing {routing!r} is unknown (allowed: {', '.join(ROUTINGS)})")
    where = plan.stage_of()
    pairs: dict[tuple[int, int], int] = {}
    if routing == "relay":
        pairs = {(k, k + 1): 0 for k in range(len(plan.stages) - 1)}
    for e in graph.edges:
        p, s = where[e.src], where[e.dst]
        if p == s:
            continue
        if routing == "direct":
            pairs[(p, s)] = pairs.get((p, s), 0) + e.bytes
        else:
            for k in range(p, s):
                pairs[(k, k + 1)] += e.bytes
    return pairs


@dataclass(frozen=True)
class Replica:
    """One device's part of a stage, for the whole batch."""

    device: str
    share: float  # of every micro-batch's samples
    lo: float  # its slice of the samples: [lo, lo + share)
    fwd_s: float  # share x the part of the stage's forward time that scales with the samples
    bwd_s: float
    act_bytes: float  # share x the stage's stashed activations, for the whole batch
    fwd_fixed_s: float = 0.0  # per forward action, whatever its size (calling the operators)
    bwd_fixed_s: float = 0.0
    optimizer_s: float = 0.0  # the optimizer step on this replica's weights, and the runtime's per-step cost


@dataclass(frozen=True)
class StageWork:
    index: int
    replicas: tuple[Replica, ...]
    weight_bytes: int  # parameters, gradients and optimizer state, on each replica
    allreduce_s: float  # ring all-reduce of the gradients over the replicas (0 for one)


@dataclass(frozen=True)
class Message:
    """Part of a stage-to-stage tensor between two replicas, as a share of a whole batch's bytes."""

    src_stage: int
    dst_stage: int
    src: str
    dst: str
    bytes_per_batch: float


@dataclass(frozen=True)
class StepModel:
    """Everything the simulators need about one plan, in seconds and bytes."""

    stages: tuple[StageWork, ...]
    messages: tuple[Message, ...]
    fractions: tuple[float, ...]  # micro-batch shares of the batch
    schedule: str
    routing: str
    batch_size: int

    @property
    def microbatches(self) -> int:
        return len(self.fractions)


def _overlap(a_lo: float, a_share: float, b_lo: float, b_share: float) -> float:
    return max(0.0, min(a_lo + a_share, b_lo + b_share) - max(a_lo, b_lo))


def build_step_model(graph: Graph, cluster: Cluster, plan: Plan, routing: str = "direct",
                     cost: CostModel | None = None) -> StepModel:
    """The work and messages of one training step of a (valid) plan."""
    cm = cost or CostModel(graph, cluster)
    by_id = graph.by_id
    stages = []
    for i, stage in enumerate(plan.stages):
        shares = cm.replica_shares(stage.nodes, stage.devices) if len(stage.devices) > 1 else {stage.devices[0]: 1.0}
        acts = sum(by_id[n].act_bytes for n in stage.nodes)
        params = sum(by_id[n].param_bytes for n in stage.nodes)
        replicas, lo = [], 0.0
        for d in stage.devices:
            dtype = cluster.device(d).type
            fwd, bwd = cm.stage_times_s(stage.nodes, dtype)
            ffix, bfix = cm.stage_fixed_s(stage.nodes, dtype) if dtype in graph.device_types else (0.0, 0.0)
            share = shares[d]
            extra = cluster.device(d).action_overhead_s  # the runtime's own cost per action
            replicas.append(Replica(d, share, lo, share * (fwd - ffix), share * (bwd - bfix), share * acts,
                                    ffix + extra, bfix + extra,
                                    cm.optimizer_s(params, dtype) + cluster.device(d).step_overhead_s))
            lo += share
        stages.append(StageWork(i, tuple(replicas), WEIGHT_COPIES * params, cm.allreduce_s(params, stage.devices)))
    messages = []
    for (p, s), nbytes in sorted(stage_pair_bytes(graph, plan, routing).items()):
        for a in stages[p].replicas:
            for b in stages[s].replicas:
                part = _overlap(a.lo, a.share, b.lo, b.share)
                if part > 1e-12:
                    messages.append(Message(p, s, a.device, b.device, nbytes * part))
    return StepModel(tuple(stages), tuple(messages), microbatch_fractions(graph.batch_size, plan.microbatches),
                     plan.schedule, routing, graph.batch_size)

