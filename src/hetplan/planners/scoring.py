"""Scoring plans for planners: the event simulator with one shared cost model, and the
objective of `hetplan.planners.objectives`; plus the message when nothing fits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.cost.stage_table import StageTable
from hetplan.errors import InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Estimate, Plan
from hetplan.planners import objectives
from hetplan.planners.options import PlanOptions
from hetplan.rows import idle_replicas as rows_idle
from hetplan.schedule import get_schedule
from hetplan.sim import simulate
from hetplan.sim.fast import fast_step_s
from hetplan.units import fmt_bytes


@dataclass
class Scorer:
    """Scores plans of one problem by the event simulator (results cached by plan)."""

    graph: Graph
    cluster: Cluster
    options: PlanOptions
    cost: CostModel = field(init=False)
    t_ref_s: float = field(init=False)
    simulations: int = field(init=False, default=0)
    simulated_events: int = field(init=False, default=0)  # `events` of the plans simulated so far
    _cache: dict = field(init=False, default_factory=dict)
    _programs: dict = field(init=False, default_factory=dict)  # the fast path's compiled programs by shape

    def __post_init__(self) -> None:
        self.cost = CostModel(self.graph, self.cluster)
        self.t_ref_s = objectives.reference_time_s(self.graph, self.cluster, self.cost)

    @staticmethod
    def key(plan: Plan) -> tuple:
        return (tuple((s.nodes, s.devices, s.recompute, s.shard, s.tp_devices) for s in plan.stages), plan.microbatches,
                plan.schedule)

    @staticmethod
    def events(plan: Plan) -> int:
        """About how many events the event simulator runs for a plan (its time goes with them):
        each replica's passes of each micro-batch and their messages."""
        return 4 * plan.microbatches * sum(len(st.all_devices) for st in plan.stages)

    def fits(self, plan: Plan) -> bool:
        """Whether every replica fits in memory by the cost model (`CostModel.stage_replicas_memory_bytes`),
        before the simulator is asked."""
        return all(need <= self.cluster.device(d).mem_bytes for k in range(len(plan.stages))
                   for d, need in self.cost.stage_replicas_memory_bytes(plan, k).items())

    def scored(self, plan: Plan) -> bool:
        """Whether the event simulator has scored this plan already."""
        return self.key(plan) in self._cache

    def estimate(self, plan: Plan) -> Estimate:
        k = self.key(plan)
        if k not in self._cache:
            self.simulations += 1
            self.simulated_events += self.events(plan)
            self._cache[k] = simulate(self.graph, self.cluster, plan, routing=self.options.routing,
                                      timeline=False, cost=self.cost).estimate
        return self._cache[k]

    def value(self, plan: Plan) -> float:
        """The objective; infinite for a plan beyond `--max-replicas`, or with a replica that gets
        no row of any micro-batch, as for one that does not fit."""
        if not self.options.allows(plan) or idle_replicas(self.cost, plan):
            return math.inf
        return objectives.value(self.estimate(plan), self.options, self.cluster, self.graph.batch_size, self.t_ref_s)

    def search_value(self, plan: Plan) -> float:
        value = objectives.search_value(self.estimate(plan), self.options, self.cluster, self.graph.batch_size,
                                        self.t_ref_s)
        excess = max(len(s.devices) for s in plan.stages) - (self.options.max_replicas or len(self.cluster.devices))
        return float(objectives.penalised(value, max(excess, 0), 0.0))

    def fast_keys(self, plans: list[Plan]) -> tuple[np.ndarray, np.ndarray]:
        """The fast path's step of each plan (`hetplan.sim.fast`: exact for chains of single
        devices, replicated stages folded) and the order the objective ranks them in by it
        (`Objective.rank`), plans beyond `--max-replicas` or with an idle replica last."""
        if not plans:
            return np.zeros(0), np.zeros(0, dtype=int)
        fast = self.fast_step_s(plans)
        obj = objectives.objective(self.options)
        usd = np.array([self.cost.usd_per_step(p.devices, float(t)) for p, t in zip(plans, fast, strict=True)])
        steady = np.array([self.cost.bottleneck_s(p) for p in plans]) if obj.track == "steady" else fast
        slow = self.graph.batch_size / np.maximum(fast, 1e-300) < (self.options.min_samples_per_s or 0) * 0.9
        banned = np.array([not self.options.allows(p) or bool(idle_replicas(self.cost, p)) for p in plans])
        keys = obj.rank(fast, usd, steady, slow)
        order = np.lexsort(tuple(np.broadcast_to(k, fast.shape) for k in reversed((banned, *keys))))
        return fast, order

    def fast_step_s(self, plans: list[Plan]) -> np.ndarray:
        """The fast path's step of each plan (`hetplan.sim.fast.fast_step_s`, its programs kept)."""
        return fast_step_s(self.graph, self.cluster, plans, self.cost, self._programs)

    def shortlist(self, plans: list[Plan], k: int) -> list[Plan]:
        """The k best plans by the fast path (`fast_keys`)."""
        if len(plans) <= k:
            return plans
        return [plans[int(i)] for i in self.fast_keys(plans)[1][:k]]

    def best(self, plans: list[Plan], planner: str) -> Plan:
        """The plan with the best objective; a clear error when none is feasible."""
        scored = [(self.value(p), i, p) for i, p in enumerate(plans)]
        value, _, plan = min(scored, key=lambda x: (x[0], x[1])) if scored else (math.inf, 0, None)
        if plan is None or not math.isfinite(value):
            raise self.infeasible(plans, planner)
        return plan

    def infeasible(self, plans: list[Plan], planner: str) -> InfeasibleError:
        fitting = [p for p in plans if self.estimate(p).feasible]
        if fitting and objectives.objective(self.options).floor:
            fastest = max(fitting, key=lambda p: self.estimate(p).samples_per_s)
            return InfeasibleError(
                f"no plan {planner} found reaches {self.options.min_samples_per_s:g} samples/s; the fastest "
                f"that fits does {self.estimate(fastest).samples_per_s:,.1f} samples/s: lower "
                f"--min-samples-per-s or add devices")
        return memory_infeasible(self.graph, self.cluster, self.options, self.closest(plans))

    def closest(self, plans: list[Plan]) -> tuple[Plan, str, int] | None:
        """Of plans that do not fit, the one that comes closest (the least peak memory over a
        device's memory, at its worst device), with that device and its peak."""
        best = None
        for plan in plans:
            est = self.estimate(plan)
            if not est.peak_mem_bytes:
                continue
            dev = max(est.peak_mem_bytes, key=lambda d: est.peak_mem_bytes[d] / self.cluster.device(d).mem_bytes)
            ratio = est.peak_mem_bytes[dev] / self.cluster.device(dev).mem_bytes
            if best is None or ratio < best[0]:
                best = (ratio, plan, dev, est.peak_mem_bytes[dev])
        return best[1:] if best else None


