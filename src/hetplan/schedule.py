"""What a pipeline schedule means, in one place: per-stage action orders, micro-batches in
flight, and the torch class that runs the same order. Pure Python; the cost model, the
simulators, the planners and the runtime all read it (adding a schedule is an entry of
`SCHEDULES` here and its tests).

GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", 2019): every stage runs the forward pass of all m micro-batches, then all the
backward passes. 1F1B (PipeDream-Flush, Narayanan et al., "Memory-Efficient Pipeline-Parallel
DNN Training", 2021): stage r first runs n - 1 - r forward passes (warm-up), then alternates one
forward and one backward (steady state), then runs the remaining backward passes (cool-down),
so it never holds the activations of more than n - r micro-batches. Zero bubble (ZB-H1 of Qi et
al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward pass is split in two actions,
the gradients of the stage's inputs (I), which the stage before waits for, and those of its
weights (W), which nobody waits for; 1F1B's order with I for B, stage r deferring its first r
W actions to fill the cool-down's bubbles. A stage then holds up to min(m, n) micro-batches (it
frees them at W). Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021): each of n ranks holds v stages (stage s on
rank s mod n), so the model is cut in n v stages and the warm-up's bubble shrinks v times; a
rank runs its stages' forward passes round by round (micro-batches of a round through one
stage, then the next stage), then one forward one backward, then the backward passes left.
ZB-V (Qi et al., section 6): two stages per rank on a V (stage s on rank s, then back up, so
rank 0 holds the first and the last stage), the backward split into I and W as in zero bubble.

The orders are exactly those torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B
(`_step_microbatches`), ScheduleInterleavedZeroBubble with one stage per rank,
ScheduleInterleaved1F1B and ScheduleZBVZeroBubble execute. A schedule gives each rank one list
of actions (`rank_orders`); where a rank holds one stage, that is the stage's order
(`schedule_order`).
hetplan's runtime (`hetplan.runtime.executor`) runs these very orders and the simulator
simulates them, so a simulated step and a real one compare action by action. Tests also hold
them against torch's printable `_get_pipeline_order` (idle slots and gradient reductions left
out), which agrees everywhere except on 1F1B's last stage, where it numbers the forward passes
from 1. An action prints as torch prints it: "1F0" is stage 1's forward pass of micro-batch 0,
"0B3" stage 0's backward of micro-batch 3, "2I1" and "2W1" the two halves of a split backward.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from hetplan.errors import HetplanError

FORWARD = "F"
BACKWARD = "B"
BACKWARD_INPUT = "I"  # the gradients of the stage's inputs only (sent to the stage before)
BACKWARD_WEIGHT = "W"  # the gradients of its weights, after I
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
SENDS_GRADIENTS = (BACKWARD, BACKWARD_INPUT)  # the action after which a stage's input gradients exist
FREES = (BACKWARD, BACKWARD_WEIGHT)  # the action after which a micro-batch's activations are freed
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise HetplanError(f"action kind {self.kind!r}: allowed are F (forward), B (backward), "
                               "I (backward for inputs) and W (backward for weights)")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if not match:
            raise HetplanError(f"cannot read action {text!r}; write it like 1F0 (stage, F, B, I or W, micro-batch)")
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


def zero_bubble(stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per stage, the order of its actions under ZB-H1: 1F1B's warm-up and steady state with the
    backward split into I and W; stage r runs W of micro-batch j after I of j + r (its first r
    steady-state steps run no W), and the W actions left run at the end."""
    _check(stages, microbatches)
    orders = []
    for r in range(stages):
        warmup = min(stages - 1 - r, microbatches)
        actions = [Action(r, FORWARD, i) for i in range(warmup)]
        forward = warmup
        weight = 0
        for i in range(microbatches):
            if forward < microbatches:
                actions.append(Action(r, FORWARD, forward))
                forward += 1
            actions.append(Action(r, BACKWARD_INPUT, i))
            if i >= r:
                actions.append(Action(r, BACKWARD_WEIGHT, weight))
                weight += 1
        actions += [Action(r, BACKWARD_WEIGHT, j) for j in range(weight, microbatches)]
        orders.append(tuple(actions))
    return tuple(orders)


