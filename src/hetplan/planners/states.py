"""Cut states of a DAG: the down-sets ("ideals") at which a pipeline can be cut.

PipeDream's optimizer (Narayanan et al., SOSP 2019) and Ju et al.'s task segmentation split a
branchy graph only at *antichains*: a state is the set of all nodes up to an antichain (a
down-set, closed under predecessors), and the stage between two states i and j is the
difference of their down-sets, which is always convex, and in pipeline order when the first is
a subset of the second. The *augmented* antichain of a state is its boundary: the nodes inside
whose outputs are still needed outside; the bytes they send out are what crosses the cut.

We enumerate the states breadth-first from the empty set, adding at each step one node whose
predecessors are all inside (so every down-set is reachable), and sort them by size, which is a
topological order of the states under inclusion. A graph with wide parallel regions has
exponentially many states; past `limit` we fall back to the prefixes of one topological order
together with the down-set of every single node (a polynomial family that still contains every
cut of a chain), and say so. `coarsen` keeps at most K states, spread evenly over the compute
time with the cheapest cut in each slice, for the dynamic program on large graphs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetplan.cost import CostModel
from hetplan.graph import Graph


@dataclass(frozen=True)
class CutStates:
    """Down-sets of a graph as bitmasks over `order` (bit k is node order[k]), sorted by size."""

    order: tuple[str, ...]
    ideals: tuple[int, ...]
    complete: bool  # True when every down-set of the graph is here

    def __len__(self) -> int:
        return len(self.ideals)

    def members(self, mask: int) -> tuple[str, ...]:
        """The node ids of a bitmask, in `order` (a topological order)."""
        out = []
        k = 0
        while mask:
            if mask & 1:
                out.append(self.order[k])
            mask >>= 1
            k += 1
        return tuple(out)

    def matrix(self) -> np.ndarray:
        """(states, nodes) booleans: which nodes each state holds."""
        n = len(self.order)
        nbytes = (n + 7) // 8
        raw = np.frombuffer(b"".join(m.to_bytes(nbytes, "little") for m in self.ideals), dtype=np.uint8)
        bits = np.unpackbits(raw.reshape(len(self.ideals), nbytes), axis=1, bitorder="little")
        return bits[:, :n].astype(bool)


def _closures(graph: Graph, order: tuple[str, ...]) -> tuple[dict[str, int], list[int]]:
    bit = {v: 1 << k for k, v in enumerate(order)}
    pred_mask = []
    closure: dict[str, int] = {}
    for v in order:
        preds = graph.predecessors(v)
        mask = 0
        for p in preds:
            mask |= bit[p]
        pred_mask.append(mask)
        c = bit[v]
        for p in preds:
            c |= closure[p]
        closure[v] = c
    return closure, pred_mask


def cut_states(graph: Graph, limit: int = 20_000) -> CutStates:
    """Every down-set of the graph, or (past `limit`) the polynomial family described above."""
    order = graph.topo_order
    closure, pred_mask = _closures(graph, order)
    n = len(order)
    full = (1 << n) - 1
    index = {v: k for k, v in enumerate(order)}
    succ = [[index[w] for w in graph.successors(v)] for v in order]
    seen = {0}
    # each queued state carries the nodes that can join it (all their predecessors inside)
    queue = deque([(0, tuple(k for k in range(n) if pred_mask[k] == 0))])
    complete = True
    while queue:
        ideal, ready = queue.popleft()
        for k in ready:
            nxt = ideal | (1 << k)
            if nxt in seen:
                continue
            seen.add(nxt)
            joins = tuple(w for w in succ[k] if pred_mask[w] & ~nxt == 0)
            queue.append((nxt, tuple(x for x in ready if x != k) + joins))
        if len(seen) > limit:
            complete = False
            break
    if not complete:
        seen = {0, full}
        prefix = 0
        for k, v in enumerate(order):
            prefix |= 1 << k
            seen.add(prefix)
            seen.add(closure[v])
    ideals = tuple(sorted(seen, key=lambda m: (m.bit_count(), m)))
    return CutStates(order, ideals, complete)


def coarsen(states: CutStates, weight: np.ndarray, cut_bytes: np.ndarray, keep: int) -> list[int]:
    """Indices of at most `keep` states: the empty and the full one, and in each of keep - 2
    equal slices of the compute time the state with the fewest bytes crossing its cut."""
    s = len(states)
    if s <= keep:
        return list(range(s))
    total = weight[-1] if weight[-1] > 0 else 1.0
    slices = np.minimum((weight / total * (keep - 2)).astype(int), keep - 3)
    chosen = {0, s - 1}
    best: dict[int, int] = {}
    for idx in range(1, s - 1):
        sl = int(slices[idx])
        if sl not in best or cut_bytes[idx] < cut_bytes[best[sl]]:
            best[sl] = idx
    chosen.update(best.values())
    return sorted(chosen, key=lambda i: (states.ideals[i].bit_count(), states.ideals[i]))


def zoom(states: CutStates, weight: np.ndarray, around: Sequence[int], width: int) -> list[int]:
    """Indices of the empty and the full state and of the `width` states on either side of each
    of `around` in the order of `weight` (compute time), sorted by size as `coarsen`'s."""
    s = len(states)
    by_weight = np.argsort(weight, kind="stable")
    rank = np.empty(s, dtype=int)
    rank[by_weight] = np.arange(s)
    chosen = {0, s - 1}
    for i in around:
        lo, hi = max(0, rank[i] - width), min(s, rank[i] + width + 1)
        chosen.update(int(k) for k in by_weight[lo:hi])
    return sorted(chosen, key=lambda i: (states.ideals[i].bit_count(), states.ideals[i]))