def idle_replicas(cost: CostModel, plan: Plan) -> list[tuple[int, str]]:
    """(stage, device) of every replica that gets no row of any micro-batch (`hetplan.rows`): it
    would hold the stage's weights and join its gradient sum for nothing; or, sharding its
    gradients, no row of some micro-batch (the runtime cannot run it: `rows.idle_replicas`)."""
    if all(len(s.devices) == 1 for s in plan.stages):
        return []
    idle = rows_idle(cost.plan_rows(plan), [s.shard >= 2 for s in plan.stages])
    return [(k, plan.stages[k].devices[p]) for k, p in idle]


def memory_infeasible(graph: Graph, cluster: Cluster, options: PlanOptions,
                      closest: tuple[Plan, str, int] | None = None) -> InfeasibleError:
    """Say what memory the model needs that the cluster does not have: a node that fits on no
    device, more than all devices hold, or else the shortfall of the `closest` plan tried."""
    table = StageTable.of_chain(CostModel(graph, cluster))
    one, at = table.kind(cluster.ids[:1]), np.arange(len(table.order))  # node k: the stage k -> k + 1
    k = int(np.argmax(table.memory_bytes(one, at, at + 1, 1.0)))
    worst = graph.by_id[table.order[k]]
    biggest = max(cluster.devices, key=lambda d: d.mem_bytes)
    single = float(table.weights_bytes(one, k, k + 1))
    if single > biggest.mem_bytes:
        return InfeasibleError(
            f"node {worst.id} ({worst.op}) alone needs {fmt_bytes(single)} for its weights, gradients and "
            f"optimizer state, more than the largest device ({biggest.id}, {fmt_bytes(biggest.mem_bytes)}): "
            "no split can fit it; use devices with more memory")
    # at the least, every weight copy; and every activation where the schedule holds all in flight
    need = float(table.memory_bytes(one, 0, table.last, 0.0 if get_schedule(options.schedule).bounded else 1.0))
    mems = sorted((d.mem_bytes for d in cluster.devices), reverse=True)
    total, count = 0, 0
    for mem in mems:
        total += mem
        count += 1
        if total >= need:
            break
    if total < need:
        return InfeasibleError(
            f"the model needs at least {fmt_bytes(need)} across its stages under {options.schedule} "
            f"(weights, gradients and Adam state{', all activations' if options.schedule == 'gpipe' else ''}), "
            f"but all {len(mems)} devices together have {fmt_bytes(sum(mems))}: add devices"
            + (" or use --schedule 1f1b" if options.schedule == "gpipe" else ""))
    if closest is not None:
        plan, dev, peak = closest
        rows = -(-graph.batch_size // plan.microbatches)
        n, device = len(plan.stages), cluster.device(dev)
        return InfeasibleError(
            f"no plan fits in memory: the closest tried ({n} stage{'s' if n > 1 else ''}, {plan.microbatches} "
            f"micro-batches of up to {rows} row{'s' if rows > 1 else ''}) needs {fmt_bytes(peak)} on {dev} "
            f"({device.type}), which has {fmt_bytes(device.mem_bytes)}: add devices or devices with more memory"
            + (", or use --schedule 1f1b" if options.schedule == "gpipe" else ""))
    return InfeasibleError(
        f"no plan fits in memory: the model needs at least {count} device{'s' if count > 1 else ''} with "
        f">= {fmt_bytes(mems[count - 1])} "
        f"({fmt_bytes(need)} in all under {options.schedule}) and a split that balances memory; "
        f"try more micro-batches{' or --schedule 1f1b' if options.schedule == 'gpipe' else ''}, or add devices")
