"""What a pipeline schedule means, in one place: per-stage action orders, micro-batches in
flight, and the torch class that runs the same order. Pure Python; the cost model, the
simulators, the planners and the runtime all read it (adding a schedule touches this module, the
runtime's mapping in `hetplan.runtime.executor` and the tests).

GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", 2019): every stage runs the forward pass of all m micro-batches, then all the
backward passes. 1F1B (PipeDream-Flush, Narayanan et al., "Memory-Efficient Pipeline-Parallel
DNN Training", 2021): stage r first runs n - 1 - r forward passes (warm-up), then alternates one
forward and one backward (steady state), then runs the remaining backward passes (cool-down),
so it never holds the activations of more than n - r micro-batches.

The orders are exactly those torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B
execute (`_step_microbatches`). hetplan's runtime (`hetplan.runtime.executor`) runs these very
orders and the simulator simulates them, so a simulated step and a real one compare action by
action. Tests also hold them against torch's printable `_get_pipeline_order` (idle slots and
gradient reductions left out), which agrees everywhere except on 1F1B's last stage, where it
numbers the forward passes from 1. An action prints as
torch prints it: "1F0" is stage 1's forward pass of micro-batch 0, "0B3" stage 0's backward of
micro-batch 3.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from hetplan.errors import HetplanError

FORWARD = "F"
BACKWARD = "B"
_ACTION = re.compile(r"^(\d+)([FB])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD):
            raise HetplanError(f"action kind {self.kind!r}: allowed are F (forward) and B (backward)")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if not match:
            raise HetplanError(f"cannot read action {text!r}; write it like 1F0 (stage, F or B, micro-batch)")
        return cls(int(match[1]), match[2], int(match[3]))


def _check(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise HetplanError(f"a schedule needs stages >= 1 and micro-batches >= 1, got {stages} and {microbatches}")


def gpipe(stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per stage, the order of its actions under GPipe."""
    _check(stages, microbatches)
    return tuple(
        tuple(Action(r, FORWARD, i) for i in range(microbatches))
        + tuple(Action(r, BACKWARD, i) for i in range(microbatches))
        for r in range(stages)
    )


def one_f_one_b(stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per stage, the order of its actions under 1F1B (with fewer micro-batches than stages,
    the warm-up is cut short at the last micro-batch)."""
    _check(stages, microbatches)
    orders = []
    for r in range(stages):
        warmup = min(stages - 1 - r, microbatches)
        actions = [Action(r, FORWARD, i) for i in range(warmup)]
        forward, backward = warmup, 0
        while forward < microbatches:
            actions += [Action(r, FORWARD, forward), Action(r, BACKWARD, backward)]
            forward += 1
            backward += 1
        actions += [Action(r, BACKWARD, i) for i in range(backward, microbatches)]
        orders.append(tuple(actions))
    return tuple(orders)


@dataclass(frozen=True)
class Schedule:
    """A schedule: its per-stage action orders, how many micro-batches' activations stage
    `index` of `stages` holds at its peak (a closed form; tests hold it against
    `peak_in_flight` of the order), and the torch.distributed.pipelining class whose
    `_step_microbatches` runs the same order."""

    name: str
    order: Callable[[int, int], tuple[tuple[Action, ...], ...]]
    in_flight: Callable[[int, int, int], int]  # (stages, stage index, micro-batches) -> held
    bounded: bool  # in flight bounded by the stages after it (1F1B), not by the micro-batches (GPipe)
    torch_class: str
    summary: str


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("gpipe", gpipe, lambda stages, index, m: m, False, "ScheduleGPipe",
                      "all forward passes, then all backward passes; every micro-batch in flight"),
    "1f1b": Schedule("1f1b", one_f_one_b, lambda stages, index, m: min(m, stages - index), True, "Schedule1F1B",
                     "warm-up, one forward one backward, cool-down; at most stages - index in flight"),
}
SCHEDULE_NAMES = tuple(SCHEDULES)


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise HetplanError(f"schedule {name!r} is unknown (allowed: {', '.join(SCHEDULES)})") from None


def schedule_order(schedule: str, stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    return get_schedule(schedule).order(stages, microbatches)


def inflight_microbatches(schedule: str, stages: int, stage_index: int, microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    return get_schedule(schedule).in_flight(stages, stage_index, microbatches)


def peak_in_flight(actions: tuple[Action, ...]) -> int:
    """The most micro-batches whose forward pass a stage has run and backward pass not yet:
    how many micro-batches' activations it holds at its peak."""
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == FORWARD else -1
        peak = max(peak, held)
    return peak
