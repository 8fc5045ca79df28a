"""Planners: a registry from name to planner, and `make_plan`, which runs one.

A planner is a function `(graph, cluster, options) -> Plan`. `make_plan` times it, checks the
plan it returns (`validate_plan`), attaches the event simulator's estimate and records the planning
time, so that every planner's output is checked and scored the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.plan import OBJECTIVES, SCHEDULES, Plan, validate_plan
from hetplan.planners import baselines
from hetplan.sim import simulate


@dataclass(frozen=True)
class PlanOptions:
    """What the user asks of a planner.

    microbatches: the number of micro-batches, or None to let the planner choose.
    schedule: `gpipe` or `1f1b`.
    objective: `time`, `cost` or `mdpe` (planners that do not optimise ignore it).
    seed: for planners that draw random numbers.
    budget_s: a time budget for search planners (None: the planner's default).
    min_samples_per_s: the throughput floor of the `cost` objective.
    """

    microbatches: int | None = None
    schedule: str = "1f1b"
    objective: str = "time"
    seed: int = 0
    budget_s: float | None = None
    min_samples_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.microbatches is not None and (
            isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1
        ):
            raise HetplanError(f"--microbatches: {self.microbatches!r} is not a whole number >= 1")
        if self.schedule not in SCHEDULES:
            raise HetplanError(f"--schedule: {self.schedule!r} is unknown (allowed: {', '.join(SCHEDULES)})")
        if self.objective not in OBJECTIVES:
            raise HetplanError(f"--objective: {self.objective!r} is unknown (allowed: {', '.join(OBJECTIVES)})")


PlannerFn = Callable[[Graph, Cluster, PlanOptions], Plan]


@dataclass(frozen=True)
class PlannerSpec:
    name: str
    summary: str
    run: PlannerFn


PLANNERS: MappingProxyType[str, PlannerSpec] = MappingProxyType({
    spec.name: spec
    for spec in (
        PlannerSpec("single", "the whole model on the fastest device that fits", baselines.single),
        PlannerSpec("uniform", "equal numbers of nodes per stage, in topological order, one stage per device",
                    baselines.uniform),
    )
})


def get_planner(name: str) -> PlannerSpec:
    try:
        return PLANNERS[name]
    except KeyError:
        raise HetplanError(f"unknown planner {name!r} (planners: {', '.join(PLANNERS)})") from None


def make_plan(graph: Graph, cluster: Cluster, planner: str, options: PlanOptions | None = None) -> Plan:
    """Run a planner, check its plan and attach the estimate and the planning time."""
    spec = get_planner(planner)
    options = options or PlanOptions()
    start = time.perf_counter()
    plan = spec.run(graph, cluster, options)
    planning_s = time.perf_counter() - start
    validate_plan(plan, graph, cluster)
    return replace(
        plan,
        graph=graph.name,
        cluster=cluster.name,
        predicted=simulate(graph, cluster, plan, timeline=False).estimate,
        meta={**plan.meta, "planning_s": round(planning_s, 6), "seed": options.seed},
    )


__all__ = ["PLANNERS", "PlanOptions", "PlannerSpec", "get_planner", "make_plan"]
