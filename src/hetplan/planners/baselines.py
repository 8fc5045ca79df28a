"""Baseline planners: what people do without a planner.

- `single`: the whole model on the fastest device that fits in memory.
- `data-parallel`: bulk-synchronous data parallelism (the baseline of TAPP): every device that
  can hold the whole model gets a slice of the batch in proportion to its speed, and the
  gradients are all-reduced at the end of the step.
- `uniform`: as many stages as devices (at most one node each), each stage the same number of
  consecutive nodes of the topological order, stages given to devices in cluster order.
- `params`: the same, with stages balanced by parameter bytes (DeepSpeed's default
  `partition_method="parameters"`): the split of the order that minimises the largest stage.
- `balanced-time`: the same, with stages balanced by profiled time (forward + backward on the
  type the graph was profiled on) by the block-partition algorithm of Bárány and Grinberg
  ("Block partitions of sequences", Israel J. Math. 2015), which torchgpipe's
  `balance_by_time` uses.

Cutting a topological order into consecutive pieces always gives convex stages in pipeline
order, because every edge goes forward in the order. None of these look at the devices' speeds
(except data-parallel's split) or at communication: that is what the planners improve on.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.cost.stage_table import StageTable
from hetplan.errors import InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage
from hetplan.units import fmt_bytes

if TYPE_CHECKING:
    from hetplan.planners.options import PlanOptions


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


def _pipeline(graph: Graph, cluster: Cluster, options: PlanOptions, sizes: list[int], name: str) -> Plan:
    """Consecutive pieces of the topological order of the given sizes, one per device in order."""
    order = graph.topo_order
    stages: list[Stage] = []
    start = 0
    for size, device in zip(sizes, cluster.devices, strict=False):
        stages.append(Stage(order[start:start + size], (device.id,)))
        start += size
    m = options.microbatches or default_microbatches(graph.batch_size, len(stages))
    return Plan(tuple(stages), m, options.schedule, name, options.objective)


def uniform(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    k = min(len(cluster.devices), len(graph.nodes))
    return _pipeline(graph, cluster, options, chunk_sizes(len(graph.nodes), k), "uniform")


def min_max_sizes(weights: list[float], parts: int) -> list[int]:
    """Sizes of `parts` non-empty consecutive blocks whose largest sum is as small as possible
    (bisection on the largest sum, each candidate checked greedily)."""
    n = len(weights)
    parts = min(parts, n)

    def greedy(limit: float) -> list[int]:
        sizes, total = [0], 0.0
        for w in weights:
            if sizes[-1] and total + w > limit * (1 + 1e-12):  # tolerance: sums in another order differ
                sizes.append(0)
                total = 0.0
            sizes[-1] += 1
            total += w
        return sizes

    lo, hi = max(weights, default=0.0), math.fsum(weights)
    for _ in range(100):
        if hi - lo <= 1e-12 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        if len(greedy(mid)) <= parts:
            hi = mid
        else:
            lo = mid
    sizes = greedy(hi)
    while len(sizes) < parts:  # fewer blocks than parts: split the longest (never raises the max)
        i = max(range(len(sizes)), key=lambda k: sizes[k])
        sizes[i:i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
    return sizes


def block_partition(weights: list[float], parts: int, max_rounds: int = 100_000) -> list[int]:
    """Bárány and Grinberg's block partition: sizes of `parts` consecutive blocks whose sums
    differ by at most the largest element.

    Start from equal numbers of elements; while the largest block exceeds the smallest by more
    than the largest element, move one element into the smallest block from its neighbour on
    the side of the largest block. (The paper scales the elements into [0, 1]; we divide by the
    largest so that sums stay proportional to the weights; torchgpipe also subtracts the
    smallest, which balances something other than the sums when blocks differ in length.)"""
    n = len(weights)
    parts = min(parts, n)
    top = max(weights, default=0.0)
    if parts <= 1 or top <= 0:
        return chunk_sizes(n, parts)
    unit = [w / top for w in weights]
    bounds = [n // parts * (i + 1) for i in range(parts - 1)] + [n]  # end of each block

    def block(i: int) -> float:
        return math.fsum(unit[(bounds[i - 1] if i else 0):bounds[i]])

    for _ in range(max_rounds):
        sums = [block(i) for i in range(parts)]
        p = max(range(parts), key=lambda i: (sums[i], -i))
        low = min(sums)
        if sums[p] <= low + 1.0:
            break
        q = min((i for i in range(parts) if sums[i] == low), key=lambda i: abs(i - p))
        step = -1 if p < q else 1  # from q towards p
        # the paper moves one element into q from its neighbour h towards p; stages may not be
        # empty, so when h has one element, the nearest block towards p with two or more passes
        # one element along the blocks in between (each keeps its size)
        h = q + step
        while h != p and bounds[h] - (bounds[h - 1] if h else 0) <= 1:
            h += step
        if bounds[h] - (bounds[h - 1] if h else 0) <= 1:
            break
        for b in range(q, h, step):  # shift the boundary between block b and b + step by one
            if step < 0:
                bounds[b - 1] -= 1
            else:
                bounds[b] += 1
    return [bounds[i] - (bounds[i - 1] if i else 0) for i in range(parts)]


def params(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    weights = [float(graph.by_id[n].param_bytes) for n in graph.topo_order]
    return _pipeline(graph, cluster, options, min_max_sizes(weights, len(cluster.devices)), "params")


def balanced_time(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    t = graph.profiled_on
    weights = [graph.by_id[n].fwd_s[t] + graph.by_id[n].bwd_s[t] for n in graph.topo_order]
    return _pipeline(graph, cluster, options, block_partition(weights, len(cluster.devices)), "balanced-time")


def data_parallel(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    """Every device that fits the whole model holds a replica; slower devices are dropped first
    when one runs out of memory (its share of the activations shrinks as others join); with
    `--max-replicas N`, the N fastest; and no more than the rows of a micro-batch (the fastest:
    a replica without rows would hold the weights and join the all-reduce for nothing)."""
    cm = CostModel(graph, cluster)
    nodes = graph.topo_order
    m = options.microbatches or 1
    devices = [d.id for d in cluster.devices]
    # a replica needs a row of every micro-batch: no more of them than the smallest has rows
    most = min(options.max_replicas or len(devices), max(1, graph.batch_size // m))
    if most < len(devices):
        fastest = sorted(devices, key=lambda d: (cm.whole_graph_s(cluster.device(d).type), devices.index(d)))
        devices = [d for d in devices if d in fastest[:most]]
    while devices:
        plan = Plan((Stage(nodes, tuple(devices)),), m, options.schedule, "data-parallel", options.objective)
        need = cm.stage_replicas_memory_bytes(plan, 0)
        short = [d for d in devices if need[d] > cluster.device(d).mem_bytes]
        if not short:
            return plan
        devices.remove(max(short, key=lambda d: (cm.whole_graph_s(cluster.device(d).type), d)))
    table = StageTable.of_chain(cm)
    need = min(float(table.memory_bytes(table.kind(cluster.ids[:1]), 0, table.last, 1 / m)), 2**63)
    biggest = max(cluster.devices, key=lambda d: d.mem_bytes)
    raise InfeasibleError(
        f"data parallelism needs the whole model on every device it uses, at least {fmt_bytes(need)} "
        f"with {m} micro-batch{'es' if m > 1 else ''}, but the largest device ({biggest.id}, {biggest.type}) "
        f"has {fmt_bytes(biggest.mem_bytes)}: use a pipeline planner such as dp"
    )


def single(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    cm = CostModel(graph, cluster)
    m = options.microbatches or 1
    nodes = graph.topo_order
    candidates = []
    for i, device in enumerate(cluster.devices):
        plan = Plan((Stage(nodes, (device.id,)),), m, options.schedule, "single", options.objective)
        need = cm.stage_memory_bytes(plan, 0, device.id)
        candidates.append((cm.whole_graph_s(device.type), i, need, plan))
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
