"""Elastic training: when a worker dies, the launcher re-plans on the devices left and continues
from the last checkpoint, which any plan of the model loads (`runtime.checkpoint`); when devices
are added to the cluster file, it plans for them all and, where the gain is worth the restart,
has the run stop at a checkpoint a few steps on and go on under the new plan. After Varuna
(Athlur et al., EuroSys 2022: re-partitioning on spot VMs from checkpoints) and Sailor
(re-planning as GPUs of each type come and go); Oobleck (Jang et al., SOSP 2023) instead keeps
pipeline templates ready, trading planning time for memory.

The re-plan is the caller's (`planners.replan`: dp's, with the options the plan records, on the
run's graph at its batch; the runtime sits beside the planners, not above them). The decision to take added devices is
`availability.decide`'s, the one `hetplan replay` weighs: the predicted gain over the rest of the
run against the samples lost while restarting (the first start's time to training, measured). A
death forces the change; a run without a checkpoint yet starts again from its first step. What
each change cost is reported: the steps since the checkpoint, and the seconds from the failure
(or the stop) to every worker training again (re-planning, starting the workers, tracing,
loading the checkpoint).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.io.serde import atomic_write_text
from hetplan.plan import Plan
from hetplan.runtime.launch import WorkerFailure, furthest_step, launch
from hetplan.runtime.settings import RunSettings
from hetplan.runtime.supervise import STOP_FILE

MAX_RESTARTS = 3
Replan = Callable[[Graph, Cluster, Plan], Plan]  # the plan for the devices there, given the old one
RESTART_GUESS_S = 60.0  # a restart's cost before the first start has been measured
STOP_AHEAD = 2  # steps past those begun at which the launcher has a growing run stop


@dataclass(frozen=True)
class Change:
    """One re-plan: the devices lost (or added), the step the run had begun (or stopped at), the
    checkpoint it went on from, the new plan's shape and predicted step, and the seconds from the
    failure (or the stop) to training again."""

    lost: tuple[str, ...]
    at_step: int
    from_step: int
    stages: int
    workers: int
    predicted_step_s: float
    failed_epoch_s: float  # when the launcher saw the death, or the run stopped (time.time())
    restart_s: float | None = None  # from then to every worker training again
    added: tuple[str, ...] = ()

    @property
    def steps_lost(self) -> int:
        return max(self.at_step - self.from_step, 0)

    def line(self) -> str:
        what = f"lost {', '.join(self.lost)}" if self.lost else f"added {', '.join(self.added)}"
        return (f"{what} at step {self.at_step}: re-planned on {self.workers} workers ({self.stages} "
                f"stage{'s' if self.stages != 1 else ''}, predicted {self.predicted_step_s * 1e3:.1f} ms a step), went "
                f"on from step {self.from_step} ({self.steps_lost} steps lost)"
                + (f", training again {self.restart_s:.1f} s after the "
                   f"{'failure' if self.lost else 'stop'}" if self.restart_s is not None else ""))


class _Watch:
    """The launcher's progress calls, passed on; notes when every worker has begun step `first`,
    and hands each call to `grow` (devices added)."""

    def __init__(self, first: int, progress: Callable[[int, int], None] | None, grow=None) -> None:
        self.first, self.progress, self.grow = first, progress, grow
        self.started_at, self.training_at = time.time(), None

    def __call__(self, done: int, total: int) -> None:
        if self.training_at is None and done > self.first:
            self.training_at = time.time()
        if self.grow is not None and self.training_at is not None:
            self.grow.check(done)
        if self.progress is not None:
            self.progress(done, total)


class _Growth:
    """The cluster file, watched while a run trains: devices added are planned for at once and,
    where `availability.decide` finds it worth the restart, the run is asked to stop at the
    checkpoint of a step no worker has begun (`supervise.stop_step`), to go on under that plan."""

    def __init__(self, path: str | None, cluster: Cluster, plan: Plan, graph: Graph, steps: int, out_dir: Path,
                 restart_s: float, say: Callable[[str], None], replan: Replan, world: int) -> None:
        self.path = Path(path) if path and Path(path).is_file() else None
        self.replan, self.world = replan, world
        self.seen = self._mtime()
        self.cluster, self.plan, self.graph, self.steps, self.out_dir = cluster, plan, graph, steps, out_dir
        self.restart_s, self.say = restart_s, say
        self.next: tuple[Cluster, Plan, tuple[str, ...], int] | None = None

    def _mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime if self.path is not None else None
        except OSError:
            return None

    def poke(self) -> None:
        """Read the cluster file again at the next check, changed or not (SIGUSR1 to the launcher)."""
        self.seen = float("nan")

    def check(self, done: int) -> None:
        mtime = self._mtime()
        if self.next is not None or mtime == self.seen:
            return
        self.seen = mtime
        from hetplan.io.clusters import load_cluster

        try:
            bigger = load_cluster(self.path)
        except HetplanError as exc:
            self.say(f"{self.path} changed but cannot be read ({exc}); going on as planned")
            return
        added = tuple(d for d in bigger.ids if d not in self.cluster.ids)
        bigger = bigger.subset([d for d in bigger.ids if d in self.cluster.ids or d in added], bigger.name)
        if added:
            self._weigh(bigger, added, done)

    def _weigh(self, bigger: Cluster, added: tuple[str, ...], done: int) -> None:
        from hetplan.availability import choice, decide

        new = self.replan(self.graph, bigger, self.plan)
        running, proposed = choice(self.cluster, self.plan), choice(bigger, new)
        stop = max(done, furthest_step(self.out_dir, self.world)) + STOP_AHEAD  # they went on while dp planned
        left_s = (self.steps - stop) * (self.plan.predicted.step_s if self.plan.predicted else 0.0)
        if stop >= self.steps or not decide("when-worth-it", running, True, proposed, self.restart_s, left_s):
            self.say(f"added {', '.join(added)}: a plan for them ({proposed.samples_per_s:,.1f} against "
                     f"{running.samples_per_s:,.1f} samples/s) is not worth a restart of {self.restart_s:.0f} s "
                     f"over the {max(self.steps - stop, 0)} steps left; going on as planned")
            return
        atomic_write_text(self.out_dir / STOP_FILE, str(stop))
        self.next = (bigger, new, added, stop)
        self.say(f"added {', '.join(added)}: stopping at step {stop}'s checkpoint to go on under a plan for them")


def _timed(changes: list[Change], watch: _Watch) -> None:
    """The last change's time to training again, once the run after it has trained."""
    if changes and changes[-1].restart_s is None and watch.training_at is not None:
        changes[-1] = replace(changes[-1], restart_s=watch.training_at - changes[-1].failed_epoch_s)