def subset_matrix(bits: np.ndarray) -> np.ndarray:
    """inside[i, j]: state i is a proper subset of state j, for states sorted by size given as
    (states, nodes) booleans (`CutStates.matrix`), by one matrix product (exact in float32:
    it counts nodes)."""
    outside = (bits.astype(np.float32) @ (~bits).astype(np.float32).T) == 0  # no node of i outside j
    return np.triu(outside, k=1)


def cut_bytes(graph: Graph, mat: np.ndarray, order: tuple[str, ...]) -> np.ndarray:
    """Per state ((states, nodes) membership `mat`), the bytes crossing its cut: per source
    node, its crossing edges' bytes, at most its output (`Graph.crossing_bytes`, for all states
    at once)."""
    if not graph.edges:
        return np.zeros(len(mat))
    index = {v: k for k, v in enumerate(order)}
    src = np.array([index[e.src] for e in graph.edges], dtype=int)
    dst = np.array([index[e.dst] for e in graph.edges], dtype=int)
    nbytes = np.array([float(e.bytes) for e in graph.edges])
    crossing = (mat[:, src] > 0) & (mat[:, dst] == 0)  # (states, edges)
    sources = np.unique(src)
    per_source = np.stack([crossing[:, src == v] @ nbytes[src == v] for v in sources], axis=1)  # (states, sources)
    cap = np.array([graph.sent_cap_bytes[order[v]] for v in sources])
    return np.minimum(per_source, cap).sum(axis=1)


class StateSums:
    """Per cut state (at most `max_states` of them after `coarsen`): the time of its nodes on each
    of the cluster's device types, its parameter and activation bytes and the bytes across its
    cut; `below[j]`: the states i < j with S_i a subset of S_j. What dp (`hetplan.planners.dp`)
    reads."""

    def __init__(self, graph: Graph, cost: CostModel, max_states: int, around: Sequence[int] = (),
                 width: int = 0) -> None:
        """`around`: indices into `cut_states(graph)`; when given, the states kept are the empty
        and the full one and, for each of these, the `width` states before and after it by
        compute time (a zoom into where a first pass cut), instead of `coarsen`'s."""
        self.graph = graph

        states = cut_states(graph)
        mat = states.matrix().astype(float)
        by_id = graph.by_id
        order = states.order
        self.types = sorted({d.type for d in cost.cluster.devices})
        node_t = {t: cost.node_times_s(t) for t in self.types}
        self.time = {t: mat @ np.array([sum(node_t[t][v]) for v in order]) for t in self.types}
        self.fwd = {t: mat @ np.array([node_t[t][v][0] for v in order]) for t in self.types}  # what recomputing adds
        node_fixed = {t: cost.node_fixed_s(t) for t in self.types}  # what a micro-batch pays whatever its rows
        self.fixed = {t: mat @ np.array([sum(node_fixed[t].get(v, (0.0, 0.0))) for v in order]) for t in self.types}
        self.fwd_fixed = {t: mat @ np.array([node_fixed[t].get(v, (0.0, 0.0))[0] for v in order]) for t in self.types}
        ref = self.types[0]
        cut = cut_bytes(graph, mat, order)
        keep = zoom(states, self.time[ref], around, width) if around else coarsen(states, self.time[ref], cut,
                                                                                  max_states)
        self.ideals = [states.ideals[k] for k in keep]
        self.time = {t: v[keep] for t, v in self.time.items()}
        self.fwd = {t: v[keep] for t, v in self.fwd.items()}
        self.fixed = {t: v[keep] for t, v in self.fixed.items()}
        self.fwd_fixed = {t: v[keep] for t, v in self.fwd_fixed.items()}
        self.params = (mat @ np.array([float(by_id[v].param_bytes) for v in order]))[keep]
        self.casts = (mat @ np.array([float(by_id[v].cast_bytes) for v in order]))[keep]  # 16-bit weight copies
        self.updated = (mat @ np.array([float(by_id[v].optimizer_bytes) for v in order]))[keep]  # optimizer's
        self.indices = (mat @ np.array([float(cost.index_bytes([v])) for v in order]))[keep]  # sparse rows' indices
        measured = {t: cost.measured_optimizer_s(t) for t in self.types}
        self.opt = {t: (mat @ np.array([m[v] for v in order]))[keep] for t, m in measured.items() if m is not None}
        self.acts = (mat @ np.array([float(by_id[v].act_bytes) for v in order]))[keep]
        self.cut = cut[keep]
        self.states = states
        n = len(self.ideals)
        inside = subset_matrix(mat[keep] > 0)
        self.below_arr = [np.nonzero(inside[:, j])[0] for j in range(n)]
        self.below = [b.tolist() for b in self.below_arr]

    def nodes(self, i: int, j: int) -> tuple[str, ...]:
        return self.states.members(self.ideals[j] & ~self.ideals[i])

    def cut_indices(self, stages: Sequence[Sequence[str]]) -> list[int]:
        """The indices into `states` (all cut states, kept or not) of the boundaries between
        stages of these nodes, in pipeline order (a boundary that is no state is left out)."""
        index = {m: k for k, m in enumerate(self.states.ideals)}
        bit = {v: 1 << k for k, v in enumerate(self.states.order)}
        out, mask = [], 0
        for nodes in stages[:-1]:
            for v in nodes:
                mask |= bit[v]
            if mask in index:
                out.append(index[mask])
        return out
