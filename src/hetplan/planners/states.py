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
What a stage between two states costs is the cost package's (`StateSums.table`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetplan.cost import CostModel
from hetplan.cost.stage_table import StageTable
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


class StateSums:
    """The cut states a planner cuts at (at most `max_states` of them after `coarsen`), the
    table of every stage between two of them (`hetplan.cost.stage_table.StageTable`: what dp,
    the per-type program, milp and exact read), and `below[j]`: the states i < j with S_i a
    subset of S_j."""

    def __init__(self, graph: Graph, cost: CostModel, max_states: int, around: Sequence[int] = (),
                 width: int = 0) -> None:
        """`around`: indices into `cut_states(graph)`; when given, the states kept are the empty
        and the full one and, for each of these, the `width` states before and after it by
        compute time (a zoom into where a first pass cut), instead of `coarsen`'s."""
        self.graph = graph
        states = cut_states(graph)
        mat = states.matrix()
        full = StageTable(cost, mat, states.order)
        ref = full.type_kind(full.types[0])
        weight = full.whole_s(ref, 0, np.arange(len(mat)))
        keep = zoom(states, weight, around, width) if around else coarsen(states, weight, full.cut, max_states)
        self.ideals = [states.ideals[k] for k in keep]
        self.table = StageTable(cost, mat[keep], states.order) if len(keep) < len(mat) else full
        self.types = self.table.types
        self.states = states
        inside = subset_matrix(mat[keep])
        self.below_arr = [np.nonzero(inside[:, j])[0] for j in range(len(keep))]
        self.below = [b.tolist() for b in self.below_arr]
        self.inside = inside

    @property
    def cut(self) -> np.ndarray:
        """Per kept state, the bytes crossing its cut."""
        return self.table.cut

    def kind_of_type(self, type_name: str):
        """The table's kind of one device of a type (the cluster's first of it)."""
        return self.table.type_kind(type_name)

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
