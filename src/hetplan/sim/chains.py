"""Scoring chains of single-device stages given as cut points in a fixed topological order and
one device per stage, for planners that search over cuts (the RL environment): each stage's sums
along the order from prefix sums (`ChainStages`), lowered by the cost table's array form
(`hetplan.cost.table.chain_costs`) and run by `hetplan.sim.fast.ChainProgram`, so a batch of
plans is scored without a Python loop over plans. Exactly the event simulator where the fast path is
(`hetplan.sim.fast`); tied parameters spanning the same stages are summed one after the other,
where the runtime sums them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel, microbatch_fractions
from hetplan.cost.stage_table import StageTable, prefix_states
from hetplan.cost.table import ChainCosts, ChainDevices, ChainResources, ChainStages, chain_costs
from hetplan.graph import Graph
from hetplan.sim.fast import ChainProgram


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
        # the table of every stage between two prefixes of the order (`hetplan.cost.stage_table`)
        self.table = StageTable(cm, prefix_states(len(self.order)), self.order)
        self._kinds = [self.table.kind((next(d.id for d in cluster.devices if d.type == t),))
                       for t in sorted(set(types))]
        self._programs: dict[tuple[int, int, str], ChainProgram] = {}
        self._devices = ChainDevices(cm)
        self._tied_at = [(np.array([pos[v] for v in t.nodes]), t.bytes) for t in graph.tied]
        self._tied_cache: dict[tuple[int, tuple[str, ...]], float] = {}

    def _optimizer_s(self, lo: np.ndarray, hi: np.ndarray, devices: np.ndarray) -> np.ndarray:
        """(P, stages) optimizer step of each stage's weights on its device (`StageTable.optimizer_s`:
        measured on its type, else from the bytes it updates, a tied parameter once)."""
        out = np.zeros(devices.shape)
        for dev in np.unique(devices):
            where = devices == dev
            out[where] = self.table.optimizer_s(self.cluster.devices[dev].id, lo[where], hi[where])
        return out

    def _tied(self, cuts: np.ndarray, devices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per tied parameter g of the graph: (P, G, stages) the stages it spans (none where one
        stage holds it all) and (P, G) its sum's time over their devices (`StageTable.gradient_sum_s`).
        Tied parameters spanning the same stages are summed one after the other, where the
        runtime sums them together: a ranking, not the event simulator's figure."""
        p, n = devices.shape
        members, seconds = np.zeros((p, len(self._tied_at), n), bool), np.zeros((p, len(self._tied_at)))
        for g, (positions, nbytes) in enumerate(self._tied_at):
            stage = (cuts[:, None, :] <= positions[None, :, None]).sum(axis=2)  # (P, its nodes)
            count = np.zeros((p, n))
            np.add.at(count, (np.arange(p)[:, None], stage), 1)
            spans = (count > 0).sum(axis=1) > 1
            members[:, g, :] = (count > 0) & spans[:, None]
            for i in np.nonzero(spans)[0]:
                ids = tuple(self.cluster.ids[d] for d in devices[i][members[i, g]])
                if (g, ids) not in self._tied_cache:
                    self._tied_cache[(g, ids)] = float(self.table.gradient_sum_s(nbytes, ids))
                seconds[i, g] = self._tied_cache[(g, ids)]
        return members, seconds

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
        tied_members, tied_s = self._tied(cuts, devices) if self._tied_at else (None, None)
        sums = np.zeros((5, p, n))  # forward, backward, their fixed parts, the weighted backward
        for t, kind in enumerate(self._kinds):
            where = types == t
            if where.any():
                sums[:, where] = np.array(self.table.raw_passes_s(kind, lo[where], hi[where]))
        table = self.table
        stages = ChainStages(devices, sums[0], sums[1], sums[2], sums[3], sums[4],
                             self._optimizer_s(lo, hi, devices), table.param_bytes(lo, hi),
                             table.acts[hi] - table.acts[lo],
                             table.cut[cuts], tied_members, tied_s, table.casts[hi] - table.casts[lo])
        return chain_costs(self._devices, stages, schedule, self.graph.batch_size, microbatches)

    def score(self, cuts: np.ndarray, devices: np.ndarray, microbatches: int, schedule: str) -> FastScores:
        costs, held = self.lower(cuts, devices, microbatches, schedule)
        step = self.program(costs.stages, microbatches, schedule).step_s(costs)
        return FastScores(step, self.graph.batch_size / step, held.peak_memory_bytes, held.fits,
                          held.usd_per_step(step), held.link_busy_s, held.bottleneck_s)