@contextlib.contextmanager
def _poked_by_sigusr1(grow: _Growth | None):
    """SIGUSR1 to the launcher has it read the cluster file again (where it runs in the main
    thread, as `hetplan run` does; elsewhere the file's changes alone are seen)."""
    if grow is None or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        yield
        return
    before = signal.signal(signal.SIGUSR1, lambda *_: grow.poke())
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, before)


def _checks(graph: Graph | None, settings: RunSettings) -> None:
    if graph is None:
        raise HetplanError("--elastic re-plans on the devices there: give the run its graph (--graph)")
    if settings.checkpoint_dir is None:
        raise HetplanError("--elastic goes on from the last checkpoint: give --checkpoint-dir DIR (and "
                           "--checkpoint-every K, else only the last step is saved)")


def run_elastic(plan: Plan, cluster: Cluster, model: str, graph: Graph | None, settings: RunSettings,
                replan: Replan, progress=None, source: str | None = None, say: Callable[[str], None] = lambda _: None,
                max_restarts: int = MAX_RESTARTS, cluster_file: str | None = None):
    """`run_plan`, re-planned by `replan` (`planners.replan`) onto the devices left each time a
    worker dies, and onto devices added to `cluster_file` where worth it (at most `max_restarts`
    changes); returns the last run's report and the changes."""
    from hetplan.graph import at_batch
    from hetplan.runtime.checkpoint import latest_step
    from hetplan.runtime.run import _report, keep, prepare_run

    _checks(graph, settings)
    settings = replace(settings, elastic=True)
    changes: list[Change] = []
    restart_s = RESTART_GUESS_S
    while True:
        spec, first = prepare_run(plan, cluster, model, graph, settings, source)
        graph_at = at_batch(graph, spec.settings.batch_size)
        grow = _Growth(cluster_file, cluster, plan, graph_at, spec.settings.steps, spec.settings.out_dir, restart_s,
                       say, replan, spec.world) if len(changes) < max_restarts else None
        watch = _Watch(first, progress, grow)
        try:
            with _poked_by_sigusr1(grow):
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
            plan = replan(graph_at, cluster, plan)
            back = latest_step(settings.checkpoint_dir) or 0
            settings = replace(settings, resume=back > 0)
            changes.append(Change(failure.devices, failure.step, back, len(plan.stages), len(plan.devices),
                                  plan.predicted.step_s if plan.predicted else float("nan"), failed_at))
            say(f"lost {', '.join(failure.devices)} at step {failure.step}; re-planned on {len(left)} devices, "
                f"going on from step {back}")
            continue
        _timed(changes, watch)
        if watch.training_at is not None and not changes:
            restart_s = watch.training_at - watch.started_at
        if grow is not None and grow.next is not None and first + result.steps < spec.settings.steps:
            cluster, plan, added, _ = grow.next
            settings = replace(settings, resume=True)
            stop = first + result.steps  # the workers' agreed stop, its checkpoint written
            changes.append(Change((), stop, stop, len(plan.stages), len(plan.devices),
                                  plan.predicted.step_s if plan.predicted else float("nan"), time.time(),
                                  added=added))
            continue
        report = _report(spec, first, result, graph_at, cluster)
        keep(report, spec.settings.out_dir, graph_at, cluster, source)
        return report, tuple(changes)
