"""The plan space the reinforcement-learning planners act on, shared by `reinforce` and `ppo`.

A plan is written as two choices, the ones the Hierarchical placer (Mirhoseini et al., "A
Hierarchical Model for Device Placement", ICLR 2018) and Trinity (Zeng et al., 2022) learn:

1. **groups**: every *unit* gets a group label. Units are the graph's topological order cut into
   at most `max_units` contiguous runs of about equal time (all nodes when the graph is small),
   so that a policy for a 1,000-node graph has 64 decisions to make, not 1,000.
2. **placement**: every group (after repair, a pipeline stage) gets one device. There are at
   most min(devices, units, `MAX_STAGES` = 8) groups; stages have no replicas here (the papers'
   placers give a group one device), which `dp` and `heterps` do have.

**Repair.** A policy that groups freely can put unit 3 in group A, unit 4 in group B and unit 5
in group A again, which is no pipeline (a stage must be convex, and stages must form a chain). The
repair step makes the labels legal with the fewest changes: groups are ranked by the mean
position of their units (the group that comes first is stage 0), and the labels are replaced by
the non-decreasing sequence of ranks that differs from them in the fewest units (a dynamic
program over units and ranks, O(units x groups)); empty ranks are dropped. Runs of a
topological order are convex and form a chain, so every repaired labelling is a valid pipeline.

**Masks.** When the placer picks a device for stage s of n, devices already holding a stage are
masked out (the fast path assumes one stage per device), and so are devices whose memory cannot
hold the stage under any allowed number of micro-batches (weights, gradients and Adam state plus
the activations the schedule keeps in flight). When every device is masked, the unused ones are
allowed again and the plan is scored as infeasible: the policy learns from that rather than
crashing.

**Rewards** come from the simulator's batched fast path (`hetplan.sim.chains.ChainScorer`): every
sampled plan is scored at each allowed number of micro-batches at once and keeps the best (the
micro-batch count is not a learnt action). Values are the planner objective
(`hetplan.planners.objectives`: time, cost under a throughput floor, or mdpe), finite for
infeasible plans (the objective times a penalty growing with the memory overflow and the
throughput shortfall, as `search_value`). The planners re-score their final candidates with the
event simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.cost.stage_table import StageTable
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage
from hetplan.planners import objectives
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.sim.chains import ChainScorer

MAX_UNITS = 64
MAX_STAGES = 8


@dataclass(frozen=True)
class Scored:
    """A batch of P sampled plans and their scores. `stages[p, u]` is unit u's stage (0 ..
    n[p] - 1), `devices[p, s]` stage s's device index (-1 past n[p]), `value` the objective
    (finite, lower is better), `microbatches` the best m for each plan, `feasible` whether the
    plan fits in memory and meets the throughput floor."""

    stages: np.ndarray  # (P, U) int
    devices: np.ndarray  # (P, G) int
    n: np.ndarray  # (P,) int
    value: np.ndarray  # (P,) float
    step_s: np.ndarray  # (P,) float
    microbatches: np.ndarray  # (P,) int
    feasible: np.ndarray  # (P,) bool


def unit_starts(graph: Graph, cluster: Cluster, max_units: int = MAX_UNITS) -> np.ndarray:
    """Cut the topological order into at most `max_units` runs of about equal time on the
    cluster's fastest type; returns the U + 1 start positions (the last is len(order))."""
    order = graph.topo_order
    if len(order) <= max_units:
        return np.arange(len(order) + 1)
    cm = CostModel(graph, cluster)
    table = StageTable.of_chain(cm, order)
    w = table.node_s(table.type_kind(cm.fastest_type()))
    # a little weight per node so that runs of nodes without time still split
    w = w + max(w.sum(), 1e-30) / (10 * len(order))
    cum = np.cumsum(w) / w.sum()
    starts = [0]
    for k in range(1, max_units):
        pos = int(np.searchsorted(cum, k / max_units)) + 1
        if starts[-1] < pos < len(order):
            starts.append(pos)
    return np.array([*starts, len(order)])


def group_ranks(labels: np.ndarray, groups: int) -> np.ndarray:
    """(P, U) each unit's group rank: groups ordered by the mean position of their units (ties:
    the lower label first)."""
    labels = np.atleast_2d(np.asarray(labels, dtype=int))
    p, u = labels.shape
    onehot = labels[:, :, None] == np.arange(groups)[None, None, :]  # (P, U, G)
    count = onehot.sum(axis=1)
    pos_sum = (onehot * np.arange(u, dtype=float)[None, :, None]).sum(axis=1)
    mean = np.where(count > 0, pos_sum / np.maximum(count, 1), np.inf)
    rank_of = np.argsort(np.argsort(mean + np.arange(groups)[None, :] * 1e-9, axis=1, kind="stable"), axis=1)
    return np.take_along_axis(rank_of, labels, axis=1)


