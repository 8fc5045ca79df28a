"""The layer graph of a model: nodes with profiled costs, edges with the bytes they carry
(`hetplan.node`: the elements, which `Graph` imports and names for its users).

A `Graph` is always a DAG. Its nodes carry forward and backward times per device type (the
type the graph was profiled on is present on every node; other types come from profiling on
several devices), FLOPs, parameter bytes, output bytes and the bytes stashed for backward.
Derived structure (topological order, neighbours, ancestors, convexity) is computed once and
cached on the frozen object.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import networkx as nx

from hetplan._frozen import FILE_SCHEMA, FrozenMap
from hetplan.errors import GraphError, shown
from hetplan.node import Edge, Node, Tied
from hetplan.precision import FP32, PRECISIONS

# How a profiled graph was cut: one node per leaf module, or per repeated block (recorded in
# Graph.meta["granularity"] by the profiler).
GRANULARITIES = ("layer", "block")
# The most samples a step may have. The planners weigh micro-batch counts up to the batch, and a
# plan's split of the step (`hetplan.rows.step_rows`) and its simulation hold an entry per
# micro-batch, stage and replica, so the time and memory of planning grow with the batch without
# bound (10**15 samples fill any memory). 2**20 is some 16 times the largest global batches
# trained (ImageNet in 32k to 64k images), and plans vgg16 on hetero-4 in 12 s and 100 MB; it
# also keeps the simulator's floating-point split of the batch exact (to 2**53).
MAX_BATCH_SIZE = 2**20


def batch_size_problem(batch: object) -> str | None:
    """What a batch size must be, when it is not (None when it is): "must be ...", the value left
    to the caller's message."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        return "must be a whole number of samples >= 1"
    if batch > MAX_BATCH_SIZE:
        return (f"must be at most {MAX_BATCH_SIZE} samples per step: planners weigh up to a micro-batch per sample, "
                "and their time and memory grow with them; give a smaller batch")
    return None


