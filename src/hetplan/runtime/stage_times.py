"""Per stage, predicted against measured: compute busy time and the share of the step spent
communicating (TAPP's measure; `hetplan run`'s stage table).

Measured (every run): each worker sums, per step, the perf_counter spans the executor already
takes (`hetplan.runtime.worker.step_busy_comm`): busy = its forward and backward actions less the
time blocked receiving inside them, plus its optimizer step; communication = that time blocked
receiving (waiting for the sender included, so the pipeline's fill and drain count) plus its
gradient all-reduce (waiting for the other replicas included). Per worker, the median over the
steps after the warm-up; per stage, the mean over its replicas; the share is of the measured step.

Predicted, from the simulator's timeline (`hetplan.timeline.Timeline`), the same quantities for
each replica of the stage: busy = its forward, backward and optimizer spans; communication = the
time from the step's start to the end of its all-reduce (or of its last backward pass when the
stage has no all-reduce) that it does not spend computing, i.e. the time its next action waits
for inputs (transfers and the peers' compute) and its wait for and time in the all-reduce, as a
blocking receive and all-reduce measure them. Per stage, the mean over replicas; the share is of
the simulated step. (On a device that holds several stages, one worker each, the time it
computes the others is counted as waiting here.) Under an interleaved schedule a worker holds
stages k, k + n, ...: its row is its first stage's, with all its stages' work, and the other
stages' rows are empty.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hetplan.plan import Plan
from hetplan.runtime.launch import RunResult
from hetplan.schedule import KINDS
from hetplan.timeline import ALLREDUCE, OPTIMIZER, Timeline

COMPUTE = KINDS  # F, B, I, W: compute actions (`hetplan.schedule`)


@dataclass(frozen=True)
class StageTime:
    """One stage's row: its devices, its replicas' mean busy time per step (seconds) and their
    mean share of the step spent communicating, predicted (None without a graph) and measured
    (None when the workers did not report them)."""

    stage: int
    devices: tuple[str, ...]
    predicted_busy_s: float | None
    measured_busy_s: float | None
    predicted_comm_share: float | None
    measured_comm_share: float | None


def predicted_replica(timeline: Timeline, stages: Sequence[int], device: str) -> tuple[float, float]:
    """(busy_s, comm_s) of the worker of `stages` on `device` in a simulated step (module docstring)."""
    mine = [s for s in timeline.spans if s.resource == device and s.stage in stages]
    compute = sum(s.end_s - s.start_s for s in mine if s.kind in COMPUTE)
    optimizer = sum(s.end_s - s.start_s for s in mine if s.kind == OPTIMIZER)
    ends = [s.end_s for s in mine if s.kind in (*COMPUTE, ALLREDUCE)]
    return compute + optimizer, max(max(ends, default=0.0) - compute, 0.0)


def _median(values: Sequence[float], warmup: int) -> float:
    return statistics.median(list(values[warmup:]) or list(values))


def measured_replicas(result: RunResult, plan: Plan) -> dict[tuple[int, str], tuple[float, float]]:
    """Per (stage, device), the reporting worker's median (busy_s, comm_s) over the steps after the
    warm-up. A worker names its device; one that does not is the stage's replica in rank order."""
    out: dict[tuple[int, str], tuple[float, float]] = {}
    seen: dict[int, int] = {}
    for rank in sorted(result.ranks, key=lambda r: r["rank"]):
        k = rank["stage"]
        place = seen[k] = seen.get(k, -1) + 1
        device = rank.get("device") or plan.stages[k].devices[place]
        if rank.get("busy_s") and rank.get("comm_s"):
            out[(k, device)] = (_median(rank["busy_s"], result.warmup), _median(rank["comm_s"], result.warmup))
    return out


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _share(seconds: float | None, step_s: float) -> float | None:
    return seconds / step_s if seconds is not None and step_s > 0 else None


def replica_times(plan: Plan, result: RunResult | None,
                  timeline: Timeline | None = None) -> tuple[StageTime, ...]:
    """A row per stage replica (`devices` holds its one device): measured from `result`,
    predicted from the simulated `timeline` (either may be missing)."""
    measured = measured_replicas(result, plan) if result is not None else {}
    held_by = {held[0]: held for held in plan.rank_stages}  # a worker's stages, under its first
    rows = []
    for k, stage in enumerate(plan.stages):
        held = held_by.get(k, ())
        for d in stage.devices:
            p = predicted_replica(timeline, held, d) if timeline is not None and held else (None, None)
            m = measured.get((k, d), (None, None))
            rows.append(StageTime(
                stage=k, devices=(d,), predicted_busy_s=p[0], measured_busy_s=m[0],
                predicted_comm_share=_share(p[1], timeline.step_s if timeline else 0.0),
                measured_comm_share=_share(m[1], result.measured_step_s if result is not None else 0.0)))
    return tuple(rows)


def stages_of(plan: Plan, replicas: Sequence[StageTime]) -> tuple[StageTime, ...]:
    """A row per stage of `plan`: the mean over its replicas' rows (`replica_times`)."""
    rows = []
    for k, stage in enumerate(plan.stages):
        mine = [r for r in replicas if r.stage == k]
        rows.append(StageTime(
            stage=k, devices=tuple(stage.devices),
            **{name: _mean([getattr(r, name) for r in mine]) for name in (
                "predicted_busy_s", "measured_busy_s", "predicted_comm_share", "measured_comm_share")}))
    return tuple(rows)


def stage_times(plan: Plan, result: RunResult | None, timeline: Timeline | None = None) -> tuple[StageTime, ...]:
    """A row per stage of `plan`: the mean over its replicas of `replica_times`."""
    return stages_of(plan, replica_times(plan, result, timeline))
