"""Elastic training: when a worker dies, the launcher re-plans on the devices left and continues
from the last checkpoint, which any plan of the model loads (`runtime.checkpoint`). After Varuna
(Athlur et al., EuroSys 2022: re-partitioning on spot VMs from checkpoints) and Sailor
(re-planning as GPUs of each type come and go); Oobleck (Jang et al., SOSP 2023) instead keeps
pipeline templates ready, trading planning time for memory.

The re-plan is dp's (`planners.make_plan`) with the plan's own options that the plan records
(precision, routing, seed), on the run's graph at its batch, over the cluster without the lost
devices; a run that has no checkpoint yet starts again from its first step. What each change
cost is reported: the steps since the checkpoint, and the seconds from the death to every worker
training again (re-planning, starting the workers, tracing, loading the checkpoint).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.plan import Plan
from hetplan.runtime.launch import WorkerFailure, launch
from hetplan.runtime.settings import RunSettings

MAX_RESTARTS = 3


@dataclass(frozen=True)
class Change:
    """One re-plan: the devices lost, the step the run had begun, the checkpoint it went on from,
    the new plan's shape and predicted step, and the seconds from the failure to training again."""

    lost: tuple[str, ...]
    at_step: int
    from_step: int
    stages: int
    workers: int
    predicted_step_s: float
    failed_epoch_s: float  # when the launcher saw the death (time.time())
    restart_s: float | None = None  # from then to every worker training again

    @property
    def steps_lost(self) -> int:
        return max(self.at_step - self.from_step, 0)

    def line(self) -> str:
        return (f"lost {', '.join(self.lost)} at step {self.at_step}: re-planned on {self.workers} workers "
                f"({self.stages} stage{'s' if self.stages != 1 else ''}, predicted {self.predicted_step_s * 1e3:.1f} "
                f"ms a step), went on from step {self.from_step} ({self.steps_lost} steps lost)"
                + (f", training again {self.restart_s:.1f} s after the failure" if self.restart_s is not None else ""))


def replan(graph: Graph, cluster: Cluster, plan: Plan) -> Plan:
    """dp's plan for the devices left, with the options the old plan records."""
    from hetplan.planners import make_plan
    from hetplan.planners.options import PlanOptions

    options = PlanOptions(seed=int(plan.meta.get("seed", 0) or 0), routing=plan.meta.get("routing", "relay"))
    return make_plan(graph, cluster, "dp", options)


class _Watch:
    """The launcher's progress calls, passed on; notes when every worker has begun step `first`."""

    def __init__(self, first: int, progress: Callable[[int, int], None] | None) -> None:
        self.first, self.progress, self.training_at = first, progress, None

    def __call__(self, done: int, total: int) -> None:
        if self.training_at is None and done > self.first:
            self.training_at = time.time()
        if self.progress is not None:
            self.progress(done, total)


def _timed(changes: list[Change], watch: _Watch) -> None:
    """The last change's time to training again, once the run after it has trained."""
    if changes and changes[-1].restart_s is None and watch.training_at is not None:
        changes[-1] = replace(changes[-1], restart_s=watch.training_at - changes[-1].failed_epoch_s)


def run_elastic(plan: Plan, cluster: Cluster, model: str, graph: Graph | None, settings: RunSettings,
                progress=None, source: str | None = None, say: Callable[[str], None] = lambda _: None,
                max_restarts: int = MAX_RESTARTS):
    """`run_plan`, re-planned onto the devices left each time a worker dies (at most
    `max_restarts` times); returns the last run's report and the changes."""
    from hetplan.graph import at_batch
    from hetplan.runtime.checkpoint import latest_step
    from hetplan.runtime.run import _report, keep, prepare_run

    if graph is None:
        raise HetplanError("--elastic re-plans on the devices left: give the run its graph (--graph)")
    if settings.checkpoint_dir is None:
        raise HetplanError("--elastic goes on from the last checkpoint: give --checkpoint-dir DIR (and "
                           "--checkpoint-every K, else only the last step is saved)")
    changes: list[Change] = []
    while True:
        spec, first = prepare_run(plan, cluster, model, graph, settings, source)
        watch = _Watch(first, progress)
        try:
            result = launch(spec, progress=watch)
        except WorkerFailure as failure:
            _timed(changes, watch)
            if not failure.devices or len(changes) >= max_restarts:
                raise
            failed_at = time.time()
            left = [d for d in cluster.ids if d not in failure.devices]
            if not left:
                raise
            cluster = cluster.subset(left, f"{cluster.name} less {len(cluster.ids) - len(left)}")
            plan = replan(at_batch(graph, spec.settings.batch_size), cluster, plan)
            back = latest_step(settings.checkpoint_dir) or 0
            settings = replace(settings, resume=back > 0)
            changes.append(Change(failure.devices, failure.step, back, len(plan.stages), len(plan.devices),
                                  plan.predicted.step_s if plan.predicted else float("nan"), failed_at))
            say(f"lost {', '.join(failure.devices)} at step {failure.step}; re-planned on {len(left)} devices, "
                f"going on from step {back}")
            continue
        _timed(changes, watch)
        graph_at = at_batch(graph, spec.settings.batch_size)
        report = _report(spec, first, result, graph_at, cluster)
        keep(report, spec.settings.out_dir, graph_at, cluster, source)
        return report, tuple(changes)