def nearest_monotone(ranks: np.ndarray, groups: int) -> np.ndarray:
    """(P, U) the non-decreasing sequence over 0 .. groups-1 that differs from `ranks` in the
    fewest positions (ties: the lowest values), by dynamic programming over units and values."""
    ranks = np.atleast_2d(np.asarray(ranks, dtype=int))
    p, u = ranks.shape
    values = np.arange(groups)[None, :]
    choice = np.zeros((p, u, groups), dtype=int)  # choice[:, k, g]: the best value of unit k-1
    cost = (ranks[:, 0:1] != values).astype(float)  # cost[:, g]: fewest changes, unit k at value g
    for k in range(1, u):
        # best predecessor value <= g: the running argmin of cost along g (its first minimum)
        run_min = np.minimum.accumulate(cost, axis=1)
        is_new = np.concatenate([np.ones((p, 1), bool), run_min[:, 1:] < run_min[:, :-1]], axis=1)
        choice[:, k, :] = np.maximum.accumulate(np.where(is_new, values, 0), axis=1)
        cost = run_min + (ranks[:, k:k + 1] != values)
    out = np.empty((p, u), dtype=int)
    g = np.argmin(cost, axis=1)
    for k in range(u - 1, -1, -1):
        out[:, k] = g
        if k:
            g = choice[np.arange(p), k, g]
    return out


def repair(labels: np.ndarray, groups: int) -> np.ndarray:
    """Legal stages from free group labels (P, U): rank the groups (`group_ranks`), take the
    nearest non-decreasing sequence of ranks (`nearest_monotone`) and number the stages that
    remain 0, 1, ... (see the module docstring)."""
    mono = nearest_monotone(group_ranks(labels, groups), groups)
    first = np.concatenate([np.ones((mono.shape[0], 1), bool), mono[:, 1:] != mono[:, :-1]], axis=1)
    return np.cumsum(first, axis=1) - 1


