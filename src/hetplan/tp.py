"""What a tensor-parallel stage may be (Megatron-LM, Shoeybi et al., 2019): each replica of a stage
with `tp` > 1 is a group of `tp` devices of one type on one host, splitting the stage's attention
heads, MLP units and vocabulary (`hetplan.pieces.tensor_split` says which parameters and how;
the profiler records in `Node.tp_units` the largest degree each node allows).

`tp_problems` is the check `hetplan.plan.validate_plan` runs; each problem is one line that says
what to change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetplan.cluster import Cluster
from hetplan.graph import Graph
from hetplan.schedule import get_schedule

if TYPE_CHECKING:
    from hetplan.plan import Plan, Stage


def splits_in(graph: Graph, nodes, degree: int) -> str | None:
    """Why `nodes` cannot split `degree` ways (None when they can)."""
    if degree == 1:
        return None
    units = {n: graph.by_id[n].tp_units for n in nodes if n in graph.by_id}  # unknown nodes: plan_problems says
    unknown = [n for n, u in units.items() if u is None]
    if unknown:
        return (f"graph {graph.name!r} does not say how node {unknown[0]!r} splits tensor-parallel; profile the "
                "model again (hetplan profile records it)")
    if not any(units.values()):
        return "nothing in it splits tensor-parallel (no attention, MLP or vocabulary projection); set tp 1"
    for n, u in units.items():
        if u and u % degree:
            return (f"node {n!r} splits into {u} parts (its heads, MLP units and vocabulary), which {degree} does "
                    f"not divide; use a tp that divides {u}")
    return None


def _group_problems(i: int, stage: Stage, cluster: Cluster) -> list[str]:
    out = []
    for group in stage.tp_devices:
        known = [cluster.by_id[d] for d in group if d in cluster.by_id]
        if len({d.type for d in known}) > 1 or len({d.host for d in known}) > 1:
            out.append(f"stage {i}'s tensor-parallel group {', '.join(group)} mixes device types or hosts; a group "
                       "is devices of one type on one host")
    return out


def tp_problems(plan: Plan, graph: Graph, cluster: Cluster) -> list[str]:
    """Tensor-parallel stages that cannot run as planned, one line each."""
    problems: list[str] = []
    for i, stage in enumerate(plan.stages):
        if stage.tp == 1:
            continue
        problems += _group_problems(i, stage, cluster)
        if stage.shard:
            problems.append(f"stage {i} is tensor-parallel and shards its optimizer state; hetplan does not combine "
                            "the two: set shard false or tp 1")
        if get_schedule(plan.schedule).interleaved or plan.shared_devices:
            problems.append(f"stage {i} is tensor-parallel under {plan.schedule}"
                            f"{' with shared devices' if plan.shared_devices else ''}; tensor-parallel stages run "
                            "one per group of devices, under gpipe, 1f1b or zero-bubble schedules")
        for degree in sorted(set(stage.degrees) - {1}):
            why = splits_in(graph, stage.nodes, degree)
            if why:
                problems.append(f"stage {i} cannot split {degree} ways: {why}")
    return problems