def interleaved_rounds(ranks: int, microbatches: int) -> tuple[int, int]:
    """Interleaved 1F1B's rounds and micro-batches per round: max(1, m // ranks) rounds, which
    must divide m (as torch's ScheduleInterleaved1F1B requires)."""
    rounds = max(1, microbatches // ranks)
    return rounds, microbatches // rounds


def interleaved_1f1b(ranks: int, stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per rank, its actions under interleaved 1F1B; rank r holds stages r, r + n, r + 2n, ...
    Rank r's warm-up runs (v - 1) x (a round's micro-batches) + 2 (n - 1 - r) forward passes,
    the k-th forward of the rank going to its local stage (k // round) mod v; the backward passes
    go through the local stages in reverse, the same way."""
    _check(stages, microbatches)
    return tuple(_interleaved_rank(ranks, stages // ranks, microbatches, r) for r in range(ranks))


def _interleaved_rank(ranks: int, v: int, microbatches: int, r: int) -> tuple[Action, ...]:
    _, per_round = interleaved_rounds(ranks, microbatches)
    total = v * microbatches
    warmup = min((v - 1) * per_round + 2 * (ranks - 1 - r), total)
    done: dict[tuple[str, int], int] = {}  # (kind, stage) -> its actions so far

    def act(kind: str, local: int) -> Action:
        stage = local * ranks + r
        i = done.get((kind, stage), 0)
        done[(kind, stage)] = i + 1
        return Action(stage, kind, i)

    actions = [act(FORWARD, (k // per_round) % v) for k in range(warmup)]
    for k in range(warmup, total + warmup):
        if k < total:
            actions.append(act(FORWARD, (k // per_round) % v))
        actions.append(act(BACKWARD, v - 1 - ((k - warmup) // per_round) % v))
    return tuple(actions)


def zero_bubble_v(ranks: int, stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per rank, its actions under ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
    2024, section 6): rank r holds stage r on the way down the V and stage 2n - 1 - r on the way
    back (`v_shape`), so rank 0 holds the first and the last stage. Its order is that of a
    pipeline kept full (at least 2n - 1 micro-batches; actions of micro-batches past m dropped):
    2(n - r) - 1 forward passes of its first stage, r pairs of forward passes (second stage,
    first), n - r forward passes of its second stage each followed by its I and W; then, while
    forward passes are left, a forward, I and W of the first stage and of the second; then r
    pairs of I (first stage, second), n - r of the first stage's I and W, and the W actions left
    (second stage, then first)."""
    _check(stages, microbatches)
    return tuple(_zbv_rank(ranks, microbatches, r) for r in range(ranks))


def _zbv_rank(n: int, m: int, r: int) -> tuple[Action, ...]:
    full = max(2 * n - 1, m)
    down, up = r, 2 * n - 1 - r
    done: dict[tuple[int, str], int] = {}  # (stage, kind) -> its actions so far
    out: list[Action] = []

    def run(times: int, *steps: tuple[int, str]) -> None:
        for _ in range(times):
            for stage, kind in steps:
                done[(stage, kind)] = done.get((stage, kind), 0) + 1
                out.append(Action(stage, kind, done[(stage, kind)] - 1))

    def count(stage: int, kind: str) -> int:
        return done.get((stage, kind), 0)

    f, i, w = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT
    run(2 * (n - r) - 1, (down, f))
    run(r, (up, f), (down, f))
    run(n - r, (up, f), (up, i), (up, w))
    while count(up, f) < count(down, f) or count(down, f) < full:
        run(int(count(down, f) < full), (down, f))
        run(1, (down, i), (down, w), (up, f), (up, i), (up, w))
    run(r, (down, i), (up, i))
    run(n - r, (down, i), (down, w))
    run(count(up, i) - count(up, w), (up, w))
    run(count(down, i) - count(down, w), (down, w))
    return tuple(a for a in out if a.microbatch < m)


def v_shape(stage: int, ranks: int) -> int:
    """ZB-V's map: stage s on rank s for the first n stages, then back up, rank 2n - 1 - s."""
    return stage if stage < ranks else 2 * ranks - 1 - stage


def _two_per_rank(stages: int, ranks: int, microbatches: int) -> str | None:
    if stages != 2 * ranks:
        return (f"ZB-V puts two stages on each rank (stage s and 2n - 1 - s): {stages} stages on {ranks} rank(s) "
                f"do not fit; use {2 * ranks} stages")
    return None


def looped(stage: int, ranks: int) -> int:
    """Megatron-LM's interleaving: stage s on rank s mod n (v passes over the ranks)."""
    return stage % ranks


def _interleaved_problem(stages: int, ranks: int, microbatches: int) -> str | None:
    if ranks < 2 or stages % ranks:
        return (f"interleaved 1F1B puts stage s on rank s mod n: {stages} stages on {ranks} rank(s) do not fit; "
                "use n >= 2 ranks and a multiple of n stages")
    rounds, _ = interleaved_rounds(ranks, microbatches)
    if microbatches % rounds:
        return (f"interleaved 1F1B on {ranks} ranks runs {microbatches} micro-batches in {rounds} rounds, which must "
                f"divide them; use {rounds * (microbatches // rounds)} or a multiple of {ranks} micro-batches")
    return None


def _one_per_rank(stages: int, ranks: int, microbatches: int) -> str | None:
    if ranks != stages:
        return f"this schedule runs one stage per rank: {stages} stages need {stages} ranks, not {ranks}"
    return None


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
    split_backward: bool = False  # its backward passes are I and W actions, not B
    # where ranks hold several stages: (ranks, stages, micro-batches) -> per rank, its actions
    rank_order: Callable[[int, int, int], tuple[tuple[Action, ...], ...]] | None = None
    stage_rank: Callable[[int, int], int] = looped  # (stage, ranks) -> the rank that holds it, where ranks hold several
    # (stages, ranks, micro-batches) -> why it cannot run them, or None; by default one stage per
    # rank, or for interleaved schedules interleaved 1F1B's rule
    fits: Callable[[int, int, int], str | None] | None = None

    @property
    def backward_kinds(self) -> tuple[str, ...]:
        return (BACKWARD_INPUT, BACKWARD_WEIGHT) if self.split_backward else (BACKWARD,)

    @property
    def interleaved(self) -> bool:
        """Whether a rank may hold several stages (`stage_rank` says which)."""
        return self.rank_order is not None

    def problem(self, stages: int, ranks: int, microbatches: int) -> str | None:
        """Why this schedule cannot run `stages` stages on `ranks` ranks with this many
        micro-batches, in one line; None if it can."""
        rule = self.fits or (_interleaved_problem if self.interleaved else _one_per_rank)
        return rule(stages, ranks, microbatches)


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("gpipe", gpipe, lambda stages, index, m: m, False, "ScheduleGPipe",
                      "all forward passes, then all backward passes; every micro-batch in flight"),
    "1f1b": Schedule("1f1b", one_f_one_b, lambda stages, index, m: min(m, stages - index), True, "Schedule1F1B",
                     "warm-up, one forward one backward, cool-down; at most stages - index in flight"),
    # in flight min(m, stages) on every stage: planners that count the stages after a stage
    # (`bounded`) charge it m, more than it holds
    "zero-bubble": Schedule("zero-bubble", zero_bubble, lambda stages, index, m: min(m, stages), False,
                            "ScheduleInterleavedZeroBubble",
                            "1F1B with the backward split into inputs' (I) and weights' (W) gradients, W filling "
                            "the bubbles; at most min(m, stages) in flight", split_backward=True),
    # in flight: read off the order (`peak_in_flight`), which depends on the ranks too
    "interleaved-1f1b": Schedule("interleaved-1f1b", one_f_one_b, lambda stages, index, m: m, False,
                                 "ScheduleInterleaved1F1B",
                                 "v stages per rank (stage s on rank s mod n), 1F1B over them: the warm-up's "
                                 "bubble v times shorter, more messages", rank_order=interleaved_1f1b),
    "zb-v": Schedule("zb-v", zero_bubble, lambda stages, index, m: m, False, "ScheduleZBVZeroBubble",
                     "two stages per rank on a V (stage s on rank s, then back up), the backward split into I "
                     "and W as zero bubble's; the first and the last stage on rank 0", split_backward=True,
                     rank_order=zero_bubble_v, stage_rank=v_shape, fits=_two_per_rank),
}
SCHEDULE_NAMES = tuple(SCHEDULES)
ONE_STAGE_PER_RANK = tuple(name for name, s in SCHEDULES.items() if not s.interleaved)  # chains of one device per stage


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise HetplanError(f"schedule {name!r} is unknown (allowed: {', '.join(SCHEDULES)})") from None


def rank_orders(schedule: str, stages: int, microbatches: int, ranks: int | None = None
                ) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the actions it runs in order (`ranks`: None for one stage per rank)."""
    sched = get_schedule(schedule)
    ranks = stages if ranks is None else ranks
    problem = sched.problem(stages, ranks, microbatches)
    if problem:
        raise HetplanError(problem)
    if sched.rank_order is not None:
        return sched.rank_order(ranks, stages, microbatches)
    return sched.order(stages, microbatches)


def stage_ranks(schedule: str, stages: int, ranks: int | None = None) -> tuple[int, ...]:
    """Per stage, the rank that holds it: stage k on rank k, or where ranks hold several stages
    (`ranks` of them) the schedule's map. Every rank's first stage is the one it is known by
    (RUN.json, checkpoints)."""
    sched = get_schedule(schedule)
    if not sched.interleaved or ranks is None:
        return tuple(range(stages))
    return tuple(sched.stage_rank(k, ranks) for k in range(stages))


def schedule_order(schedule: str, stages: int, microbatches: int, ranks: int | None = None
                   ) -> tuple[tuple[Action, ...], ...]:
    """Per stage, its actions in the order its rank runs them."""
    per_rank = rank_orders(schedule, stages, microbatches, ranks)
    if len(per_rank) == stages:
        return per_rank
    holder = stage_ranks(schedule, stages, len(per_rank))
    return tuple(tuple(a for a in per_rank[holder[s]] if a.stage == s) for s in range(stages))


def inflight_microbatches(schedule: str, stages: int, stage_index: int, microbatches: int,
                          ranks: int | None = None) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    sched = get_schedule(schedule)
    if sched.interleaved:
        return peak_in_flight(schedule_order(schedule, stages, microbatches, ranks)[stage_index])
    return sched.in_flight(stages, stage_index, microbatches)


def peak_in_flight(actions: tuple[Action, ...]) -> int:
    """The most micro-batches whose forward pass a stage has run and backward pass (B, or W of a
    split backward) not yet: how many micro-batches' activations it holds at its peak."""
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == FORWARD else -1 if a.kind in FREES else 0
        peak = max(peak, held)
    return peak