@dataclass(frozen=True)
class Graph:
    """A model as a DAG of nodes. `batch_size` is the batch the times and sizes were taken at;
    `profiled_on` is the device type whose times every node carries; `precision` the arithmetic
    they were taken in (`hetplan.precision`): times, activations and message bytes are that
    precision's."""

    __pydantic_config__ = FILE_SCHEMA

    name: str
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    batch_size: int
    profiled_on: str
    source: str = ""
    meta: Mapping[str, str] = field(default_factory=FrozenMap)
    tied: tuple[Tied, ...] = ()
    precision: str = FP32

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "tied", tuple(self.tied))
        object.__setattr__(self, "meta", FrozenMap(self.meta))
        if not self.nodes:
            raise GraphError(f"graph {self.name!r} has no nodes")
        self._check_precision()
        problem = batch_size_problem(self.batch_size)
        if problem:
            raise GraphError(f"graph {self.name!r}: batch_size is {shown(self.batch_size)}; it {problem}")
        seen: set[str] = set()
        for node in self.nodes:
            if node.id in seen:
                raise GraphError(f"graph {self.name!r}: duplicate node id {node.id!r}")
            seen.add(node.id)
            if self.profiled_on not in node.fwd_s:
                raise GraphError(
                    f"graph {self.name!r}: node {node.id!r} has no time for the profiled device "
                    f"type {self.profiled_on!r} (it has {sorted(node.fwd_s)})"
                )
        pairs: set[tuple[str, str]] = set()
        for i, edge in enumerate(self.edges):
            for end in (edge.src, edge.dst):
                if end not in seen:
                    raise GraphError(
                        f"graph {self.name!r}: edge {i} ({edge.src} -> {edge.dst}) names node "
                        f"{end!r}, which does not exist"
                    )
            if (edge.src, edge.dst) in pairs:
                raise GraphError(f"graph {self.name!r}: duplicate edge {edge.src} -> {edge.dst}")
            pairs.add((edge.src, edge.dst))
        try:
            cycle = nx.find_cycle(self._nx)
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle:
            path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
            raise GraphError(f"graph {self.name!r} is not a DAG: it has the cycle {path}")
        self._check_tied()

    def _check_precision(self) -> None:
        if self.precision not in PRECISIONS:
            raise GraphError(f"graph {self.name!r}: precision is {shown(self.precision)}; it must be one of "
                             f"{', '.join(PRECISIONS)}")
        if self.precision == FP32 and any(n.cast_bytes for n in self.nodes):
            raise GraphError(f"graph {self.name!r} is fp32 but has nodes with cast_bytes; 16-bit copies of the "
                             "weights are made in bf16 or fp16 only")

    def _check_tied(self) -> None:
        for t in self.tied:
            short = [n for n in t.nodes if n not in self.by_id or self.by_id[n].param_bytes < t.bytes]
            if len(set(t.nodes)) < 2 or short:
                why = "names fewer than two nodes" if not short else \
                    f"is more than the parameters of {short[0]!r} (or no such node)"
                raise GraphError(f"graph {self.name!r}: the tied parameter of {', '.join(t.nodes)} ({t.bytes} "
                                 f"bytes) {why}; list the nodes that use it, each counting its bytes")

    # ---- structure ---------------------------------------------------------------------------

    @cached_property
    def _nx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        g.add_nodes_from(n.id for n in self.nodes)
        g.add_edges_from((e.src, e.dst) for e in self.edges)
        return g

    @cached_property
    def by_id(self) -> Mapping[str, Node]:
        return FrozenMap({n.id: n for n in self.nodes})

    @cached_property
    def _position(self) -> Mapping[str, int]:
        return FrozenMap({n.id: i for i, n in enumerate(self.nodes)})

    @cached_property
    def _adjacency(self) -> tuple[Mapping[str, tuple[str, ...]], Mapping[str, tuple[str, ...]]]:
        succ: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        pred: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for e in self.edges:
            succ[e.src].append(e.dst)
            pred[e.dst].append(e.src)
        return (FrozenMap({k: tuple(v) for k, v in succ.items()}),
                FrozenMap({k: tuple(v) for k, v in pred.items()}))

    @property
    def _succ(self) -> Mapping[str, tuple[str, ...]]:
        return self._adjacency[0]

    @property
    def _pred(self) -> Mapping[str, tuple[str, ...]]:
        return self._adjacency[1]

    @cached_property
    def topo_order(self) -> tuple[str, ...]:
        """A topological order; among valid orders, the one closest to the order of `nodes`,
        so that a graph listed in execution order keeps that order."""
        pos = self._position
        return tuple(nx.lexicographical_topological_sort(self._nx, key=pos.__getitem__))

    @cached_property
    def edge_bytes(self) -> Mapping[tuple[str, str], int]:
        return FrozenMap({(e.src, e.dst): e.bytes for e in self.edges})

    @cached_property
    def sent_cap_bytes(self) -> Mapping[str, float]:
        """Per node, the most it sends across one cut: its output (`out_bytes`; unbounded where
        that is 0, unknown). Two consumers of one tensor beyond a cut are two edges but one
        message: the runtime sends each value once per boundary (`hetplan.runtime.stages`)."""
        return FrozenMap({n.id: float(n.out_bytes) if n.out_bytes > 0 else math.inf for n in self.nodes})

    @cached_property
    def selective_measured(self) -> bool:
        """Whether every node that keeps activations carries selective recomputation's figures
        (`Node.selective_keep_bytes` and the rest)."""
        return all(n.selective_keep_bytes is not None and n.selective_rebuilt_bytes is not None
                   and "selective" in n.rerun_forwards for n in self.nodes if n.act_bytes > 0)

    @cached_property
    def read_bytes(self) -> Mapping[str, float]:
        """Per node, the bytes of its output that other nodes read, each tensor once
        (`crossing_bytes` of its edges): what a stage that recomputes per block keeps of it per
        micro-batch, the input of the next checkpointed node."""
        out: dict[str, list[Edge]] = {n.id: [] for n in self.nodes}
        for e in self.edges:
            out[e.src].append(e)
        return FrozenMap({v: self.crossing_bytes(es) for v, es in out.items()})

    def crossing_bytes(self, edges: Iterable[Edge]) -> float:
        """The bytes that cross a cut whose crossing edges are `edges`: per source node, its
        edges' bytes, at most what it outputs (`sent_cap_bytes`). Every cost of a cut comes here."""
        per_source: dict[str, float] = {}
        for e in edges:
            per_source[e.src] = per_source.get(e.src, 0.0) + e.bytes
        return math.fsum(min(b, self.sent_cap_bytes[src]) for src, b in per_source.items())

    def node(self, node_id: str) -> Node:
        try:
            return self.by_id[node_id]
        except KeyError:
            raise GraphError(f"graph {self.name!r} has no node {node_id!r}") from None

    def successors(self, node_id: str) -> tuple[str, ...]:
        return self._succ[self.node(node_id).id]

    def predecessors(self, node_id: str) -> tuple[str, ...]:
        return self._pred[self.node(node_id).id]

    def _reach(self, start: Iterable[str], step: Mapping[str, tuple[str, ...]]) -> frozenset[str]:
        seen: set[str] = set()
        queue = deque(start)
        while queue:
            for nxt in step[queue.popleft()]:
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        return frozenset(seen)

    def ancestors(self, node_id: str) -> frozenset[str]:
        """Every node with a path to `node_id` (not the node itself)."""
        return self._reach([self.node(node_id).id], self._pred)

    def descendants(self, node_id: str) -> frozenset[str]:
        """Every node reachable from `node_id` (not the node itself)."""
        return self._reach([self.node(node_id).id], self._succ)

    @cached_property
    def sources(self) -> tuple[str, ...]:
        return tuple(n for n in self.topo_order if not self._pred[n])

    @cached_property
    def sinks(self) -> tuple[str, ...]:
        return tuple(n for n in self.topo_order if not self._succ[n])

    def convexity_witness(self, node_ids: Iterable[str]) -> tuple[str, ...] | None:
        """A path that leaves the set and comes back into it, or None if the set is convex.

        A set S is convex when no path starts in S, leaves it and re-enters it. Any such path
        has a segment whose inner nodes are all outside S, so a search from S's successors
        through outside nodes only finds one if it exists: O(V + E).
        """
        inside = set(node_ids)
        for n in inside:
            self.node(n)
        parent: dict[str, str] = {}
        queue: deque[str] = deque()
        for n in inside:
            for s in self._succ[n]:
                if s not in inside and s not in parent:
                    parent[s] = n
                    queue.append(s)
        while queue:
            cur = queue.popleft()
            for s in self._succ[cur]:
                if s in inside:
                    path = [s, cur]
                    while path[-1] not in inside:
                        path.append(parent[path[-1]])
                    return tuple(reversed(path))
                if s not in parent:
                    parent[s] = cur
                    queue.append(s)
        return None

    def is_convex(self, node_ids: Iterable[str]) -> bool:
        return self.convexity_witness(node_ids) is None

    @cached_property
    def skip_edges(self) -> tuple[tuple[str, str], ...]:
        """Edges u -> v that have another path from u to v: residual and skip connections, and
        the joins of parallel branches. Found with descendant sets in reverse topological
        order, O(V * (V + E)) at worst."""
        below: dict[str, frozenset[str]] = {}
        for n in reversed(self.topo_order):
            reach: set[str] = set()
            for s in self._succ[n]:
                reach.add(s)
                reach |= below[s]
            below[n] = frozenset(reach)
        return tuple((e.src, e.dst) for e in self.edges
                     if any(e.dst in below[w] for w in self._succ[e.src] if w != e.dst))

    # ---- totals ------------------------------------------------------------------------------

    @cached_property
    def device_types(self) -> tuple[str, ...]:
        """Device types with measured times on every node, the profiled one first."""
        common = set.intersection(*(set(n.fwd_s) for n in self.nodes))
        return (self.profiled_on, *sorted(common - {self.profiled_on}))

    def fwd_s_total(self, device_type: str | None = None) -> float:
        dtype = device_type or self.profiled_on
        return math.fsum(n.fwd_s[dtype] for n in self.nodes)

    def bwd_s_total(self, device_type: str | None = None) -> float:
        dtype = device_type or self.profiled_on
        return math.fsum(n.bwd_s[dtype] for n in self.nodes)

    @property
    def param_bytes_total(self) -> int:
        """The model's parameters, a tied one once."""
        return self.param_bytes_of(n.id for n in self.nodes)

    def param_bytes_of(self, nodes: Iterable[str]) -> int:
        """The parameters of these nodes, each tied parameter once (a stage holds one copy)."""
        if not self.tied:
            return sum(self.by_id[n].param_bytes for n in nodes)
        ids = set(nodes)
        return sum(self.by_id[n].param_bytes for n in ids) - self.tied_excess_bytes(ids)

    def tied_excess_bytes(self, nodes: Iterable[str]) -> int:
        """What summing these nodes' parameter bytes counts twice or more: each tied parameter
        once per node of it among them, after the first."""
        if not self.tied:
            return 0
        ids = set(nodes)
        return sum(t.bytes * max(0, len(ids.intersection(t.nodes)) - 1) for t in self.tied)

    def cast_bytes_of(self, nodes: Iterable[str]) -> int:
        """The 16-bit copies of these nodes' weights a worker keeps for a step (`Node.cast_bytes`)."""
        return sum(self.by_id[n].cast_bytes for n in nodes)

    @property
    def act_bytes_total(self) -> int:
        return sum(n.act_bytes for n in self.nodes)


