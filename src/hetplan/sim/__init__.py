"""Simulation of one training step under a plan.

`simulate(graph, cluster, plan)` replays the step with the event-driven simulator
(`hetplan.sim.engine`) and returns the `Estimate` (step time, throughput, busy time and peak
memory per device, bubble, bytes per link, price, memory violations) and the timeline of every
action. `hetplan.sim.fast` scores many pipeline plans at once with numpy, for planners; a
planner's final choice is re-scored here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.cost.table import ROUTINGS, StepCosts, stage_pair_bytes, step_costs
from hetplan.graph import Graph
from hetplan.lowering import Lowered, lower, rank_groups, shape_groups, sum_ranks
from hetplan.plan import Estimate, Plan
from hetplan.sim.engine import run_events
from hetplan.timeline import Span, Timeline
from hetplan.units import fmt_bytes


@dataclass(frozen=True)
class Simulation:
    estimate: Estimate
    timeline: Timeline | None


def memory_violations(cluster: Cluster, plan: Plan, peak_mem_bytes: dict[str, int]) -> list[str]:
    """One readable line per device whose peak memory exceeds what it has."""
    violations = []
    for d, need in peak_mem_bytes.items():
        device = cluster.device(d)
        if need > device.mem_bytes:
            stages = [str(i) for i, s in enumerate(plan.stages) if d in s.devices]
            violations.append(f"stage{'s' if len(stages) > 1 else ''} {', '.join(stages)} on {d} ({device.type}) "
                              f"needs {fmt_bytes(need)}, has {fmt_bytes(device.mem_bytes)}")
    return violations


def for_groups(plan: Plan, per_device: Mapping[str, float]) -> dict:
    """`per_device` (keyed by each replica's first device) with a tensor-parallel group's other
    devices given the first's value: they run the same passes on their shards."""
    out = dict(per_device)
    for stage in plan.stages:
        for group in stage.tp_devices:
            for d in group[1:]:
                if group[0] in per_device:
                    out[d] = per_device[group[0]]
    return out


def simulate(graph: Graph, cluster: Cluster, plan: Plan, *, routing: str = "relay", timeline: bool = True,
             cost: CostModel | None = None) -> Simulation:
    """Simulate one training step of a valid plan (see `hetplan.plan.validate_plan`).

    routing: `relay` (default: only neighbouring stages talk, as in hetplan's runtime) or
    `direct` (stages form a DAG; each tensor goes straight to the stages that use it, and
    independent branches run in parallel); see `hetplan.cost.table`.
    timeline: keep every action (off when only the estimate is wanted)."""
    cm = cost or CostModel(graph, cluster)
    model = step_costs(graph, cluster, plan, routing, cm)
    result = run_events(model, cluster, step_lists(cm, plan, routing, model.syncs), record=timeline)
    return Simulation(_estimate(graph, cluster, plan, model, result, cm), result.timeline)


def lowered_step(graph: Graph, cluster: Cluster, plan: Plan, cost: CostModel | None = None,
                 routing: str = "relay") -> Lowered:
    """Each worker's list of the step's passes, messages and gradient sums (`hetplan.lowering`),
    its workers numbered and its rows split as a run of the plan numbers and splits them; under
    `direct` routing (what the simulator can score, never run), with messages between every pair
    of stages that a graph edge joins instead of between neighbours."""
    cm = cost or CostModel(graph, cluster)
    syncs = tuple(sync.members for sync in cm.sync_costs(plan))
    return _lower(plan, rank_groups(plan, lambda d: cluster.device(d).host), cm.plan_rows(plan), syncs,
                  _links(cm, plan, routing))


def _links(cm: CostModel, plan: Plan, routing: str) -> tuple[tuple[int, int], ...] | None:
    """The pairs of stages that talk: None (neighbours) under `relay`, else those a graph edge joins."""
    return None if routing == "relay" else tuple(stage_pair_bytes(cm.graph, plan, routing))


def _lower(plan: Plan, groups, rows, syncs, links) -> Lowered:
    """`lower` of the plan with its workers numbered by `groups` and each sum's ranks from them."""
    sums = [ranks for members in syncs for ranks in sum_ranks(groups, members)]
    return lower(plan.schedule, groups, plan.stage_ranks, rows, sums, links)


def step_lists(cm: CostModel, plan: Plan, routing: str = "relay", syncs: Sequence | None = None) -> Lowered:
    """The plan's step as the event simulator reads it: each stage replica's list
    (`hetplan.lowering.lower`, as `lowered_step`), a tensor-parallel group's first rank's alone
    (the others run the same passes, and the cost table's message times count the copies sent to
    every rank of a group), its workers numbered by the plan's shape (`lowering.shape_groups`);
    kept by the cost model, since planners simulate many plans of one shape. `syncs`: the plan's
    gradient sums, where the caller has them (`StepCosts.syncs`)."""
    degrees = tuple((1,) * len(st.degrees) for st in plan.stages)
    syncs = tuple(sync.members for sync in (cm.sync_costs(plan) if syncs is None else syncs))
    links = _links(cm, plan, routing)
    rows = cm.plan_rows(plan)

    def make() -> Lowered:
        return _lower(plan, shape_groups(degrees, plan.stage_ranks), rows, syncs, links)

    return cm.kept(("lowered", plan.schedule, degrees, plan.stage_ranks, rows, syncs, links), make,
                   lambda lowered: sum(map(len, lowered.ops)))


def _estimate(graph: Graph, cluster: Cluster, plan: Plan, model: StepCosts, result, cm: CostModel) -> Estimate:
    step = result.step_s
    used = plan.devices
    # the simulated peak of its stashed activations, as they were held, not a schedule's bound
    peak = for_groups(plan, model.peak_memory_bytes(result.peak_act_bytes))
    violations = memory_violations(cluster, plan, peak)
    busy_s = for_groups(plan, result.busy_s)
    busy = math.fsum(busy_s.values())
    return Estimate(
        step_s=step,
        samples_per_s=graph.batch_size / step if step > 0 else 0.0,
        busy_s=busy_s,
        peak_mem_bytes=peak,
        bubble_fraction=max(0.0, 1.0 - busy / (len(used) * step)) if step > 0 else 0.0,
        link_bytes={k: round(v) for k, v in result.link_bytes.items()},
        usd_per_step=cm.usd_per_step(used, step),
        feasible=not violations,
        violations=tuple(violations),
        method="event",
        link_busy_s=result.link_busy_s,
        bottleneck_s=cm.bottleneck_s(plan),
    )


__all__ = ["ROUTINGS", "Simulation", "Span", "Timeline", "lowered_step", "memory_violations", "simulate"]
