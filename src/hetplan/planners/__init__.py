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
from hetplan.cost import CostModel
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.plan import Plan, validate_plan
from hetplan.planners import baselines
from hetplan.planners.options import AUTO_SCHEDULE, PlanOptions
from hetplan.runtime.support import runtime_refusal
from hetplan.schedule import SCHEDULE_NAMES, get_schedule
from hetplan.sim import simulate

PlannerFn = Callable[[Graph, Cluster, PlanOptions], Plan]


@dataclass(frozen=True)
class PlannerSpec:
    name: str
    summary: str
    run: PlannerFn
    reports_progress: bool = False  # run(..., progress=callback(fraction done)) for long searches


def _dp(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    from hetplan.planners.dp import dp

    return dp(graph, cluster, options)


def _local_search(graph: Graph, cluster: Cluster, options: PlanOptions, progress=None) -> Plan:
    from hetplan.planners.search import local_search

    return local_search(graph, cluster, options, progress=progress)


def _rl(name: str):
    def run(graph: Graph, cluster: Cluster, options: PlanOptions, progress=None) -> Plan:
        from hetplan.planners import rl

        return getattr(rl, name)(graph, cluster, options, progress=progress)

    return run


def _exact(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    from hetplan.planners.exact import exact

    return exact(graph, cluster, options)


def _milp(graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    from hetplan.planners.milp import milp

    return milp(graph, cluster, options)


PLANNERS: MappingProxyType[str, PlannerSpec] = MappingProxyType({
    spec.name: spec
    for spec in (
        PlannerSpec("single", "the whole model on the fastest device that fits", baselines.single),
        PlannerSpec("data-parallel", "every device that fits holds the whole model; batch split by speed",
                    baselines.data_parallel),
        PlannerSpec("uniform", "equal numbers of nodes per stage, in topological order, one stage per device",
                    baselines.uniform),
        PlannerSpec("params", "stages balanced by parameter bytes (DeepSpeed's default), one per device",
                    baselines.params),
        PlannerSpec("balanced-time", "stages balanced by profiled time (torchgpipe's block partition), one per device",
                    baselines.balanced_time),
        PlannerSpec("dp", "antichain dynamic program over stages, devices, replicas and micro-batches", _dp),
        PlannerSpec("exact", "every valid plan of a small problem, by branch and bound on the simulator", _exact),
        PlannerSpec("milp", "objective throughput: the certified optimum (or a bound) of a mixed-integer program, "
                    "HiGHS", _milp),
        PlannerSpec("local-search", "simulated annealing from dp's plan, every move scored by the simulator",
                    _local_search, reports_progress=True),
        PlannerSpec("reinforce", "Hierarchical placer / TAPP: grouper + seq2seq placer trained with REINFORCE",
                    _rl("reinforce"), reports_progress=True),
        PlannerSpec("ppo", "Trinity: partition MLP + LSTM schedule network with attention, trained with PPO",
                    _rl("ppo"), reports_progress=True),
        PlannerSpec("heterps", "HeterPS: RL schedules layers to device types, then provisions device counts",
                    _rl("heterps"), reports_progress=True),
    )
})

BASELINES = ("single", "data-parallel", "uniform", "params", "balanced-time")
RL_PLANNERS = ("reinforce", "ppo", "heterps")


def get_planner(name: str) -> PlannerSpec:
    try:
        return PLANNERS[name]
    except KeyError:
        raise HetplanError(f"unknown planner {name!r} (planners: {', '.join(PLANNERS)})") from None


def replan(graph: Graph, cluster: Cluster, plan: Plan) -> Plan:
    """dp's plan for the devices there (devices lost or added: `runtime.elastic`), with the
    options the old plan records (its seed and routing)."""
    options = PlanOptions(seed=int(plan.meta.get("seed", 0) or 0), routing=plan.meta.get("routing", "relay"))
    return make_plan(graph, cluster, "dp", options)


def make_plan(graph: Graph, cluster: Cluster, planner: str, options: PlanOptions | None = None,
              progress: Callable[[float], None] | None = None) -> Plan:
    """Run a planner, check its plan and attach the estimate and the planning time. `progress`
    is called with the fraction done by planners that search for a while. With `--schedule
    auto` or an interleaved schedule the planner plans under 1F1B and the plan takes the best
    schedule for it (`_planned`)."""
    spec = get_planner(planner)
    options = options or PlanOptions()
    if options.microbatches and options.microbatches > graph.batch_size:
        raise HetplanError(f"--microbatches: {options.microbatches} micro-batches for a batch of {graph.batch_size} "
                           f"samples; use at most {graph.batch_size}")
    from hetplan.planners.refine import with_recompute, with_sequence_parallel, with_shard
    from hetplan.planners.tensor_groups import with_tensor_groups

    start = time.perf_counter()
    cost = CostModel(graph, cluster)
    planned = with_shard(cost, with_tensor_groups(lambda g, c, o: _planned(spec, g, c, o, progress), graph, cluster,
                                                  options), options.shard)
    planned = with_sequence_parallel(planned, options.sp)
    plan = replace(with_recompute(cost, planned, options.recompute), precision=graph.precision)
    planning_s = time.perf_counter() - start
    validate_plan(plan, graph, cluster)
    return replace(
        plan,
        graph=graph.name,
        cluster=cluster.name,
        predicted=simulate(graph, cluster, plan, routing=options.routing, timeline=False).estimate,
        meta={**plan.meta, "planning_s": round(planning_s, 6), "seed": options.seed, "routing": options.routing,
              "batch_size": graph.batch_size,  # the samples per step it was planned at
              # what hetplan run would say of this plan on this cluster (None: it runs)
              "runtime_refusal": runtime_refusal(plan, cluster)},
    )


def _run(spec: PlannerSpec, graph: Graph, cluster: Cluster, options: PlanOptions,
         progress: Callable[[float], None] | None) -> Plan:
    if spec.reports_progress and progress is not None:
        return spec.run(graph, cluster, options, progress=progress)
    return spec.run(graph, cluster, options)


def _planned(spec: PlannerSpec, graph: Graph, cluster: Cluster, options: PlanOptions,
             progress: Callable[[float], None] | None) -> Plan:
    """The planner's plan under the schedule asked for. Planners plan chains of one stage per
    device: under `auto` or an interleaved schedule, they plan under 1F1B and `_with_schedule`
    takes it from there; a plan that does not pipeline (data parallel) cannot interleave, so then
    the best straight pipeline (`max_replicas` 1) is tried."""
    asked = options.schedule
    if asked != AUTO_SCHEDULE and not get_schedule(asked).interleaved:
        return _run(spec, graph, cluster, options, progress)
    chain = replace(options, schedule="1f1b")
    plan = _with_schedule(graph, cluster, chain, _run(spec, graph, cluster, chain, progress), asked)
    if asked == AUTO_SCHEDULE or plan.schedule == asked:
        return plan
    if options.max_replicas != 1:
        plan = _with_schedule(graph, cluster, chain, spec.run(graph, cluster, replace(chain, max_replicas=1)), asked)
    if plan.schedule != asked:
        raise HetplanError(f"--schedule {asked}: the {plan.planner} plan has {len(plan.stages)} stage(s) on "
                           f"{len(plan.devices)} device(s), which cannot take {asked}'s turns (it needs 2 or more "
                           "stages on separate devices and more nodes than stages); use --schedule auto or 1f1b")
    return plan


def _with_schedule(graph: Graph, cluster: Cluster, options: PlanOptions, plan: Plan, asked: str) -> Plan:
    """The planner's 1F1B plan under the schedule asked for: `auto`, whichever the objective
    prefers; an interleaved one, the best of its interleavings (`refine.best_schedule`; the plan
    as it is where it has none)."""
    from hetplan.planners.refine import best_schedule
    from hetplan.planners.scoring import Scorer

    names = SCHEDULE_NAMES if asked == AUTO_SCHEDULE else (asked,)
    return best_schedule(Scorer(graph, cluster, options), plan, names)


def best_baseline(graph: Graph, cluster: Cluster, options: PlanOptions | None = None) -> Plan | None:
    """The fastest of the baselines' plans that fit in memory (None if none does)."""
    fitting = []
    for name in BASELINES:
        try:
            plan = make_plan(graph, cluster, name, options)
        except HetplanError:
            continue
        if plan.predicted is not None and plan.predicted.feasible:
            fitting.append(plan)
    return min(fitting, key=lambda p: p.predicted.step_s, default=None)


__all__ = ["BASELINES", "RL_PLANNERS", "best_baseline", "PLANNERS", "PlanOptions", "PlannerSpec", "get_planner",
           "make_plan"]