def at_batch(graph: Graph, batch_size: int) -> Graph:
    """The graph for a batch of `batch_size` samples, from its profile at `graph.batch_size`: a
    pass takes its fixed part plus the rest scaled by the ratio of the batches; FLOPs, outputs,
    stashed activations (and what selective recomputation keeps and rebuilds of them) and the
    bytes on edges scale with it; weights do not. Tables with sparse
    gradients look up proportionally more rows, at most all of them. `meta["profiled_batch_size"]`
    keeps the batch the times were measured at."""
    problem = batch_size_problem(batch_size)
    if problem:
        raise GraphError(f"the batch size is {shown(batch_size)}; it {problem}")
    if batch_size == graph.batch_size:
        return graph
    ratio = batch_size / graph.batch_size

    def scaled(times: Mapping[str, float], fixed: Mapping[str, float]) -> dict[str, float]:
        return {t: fixed.get(t, 0.0) + (s - fixed.get(t, 0.0)) * ratio for t, s in times.items()}

    def node(n: Node) -> Node:
        updated = None if n.updated_bytes is None else min(n.param_bytes, round(n.updated_bytes * ratio))
        rows = round(n.sparse_rows * ratio) if n.updated_bytes is None or n.updated_bytes == 0 else \
            round(n.sparse_rows * (updated or 0) / n.updated_bytes)
        selective = {k: None if getattr(n, k) is None else round(getattr(n, k) * ratio)
                     for k in ("selective_keep_bytes", "selective_rebuilt_bytes")}
        tp = {t: {k: (f + (w - f) * ratio, g + (b - g) * ratio, f, g) for k, (w, b, f, g) in per.items()}
              for t, per in n.tp_s.items()}
        return replace(n, fwd_s=scaled(n.fwd_s, n.fwd_fixed_s), bwd_s=scaled(n.bwd_s, n.bwd_fixed_s), tp_s=tp,
                       flops=n.flops * ratio, out_bytes=round(n.out_bytes * ratio),
                       act_bytes=round(n.act_bytes * ratio), updated_bytes=updated, sparse_rows=rows, **selective)

    meta = {**graph.meta, "profiled_batch_size": graph.meta.get("profiled_batch_size", str(graph.batch_size))}
    return replace(graph, nodes=tuple(node(n) for n in graph.nodes),
                   edges=tuple(replace(e, bytes=round(e.bytes * ratio)) for e in graph.edges),
                   batch_size=batch_size, meta=meta)
