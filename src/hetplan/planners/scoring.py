"""Scoring plans for planners: the event simulator with one shared cost model, and the
objective of `hetplan.planners.objectives`; plus the message when nothing fits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.cost.formulas import stage_memory_bytes, weight_bytes
from hetplan.errors import InfeasibleError
from hetplan.graph import Graph
from hetplan.plan import Estimate, Plan
from hetplan.planners import objectives
from hetplan.planners.options import PlanOptions
from hetplan.schedule import get_schedule
from hetplan.sim import simulate
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
    _cache: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.cost = CostModel(self.graph, self.cluster)
        self.t_ref_s = objectives.reference_time_s(self.graph, self.cluster, self.cost)

    @staticmethod
    def key(plan: Plan) -> tuple:
        return (tuple((s.nodes, s.devices) for s in plan.stages), plan.microbatches, plan.schedule)

    def estimate(self, plan: Plan) -> Estimate:
        k = self.key(plan)
        if k not in self._cache:
            self.simulations += 1
            self._cache[k] = simulate(self.graph, self.cluster, plan, routing=self.options.routing,
                                      timeline=False, cost=self.cost).estimate
        return self._cache[k]

    def value(self, plan: Plan) -> float:
        """The objective; infinite for a plan beyond `--max-replicas`, as for one that does not fit."""
        if not self.options.allows(plan):
            return math.inf
        return objectives.value(self.estimate(plan), self.options, self.cluster, self.graph.batch_size, self.t_ref_s)

    def search_value(self, plan: Plan) -> float:
        value = objectives.search_value(self.estimate(plan), self.options, self.cluster, self.graph.batch_size,
                                        self.t_ref_s)
        excess = max(len(s.devices) for s in plan.stages) - (self.options.max_replicas or len(self.cluster.devices))
        return float(objectives.penalised(value, max(excess, 0), 0.0))

    def best(self, plans: list[Plan], planner: str) -> Plan:
        """The plan with the best objective; a clear error when none is feasible."""
        scored = [(self.value(p), i, p) for i, p in enumerate(plans)]
        value, _, plan = min(scored, key=lambda x: (x[0], x[1])) if scored else (math.inf, 0, None)
        if plan is None or not math.isfinite(value):
            raise self.infeasible(plans, planner)
        return plan

    def infeasible(self, plans: list[Plan], planner: str) -> InfeasibleError:
        fitting = [p for p in plans if self.estimate(p).feasible]
        if fitting and self.options.objective == "cost":
            fastest = max(fitting, key=lambda p: self.estimate(p).samples_per_s)
            return InfeasibleError(
                f"no plan {planner} found reaches {self.options.min_samples_per_s:g} samples/s; the fastest "
                f"that fits does {self.estimate(fastest).samples_per_s:,.1f} samples/s: lower "
                f"--min-samples-per-s or add devices")
        return memory_infeasible(self.graph, self.cluster, self.options)


def memory_infeasible(graph: Graph, cluster: Cluster, options: PlanOptions) -> InfeasibleError:
    """Say what memory the model needs that the cluster does not have."""
    worst = max(graph.nodes, key=lambda n: stage_memory_bytes(n.param_bytes, n.act_bytes, 1.0))
    biggest = max(cluster.devices, key=lambda d: d.mem_bytes)
    single = weight_bytes(worst.param_bytes)
    if single > biggest.mem_bytes:
        return InfeasibleError(
            f"node {worst.id} ({worst.op}) alone needs {fmt_bytes(single)} for its weights, gradients and "
            f"optimizer state, more than the largest device ({biggest.id}, {fmt_bytes(biggest.mem_bytes)}): "
            "no split can fit it; use devices with more memory")
    # at the least, every weight copy; and every activation where the schedule holds all in flight
    need = stage_memory_bytes(graph.param_bytes_total, graph.act_bytes_total,
                              0.0 if get_schedule(options.schedule).bounded else 1.0)
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
    return InfeasibleError(
        f"no plan fits in memory: the model needs at least {count} device{'s' if count > 1 else ''} with "
        f">= {fmt_bytes(mems[count - 1])} "
        f"({fmt_bytes(need)} in all under {options.schedule}) and a split that balances memory; "
        f"try more micro-batches{' or --schedule 1f1b' if options.schedule == 'gpipe' else ''}, or add devices")
