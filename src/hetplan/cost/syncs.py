"""What summing a plan's gradients costs after a step: one entry per group of `hetplan.sync`
(the replicas of a stage; the replicas of all stages that share a tied parameter), in the order
every rank runs them, each timed by `CostModel._gradient_sync_s` over its members' devices. A
stage whose replicas shard their optimizer state (`Stage.shard`) sums its own gradients by a
reduce-scatter and gathers the updated weights after its step: the same bytes in the same
number of ring steps as the all-reduce, so the same time. One that shards its gradients too
reduce-scatters them in each backward and only gathers after the step (half the time here); one
that shards its weights too, nothing after the step (`formulas.SHARD_RINGS`,
`CostModel.shard_passes_s`).

A tied parameter used by one stage only is summed with that stage's own parameters; used by
several, it leaves their own groups and is summed over all their replicas (a dense all-reduce
of its bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.cost.formulas import SHARD_RINGS
from hetplan.plan import Plan
from hetplan.sync import rank_numbers, sync_groups


@dataclass(frozen=True)
class SyncCost:
    """One group's gradient sum: its members as (stage, replica), their devices, its time."""

    members: tuple[tuple[int, int], ...]
    devices: tuple[str, ...]
    seconds: float


def spanning_tied(graph, plan: Plan) -> list[tuple[int, frozenset[int]]]:
    """The tied parameters that several stages of the plan use: (index in `graph.tied`, stages)."""
    where = plan.stage_of()
    out = []
    for i, t in enumerate(graph.tied):
        stages = frozenset(where[n] for n in t.nodes if n in where)
        if len(stages) > 1:
            out.append((i, stages))
    return out


def plan_syncs(cm, plan: Plan) -> tuple[SyncCost, ...]:
    """The plan's gradient sums of two members or more, in the order the runtime runs them (a
    stage without parameters of its own sums nothing, as the runtime's)."""
    spanning = spanning_tied(cm.graph, plan) if cm.graph.tied else []
    # a stage of one replica sums nothing of its own
    sizes = {("stage", k): _stage_bytes(cm, plan, k, spanning) for k, st in enumerate(plan.stages)
             if len(st.devices) > 1}
    holders: dict[tuple, frozenset[int]] = {key: frozenset({key[1]}) for key, b in sizes.items() if any(b)}
    for i, stages in spanning:
        holders[("tied", i)] = stages
        sizes[("tied", i)] = (cm.graph.tied[i].bytes, 0)
    if not holders:
        return ()
    out = []
    ranks = rank_numbers([st.devices for st in plan.stages], lambda d: cm.cluster.device(d).host, plan.stage_ranks)
    for group in sync_groups(holders, ranks):
        devices = tuple(plan.stages[k].devices[p] for k, p in group.members)
        workers = tuple(dict.fromkeys(devices))  # a worker holding several stages sums once
        if len(workers) < 2:
            continue
        dense = sum(sizes[key][0] * _after_step(plan, key) for key in group.params)
        index = sum(sizes[key][1] for key in group.params)
        out.append(SyncCost(group.members, devices, float(cm._gradient_sync_s(dense, index, workers))))
    return tuple(out)


def _after_step(plan: Plan, key: tuple) -> float:
    """The share of a group's sum its members run after the step (`formulas.SHARD_RINGS`)."""
    return SHARD_RINGS[plan.stages[key[1]].shard][2] if key[0] == "stage" else 1.0


def own_bytes(cm, plan: Plan, k: int) -> tuple[int, int]:
    """(bytes stage k's own gradient sum covers, bytes of its sparse rows' indices)."""
    return _stage_bytes(cm, plan, k, spanning_tied(cm.graph, plan) if cm.graph.tied else [])


def _stage_bytes(cm, plan: Plan, k: int, spanning: list[tuple[int, frozenset[int]]]) -> tuple[int, int]:
    """(bytes stage k's own all-reduce sums, bytes of its sparse rows' indices): the tied
    parameters other stages also use are summed in their own group."""
    nodes = plan.stages[k].nodes
    moved = sum(cm.graph.tied[i].bytes for i, stages in spanning if k in stages)
    return max(0, cm._optimizer_bytes(nodes) - moved), cm._index_bytes(nodes)