class PlanEnv:
    """Scores plans written as (unit stages, stage devices) with the fast path; see the module
    docstring. Holds a count of the plans it scored (`evaluations`)."""

    def __init__(self, graph: Graph, cluster: Cluster, options: PlanOptions, max_units: int = MAX_UNITS,
                 max_stages: int = MAX_STAGES) -> None:
        self.graph, self.cluster, self.options = graph, cluster, options
        self.scorer = ChainScorer(graph, cluster)
        self.order = self.scorer.order
        self.starts = unit_starts(graph, cluster, max_units)
        self.units = len(self.starts) - 1
        self.devices = len(cluster.devices)
        self.groups = max(1, min(self.devices, self.units, max_stages))
        self.m_choices = microbatch_choices(graph, options)
        self.cost = CostModel(graph, cluster)
        self.t_ref_s = objectives.reference_time_s(graph, cluster, self.cost)
        self.table = self.scorer.table  # stages: runs of units, prefixes of the order
        self.kind = self.table.kind(cluster.ids[:1])  # memory depends on a replica's degree only (1)
        self.mem_bytes = np.array([d.mem_bytes for d in cluster.devices], dtype=float)
        self.evaluations = 0
        # held fraction of the batch by (stages, stage index), the smallest over allowed m
        self._held: dict[tuple[int, int], float] = {}

    # -- memory masks --------------------------------------------------------------------------
    def held_fraction(self, n: int, s: int) -> float:
        """The least share of the batch stage s of n holds in flight over the allowed micro-batch
        counts (`hetplan.cost.in_flight_share`)."""
        key = (n, s)
        if key not in self._held:
            self._held[key] = min(self.table.in_flight_share(self.options.schedule, n, s, self.graph.batch_size, m)
                                  for m in self.m_choices)
        return self._held[key]

    def stage_need_bytes(self, stages: np.ndarray, n: np.ndarray) -> np.ndarray:
        """(P, G) the least memory each stage needs over the allowed micro-batch counts (0 past n):
        stage g holds the units labelled g, a run of them (`repair`)."""
        p, u = stages.shape
        onehot = stages[:, :, None] == np.arange(self.groups)[None, None, :]
        units = np.arange(u)[None, :, None]
        lo = np.where(onehot, units, u).min(axis=1)  # (P, G): first unit, u when the stage is empty
        hi = np.where(onehot, units + 1, 0).max(axis=1)
        held = np.zeros((p, self.groups))
        for i in range(p):
            for s in range(int(n[i])):
                held[i, s] = self.held_fraction(int(n[i]), s)
        need = self.table.memory_bytes(self.kind, self.starts[np.minimum(lo, u)], self.starts[np.maximum(hi, lo)],
                                       held)
        return np.where(hi > lo, need, 0.0)

    def device_mask(self, need_bytes: np.ndarray, used: np.ndarray) -> np.ndarray:
        """(P, D) which devices a stage may take: unused and with room; every unused device when
        none has room (the plan is then infeasible and scored so)."""
        fits = self.mem_bytes[None, :] >= need_bytes[:, None]
        ok = ~used & fits
        none = ~ok.any(axis=1)
        ok[none] = ~used[none]
        return ok

    # -- scoring -------------------------------------------------------------------------------
    def score(self, stages: np.ndarray, devices: np.ndarray) -> Scored:
        """Score P plans: stages (P, U) from `repair`, devices (P, G) (entries past n ignored)."""
        stages = np.atleast_2d(np.asarray(stages, dtype=int))
        devices = np.atleast_2d(np.asarray(devices, dtype=int))
        p = stages.shape[0]
        n = stages.max(axis=1) + 1
        value = np.full(p, np.inf)
        step = np.full(p, np.inf)
        best_m = np.zeros(p, dtype=int)
        feasible = np.zeros(p, dtype=bool)
        opts = self.options
        for k in np.unique(n):
            rows = np.flatnonzero(n == k)
            # cut positions: the start of the first unit of stages 1 .. k-1
            change = stages[rows, 1:] != stages[rows, :-1]
            cut_units = np.array([np.flatnonzero(c) + 1 for c in change]).reshape(len(rows), k - 1)
            cuts = self.starts[cut_units]
            devs = devices[rows, :k]
            for m in self.m_choices:
                sc = self.scorer.score(cuts, devs, m, opts.schedule)
                self.evaluations += len(rows)
                v, ok = self._values(sc, devs, m)
                better = v < value[rows]
                idx = rows[better]
                value[idx], step[idx], best_m[idx], feasible[idx] = v[better], sc.step_s[better], m, ok[better]
        return Scored(stages, devices, n, value, step, best_m, feasible)

    def _values(self, sc, devs: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
        opts, batch = self.options, self.graph.batch_size
        mem_share = (sc.peak_mem_bytes / self.mem_bytes[devs]).max(axis=1)
        over = np.maximum(0.0, mem_share - 1.0)
        short = objectives.shortfall(sc.samples_per_s, opts)
        link = sc.link_busy_s / np.maximum(sc.step_s, 1e-30)
        base = np.asarray(objectives.objective(opts).base(sc.step_s, sc.usd_per_step, sc.bottleneck_s, link,
                                                          mem_share, batch, opts, self.t_ref_s), dtype=float)
        return objectives.penalised(base, over, short), (over == 0.0) & (short == 0.0)

    # -- plans ---------------------------------------------------------------------------------
    def to_plan(self, stages: np.ndarray, devices: np.ndarray, microbatches: int, planner: str) -> Plan:
        n = int(stages.max()) + 1
        ids = self.cluster.ids
        out = []
        for s in range(n):
            units = np.flatnonzero(stages == s)
            lo, hi = self.starts[units[0]], self.starts[units[-1] + 1]
            out.append(Stage(self.order[lo:hi], (ids[int(devices[s])],)))
        return Plan(tuple(out), int(microbatches), self.options.schedule, planner, objective=self.options.objective)

    def from_plan(self, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """A plan in this space, as near as it goes: each unit takes the stage of most of its
        nodes (made monotone by `repair`), each stage its first device. For warm starts."""
        stage_of = {v: k for k, st in enumerate(plan.stages) for v in st.nodes}
        labels = np.empty(self.units, dtype=int)
        for u in range(self.units):
            members = [stage_of[v] for v in self.order[self.starts[u]:self.starts[u + 1]]]
            labels[u] = max(set(members), key=members.count)
        groups = max(self.groups, len(plan.stages))
        stages = repair(labels[None, :], groups)[0]
        ids = list(self.cluster.ids)
        devices = np.full(self.groups, -1, dtype=int)
        # stage k of the repaired labelling holds units labelled with some plan stage: use its device
        for s in range(min(int(stages.max()) + 1, self.groups)):
            src = labels[np.flatnonzero(stages == s)[0]]
            devices[s] = ids.index(plan.stages[src].devices[0])
        return np.minimum(stages, self.groups - 1), devices
