"""Which degrees a graph allows a tensor-parallel stage (Megatron-LM, Shoeybi et al., 2019): a
stage split `tp` ways splits its attention heads, MLP units and vocabulary, so `tp` must divide
every node's `Node.tp_units`, the largest degree the profiler found the node allows
(`hetplan.pieces.tensor_split` says which parameters split and how). The rest of what a
tensor-parallel stage may be (its groups of devices, its schedule) is the plan's to check
(`hetplan.plan.validate_plan`).
"""

from __future__ import annotations

from hetplan.graph import Graph


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
