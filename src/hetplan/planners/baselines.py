"""Baseline planners: what people do without a planner.

- `single`: the whole model on the fastest device that fits in memory.
- `uniform`: as many stages as devices (at most one node each), each stage the same number of
  consecutive nodes of the topological order, stages given to devices in cluster order. Cutting
  a topological order into consecutive pieces always gives convex stages in pipeline order,
  because every edge goes forward in the order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.errors import InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage
from hetplan.units import fmt_bytes

if TYPE_CHECKING:
    from hetplan.planners import PlanOptions


def default_microbatches(batch_size: int, stages: int) -> int:
    """About four micro-batches per stage keeps the pipeline bubble small (GPipe, Huang et al.
    2019, find m >= 4n enough); take the largest divisor of the batch size up to that, so that
    every micro-batch has the same size."""
    if stages <= 1:
        return 1
    target = min(batch_size, 4 * stages)
    return max(d for d in range(1, target + 1) if batch_size % d == 0)


def chunk_sizes(total: int, parts: int) -> list[int]:
    """`parts` sizes that add up to `total` and differ by at most one, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def uniform(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    order = graph.topo_order
    k = min(len(cluster.devices), len(order))
    stages: list[Stage] = []
    start = 0
    for size, device in zip(chunk_sizes(len(order), k), cluster.devices, strict=False):
        stages.append(Stage(order[start:start + size], (device.id,)))
        start += size
    m = options.microbatches or default_microbatches(graph.batch_size, k)
    return Plan(tuple(stages), m, options.schedule, "uniform", options.objective)


def single(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    cm = CostModel(graph, cluster)
    m = options.microbatches or 1
    nodes = graph.topo_order
    candidates = []
    for i, device in enumerate(cluster.devices):
        plan = Plan((Stage(nodes, (device.id,)),), m, options.schedule, "single", options.objective)
        need = cm.stage_memory_bytes(plan, 0, device.id)
        candidates.append((cm.device_stage_s(nodes, device.id), i, need, plan))
    fitting = [c for c in candidates if c[2] <= cluster.devices[c[1]].mem_bytes]
    if not fitting:
        need = min(c[2] for c in candidates)
        biggest = max(cluster.devices, key=lambda d: d.mem_bytes)
        raise InfeasibleError(
            f"the whole model needs {fmt_bytes(need)} under {options.schedule} with {m} micro-batch"
            f"{'es' if m > 1 else ''}, but the largest device ({biggest.id}, {biggest.type}) has "
            f"{fmt_bytes(biggest.mem_bytes)}: split it with a pipeline planner such as uniform"
        )
    return min(fitting, key=lambda c: (c[0], c[1]))[3]
