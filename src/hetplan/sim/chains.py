"""Scoring chains of single-device stages given as cut points in a fixed topological order and
one device per stage, for planners that search over cuts (the RL environment): each stage's sums
along the order from prefix sums (`ChainStages`), lowered by the cost table's array form
(`hetplan.cost.table.chain_costs`) and run by `hetplan.sim.fast.ChainProgram`, so a batch of
plans is scored without a Python loop over plans. Exactly the event simulator where the fast path is
(`hetplan.sim.fast`); tied parameters spanning the same stages are summed one after the other,
where the runtime sums them together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel, microbatch_fractions
from hetplan.cost.table import ChainCosts, ChainDevices, ChainResources, ChainStages, chain_costs
from hetplan.graph import Graph
from hetplan.sim.fast import ChainProgram


def chain_crossing_bytes(graph: Graph, pos: Mapping[str, int]) -> np.ndarray:
    """crossing[c]: the bytes cut when a stage boundary falls before position c of the order
    `pos`: per source node, its edges that reach position c or later, at most its output
    (`Graph.crossing_bytes`)."""
    n = len(pos)
    crossing = np.zeros(n + 1)
    out: dict[str, list] = {}
    for e in graph.edges:
        out.setdefault(e.src, []).append(e)
    for src, edges in out.items():
        reach = np.zeros(n + 2)  # the source's edge bytes still crossing at each position
        for e in edges:
            reach[pos[e.src] + 1] += e.bytes
            reach[pos[e.dst] + 1] -= e.bytes
        crossing += np.minimum(np.cumsum(reach)[: n + 1], graph.sent_cap_bytes[src])
    return crossing



@dataclass(frozen=True)
class FastScores:
    """Scores of a batch of P plans: step time, throughput, peak memory per stage, feasibility."""

    step_s: np.ndarray  # (P,)
    samples_per_s: np.ndarray  # (P,)
    peak_mem_bytes: np.ndarray  # (P, stages)
    feasible: np.ndarray  # (P,) bool
    usd_per_step: np.ndarray  # (P,)
    link_busy_s: np.ndarray | None = None  # (P,) the busiest directed link's time sending in a step
    bottleneck_s: np.ndarray | None = None  # (P,) `CostModel.bottleneck_s`: PipeDream's steady state


class ChainScorer:
    """Scores chains of single-device stages given as cut points in a fixed topological order.

    A plan is `cuts` (stages - 1 increasing positions in `order`: stage k holds
    order[cuts[k-1]:cuts[k]]) and `devices` (one device index of `cluster.ids` per stage)."""

    def __init__(self, graph: Graph, cluster: Cluster, order: Sequence[str] | None = None) -> None:
        self.graph, self.cluster = graph, cluster
        self.order = tuple(order or graph.topo_order)
        cm = CostModel(graph, cluster)
        pos = {nid: k for k, nid in enumerate(self.order)}
        types = [d.type for d in cluster.devices]
        self._type_of = np.array([sorted(set(types)).index(t) for t in types])
        zero = np.zeros(1)
        # per device type, prefix sums along the order of the nodes' times and fixed parts
        times = [cm.node_times_s(t) for t in sorted(set(types))]
        fixed = [cm.node_fixed_s(t) for t in sorted(set(types))]
        self._fwd, self._bwd = self._prefix(times, 0), self._prefix(times, 1)  # (types, len(order) + 1)
        self._ffix, self._bfix = self._prefix(fixed, 0), self._prefix(fixed, 1)
        by_id = graph.by_id
        # the backward of the nodes with weights, for a schedule that splits the backward
        self._bwd_weighted = np.array([np.concatenate([zero, np.cumsum([x[v][1] if by_id[v].param_bytes > 0 else 0.0
                                                                         for v in self.order])]) for x in times])
        self._params = np.concatenate([zero, np.cumsum([by_id[v].param_bytes for v in self.order], dtype=float)])
        self._updated = np.concatenate([zero, np.cumsum([by_id[v].optimizer_bytes for v in self.order], dtype=float)])
        # per device type, prefix sums of the optimizer steps the profiler measured there (None: not measured)
        self._opt = [None if m is None else np.concatenate([zero, np.cumsum([m[v] for v in self.order])])
                     for m in (cm.measured_optimizer_s(t) for t in sorted(set(types)))]
        self._acts = np.concatenate([zero, np.cumsum([by_id[v].act_bytes for v in self.order], dtype=float)])
        self._casts = np.concatenate([zero, np.cumsum([by_id[v].cast_bytes for v in self.order], dtype=float)])
        self._crossing = chain_crossing_bytes(graph, pos)
        self._programs: dict[tuple[int, int, str], ChainProgram] = {}
        self._cm = cm
        self._devices = ChainDevices(cm)
        self._tied_at = [(np.array([pos[v] for v in t.nodes]), t.bytes) for t in graph.tied]
        self._tied_cache: dict[tuple[int, tuple[str, ...]], float] = {}

    def _optimizer_s(self, lo: np.ndarray, hi: np.ndarray, devices: np.ndarray, excess) -> np.ndarray:
        """(P, stages) optimizer step of each stage's weights on its device (as
        `CostModel.stage_optimizer_s`: measured on its type, else from the bytes it updates,
        a tied parameter once)."""
        out = np.zeros(devices.shape)
        for dev in np.unique(devices):
            where = devices == dev
            measured = self._opt[self._type_of[dev]]
            out[where] = self._cm.optimizer_step_s(
                np.maximum(0.0, self._updated[hi[where]] - self._updated[lo[where]]
                           - (excess[where] if np.ndim(excess) else excess)),
                self.cluster.devices[dev].id,
                None if measured is None else measured[hi[where]] - measured[lo[where]])
        return out

    def _tied(self, cuts: np.ndarray, devices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per tied parameter g of the graph: (P, G, stages) the stages it spans (none where one
        stage holds it all), (P, G) its sum's time over their devices (`CostModel.gradient_sync_s`),
        and (P, stages) the bytes a stage counts twice or more (`Graph.tied_excess_bytes`).
        Tied parameters spanning the same stages are summed one after the other, where the
        runtime sums them together: a ranking, not the event simulator's figure."""
        p, n = devices.shape
        members, seconds, excess = np.zeros((p, len(self._tied_at), n), bool), np.zeros((p, len(self._tied_at))), \
            np.zeros((p, n))
        for g, (positions, nbytes) in enumerate(self._tied_at):
            stage = (cuts[:, None, :] <= positions[None, :, None]).sum(axis=2)  # (P, its nodes)
            count = np.zeros((p, n))
            np.add.at(count, (np.arange(p)[:, None], stage), 1)
            excess += np.maximum(count - 1, 0) * nbytes
            spans = (count > 0).sum(axis=1) > 1
            members[:, g, :] = (count > 0) & spans[:, None]
            for i in np.nonzero(spans)[0]:
                ids = tuple(self.cluster.ids[d] for d in devices[i][members[i, g]])
                if (g, ids) not in self._tied_cache:
                    self._tied_cache[(g, ids)] = float(self._cm.gradient_sync_s(nbytes, 0, ids))
                seconds[i, g] = self._tied_cache[(g, ids)]
        return members, seconds, excess

    def _prefix(self, per_type: list[dict[str, tuple[float, float]]], k: int) -> np.ndarray:
        return np.array([np.concatenate([np.zeros(1), np.cumsum([x[v][k] for v in self.order])]) for x in per_type])

    def program(self, stages: int, microbatches: int, schedule: str) -> ChainProgram:
        key = (stages, microbatches, schedule)
        if key not in self._programs:
            self._programs[key] = ChainProgram(stages, microbatch_fractions(self.graph.batch_size, microbatches),
                                               schedule)
        return self._programs[key]

    def lower(self, cuts: np.ndarray, devices: np.ndarray, microbatches: int,
              schedule: str) -> tuple[ChainCosts, ChainResources]:
        """The plans' table in array form (`hetplan.cost.table.chain_costs`), from their stages'
        sums along the order."""
        devices = np.atleast_2d(np.asarray(devices, dtype=int))
        p, n = devices.shape
        cuts = np.asarray(cuts, dtype=int).reshape(p, n - 1)
        bounds = np.concatenate([np.zeros((p, 1), int), cuts, np.full((p, 1), len(self.order))], axis=1)
        lo, hi = bounds[:, :-1], bounds[:, 1:]
        types = self._type_of[devices]
        tied_members, tied_s, excess = self._tied(cuts, devices) if self._tied_at else (None, None, 0.0)

        def stage_sum(prefix: np.ndarray) -> np.ndarray:
            return prefix[types, hi] - prefix[types, lo]

        stages = ChainStages(devices, stage_sum(self._fwd), stage_sum(self._bwd), stage_sum(self._ffix),
                             stage_sum(self._bfix), stage_sum(self._bwd_weighted),
                             self._optimizer_s(lo, hi, devices, excess), self._params[hi] - self._params[lo] - excess,
                             self._acts[hi] - self._acts[lo], self._crossing[cuts], tied_members, tied_s,
                             self._casts[hi] - self._casts[lo])
        return chain_costs(self._devices, stages, schedule, self.graph.batch_size, microbatches)

    def score(self, cuts: np.ndarray, devices: np.ndarray, microbatches: int, schedule: str) -> FastScores:
        costs, held = self.lower(cuts, devices, microbatches, schedule)
        step = self.program(costs.stages, microbatches, schedule).step_s(costs)
        return FastScores(step, self.graph.batch_size / step, held.peak_memory_bytes, held.fits,
                          held.usd_per_step(step), held.link_busy_s, held.bottleneck_s)
