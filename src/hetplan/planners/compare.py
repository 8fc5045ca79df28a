"""Several planners on one problem, side by side, each plan scored by the event simulator and
the user's objective (`hetplan compare`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.io.serde import to_dict
from hetplan.plan import Plan
from hetplan.planners import BASELINES, PlanOptions, make_plan, objectives
from hetplan.planners.objectives import memory_share


@dataclass(frozen=True)
class Row:
    planner: str
    plan: Plan | None
    value: float  # the objective (lower is better), inf when infeasible
    error: str | None = None  # why the planner gave no plan

    @property
    def planning_s(self) -> float | None:
        return None if self.plan is None else float(self.plan.meta.get("planning_s", 0.0))


@dataclass(frozen=True)
class Comparison:
    graph: str
    cluster: str
    options: PlanOptions
    rows: tuple[Row, ...]

    @property
    def best(self) -> Row | None:
        scored = [r for r in self.rows if math.isfinite(r.value)]
        return min(scored, key=lambda r: r.value) if scored else None

    def gain_over_baselines(self, row: Row) -> float | None:
        """How much better than the best baseline the row is, as a fraction of the baseline's
        objective (for time: 0.25 = a 25% shorter step)."""
        base = [r.value for r in self.rows if r.planner in BASELINES and math.isfinite(r.value)]
        if not base or not math.isfinite(row.value) or row.planner in BASELINES:
            return None
        return (min(base) - row.value) / min(base)

    def to_json(self, cluster: Cluster | None = None) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            out: dict[str, Any] = {"planner": r.planner, "error": r.error}
            if r.plan is not None and r.plan.predicted is not None:
                est = r.plan.predicted
                out.update({
                    "stages": len(r.plan.stages), "devices": len(r.plan.devices),
                    "microbatches": r.plan.microbatches, "step_s": est.step_s, "samples_per_s": est.samples_per_s,
                    "usd_per_step": est.usd_per_step, "usd_per_1k_samples": est.usd_per_1k_samples,
                    "feasible": math.isfinite(r.value), "fits_memory": est.feasible,
                    "peak_mem_share": r.plan.meta.get("peak_mem_share"), "planning_s": r.planning_s,
                    "objective_value": r.value if math.isfinite(r.value) else None,
                    "gain_over_best_baseline": self.gain_over_baselines(r),
                    "plan": to_dict(r.plan),  # drawn by `hetplan report`
                })
            else:
                out.update({"stages": None, "step_s": None, "samples_per_s": None, "usd_per_step": None,
                            "feasible": False, "planning_s": None})
            rows.append(out)
        best = self.best
        return {"kind": "comparison", "graph": self.graph, "cluster": self.cluster,
                "objective": self.options.objective, "objective_is": objectives.describe(self.options),
                "best": best.planner if best else None, "rows": rows}


def compare(graph: Graph, cluster: Cluster, planners: Sequence[str], options: PlanOptions,
            progress: Callable[[str, float], None] | None = None) -> Comparison:
    """Run each planner; a planner that cannot plan gets a row with its error instead."""
    from hetplan.planners.scoring import Scorer

    scorer = Scorer(graph, cluster, options)
    rows = []
    for name in planners:
        if progress is not None:
            progress(name, 0.0)
        try:
            plan = make_plan(graph, cluster, name, options,
                             progress=(lambda done, name=name: progress(name, done)) if progress else None)
        except HetplanError as exc:
            rows.append(Row(name, None, math.inf, str(exc)))
            continue
        est = plan.predicted
        value = objectives.value(est, options, cluster, graph.batch_size, scorer.t_ref_s)
        plan = replace(plan, meta={**plan.meta, "peak_mem_share": memory_share(est, cluster)})
        rows.append(Row(name, plan, value))
    if progress is not None and planners:
        progress(planners[-1], 1.0)
    return Comparison(graph.name, cluster.name, options, tuple(rows))
