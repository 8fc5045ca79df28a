"""What a user asks of a planner: micro-batches, schedule, objective and its parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetplan.errors import HetplanError
from hetplan.plan import OBJECTIVES, SCHEDULES
from hetplan.schedule import get_schedule

AUTO_SCHEDULE = "auto"  # not a schedule: the planner's plan under whichever the objective prefers
SCHEDULE_CHOICES = (*SCHEDULES, AUTO_SCHEDULE)
# which stages recompute and at which unit (`Stage.recompute`): the units each choice lets a stage take
RECOMPUTE_UNITS = {"never": ("none",), "where-needed": ("none", "stage", "block", "selective"),
                   "always": ("stage", "block", "selective"), "stage": ("none", "stage"), "block": ("none", "block"),
                   "selective": ("none", "selective")}
RECOMPUTE_CHOICES = tuple(RECOMPUTE_UNITS)
SHARD_CHOICES = ("never", "replicated", "where-needed")  # which stages shard, and how deep (`Stage.shard`)
# which tensor-parallel stages split their values along the tokens too (`Stage.sequence_parallel`)
SEQUENCE_PARALLEL_CHOICES = ("tensor-parallel", "never")

def selective_allowed(graph, schedule: str) -> bool:
    """Whether a plan of `graph` under `schedule` may recompute selectively: the graph carries its
    figures (`Graph.selective_measured`) and the schedule runs one backward per micro-batch
    (`plan.plan_problems`)."""
    return graph.selective_measured and (schedule == AUTO_SCHEDULE or not get_schedule(schedule).split_backward)


@dataclass(frozen=True)
class PlanOptions:
    """What the user asks of a planner.

    microbatches: the number of micro-batches, or None to let the planner choose.
    schedule: a name of `hetplan.schedule.SCHEDULES` (`gpipe`, `1f1b`, `zero-bubble`), or `auto`:
    the planner plans under 1F1B and the plan takes the schedule its simulated objective prefers.
    objective: `time`, `cost` or `mdpe` (planners that do not optimise ignore it).
    seed: for planners that draw random numbers.
    budget_s: a time budget for search planners (None: the planner's default).
    min_samples_per_s: the throughput floor of the `cost` objective.
    alpha, beta, gamma: weights of runtime, communication and memory in the `mdpe` objective.
    comm_tolerance: the busiest link's share of the step that `mdpe` tolerates without penalty.
    mem_tolerance: the share of a device's memory that `mdpe` tolerates without penalty.
    routing: how the simulator that scores plans sends tensors between stages (`relay`, as the
    runtime does, or `direct`; see `hetplan.cost.table`).
    max_iters: for search planners, a number of iterations instead of (or within) the time
    budget, for runs that must be the same every time.
    max_replicas: at most this many devices per stage (1: a straight pipeline), or None; planners
    that replicate search within it and no planner returns a plan beyond it.
    faithful: for the RL planners, the paper's set-up (cold start, the paper's hyper-parameters)
    instead of hetplan's default (warm start from dp, never worse than dp).
    recompute: which stages of the plan recompute their activations in their backward, and what
    each rebuilds at once (`Stage.recompute`: the whole stage, one block at a time, or per block
    all but its products' outputs): `where-needed` (the default), the stages with a replica over
    its device's memory, at the fastest unit that fits (`hetplan.planners.refine.with_recompute`;
    dp and the per-type program weigh each stage every way); `stage`, `block` or `selective`, the
    same at that unit only; `never`; `always`, every stage at one of the units. Selective
    recomputation is weighed only on graphs that carry its figures (`Graph.selective_measured`).
    shard: which stages' replicas shard (`Stage.shard`): `never`; `replicated`: every stage of
    two replicas or more whose gradients are dense and that is not tensor-parallel shards its
    optimizer state (ZeRO-1); `where-needed` (the default): the same, and where a stage would not
    fit so, its gradients (ZeRO-2) or its weights too (ZeRO-3), node by node. ZeRO-1, measured on
    this VM's CPU workers, makes the step the same or shorter (BENCHMARKS.md, "Memory and
    precision choices"); in the cost model it costs no time (the reduce-scatter and all-gather
    move what the all-reduce moves) and saves memory and optimizer time, so every such stage
    takes it (`refine.with_shard`). The deeper levels cost their rings in every pass
    (`CostModel.shard_passes_s`; measured 1.4-8x ZeRO-1's step here): dp weighs them as stage
    options where the level before leaves a stage unfit (`dp_program._Order`), and `refine`
    raises a stage of a given plan that does not fit. exact and the MILP weigh ZeRO-1 only.
    max_tp: the most devices a tensor-parallel replica may have (`Stage.tp`; 1: none), or None
    (the default, "auto"): dp and its per-type program weigh groups of up to a host's GPUs of one
    type where the graph says how its nodes split (`tensor_groups.type_degrees`). With a number
    above 1 every planner also plans on the cluster with its devices grouped each way that
    allows and the best plan wins, the plan without tensor parallelism among them
    (`hetplan.planners.tensor_groups`).
    sequence_parallel: `tensor-parallel` (the default), every tensor-parallel stage splits its
    values along the tokens too (`Stage.sequence_parallel`: the same traffic, a device keeps 1/t
    of its blocks' activations), and the planners size its memory so; `never`.
    """

    microbatches: int | None = None
    schedule: str = "1f1b"
    objective: str = "time"
    seed: int = 0
    budget_s: float | None = None
    min_samples_per_s: float | None = None
    alpha: float = 0.5
    beta: float = 0.3
    gamma: float = 0.2
    comm_tolerance: float = 0.5
    mem_tolerance: float = 0.8
    routing: str = "relay"
    max_iters: int | None = None
    max_replicas: int | None = None
    faithful: bool = False
    recompute: str = "where-needed"
    shard: str = "where-needed"
    max_tp: int | None = None
    sequence_parallel: str = "tensor-parallel"

    def __post_init__(self) -> None:
        # in this order, so that the first thing wrong is the one reported
        self._check_choices()
        self._check_budget_and_floor()
        self._check_mdpe()

    def _check_choices(self) -> None:
        if self.microbatches is not None and not _whole(self.microbatches):
            raise HetplanError(f"--microbatches: {self.microbatches!r} is not a whole number >= 1")
        if self.schedule not in SCHEDULE_CHOICES:
            raise HetplanError(f"--schedule: {self.schedule!r} is unknown (allowed: {', '.join(SCHEDULE_CHOICES)})")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise HetplanError(f"--recompute: {self.recompute!r} is unknown (allowed: {', '.join(RECOMPUTE_CHOICES)})")
        if self.shard not in SHARD_CHOICES:
            raise HetplanError(f"--shard: {self.shard!r} is unknown (allowed: {', '.join(SHARD_CHOICES)})")
        if self.sequence_parallel not in SEQUENCE_PARALLEL_CHOICES:
            raise HetplanError(f"--sequence-parallel: {self.sequence_parallel!r} is unknown (allowed: "
                               f"{', '.join(SEQUENCE_PARALLEL_CHOICES)})")
        if self.objective not in OBJECTIVES:
            raise HetplanError(f"--objective: {self.objective!r} is unknown (allowed: {', '.join(OBJECTIVES)})")

    def _check_budget_and_floor(self) -> None:
        if self.budget_s is not None and not (self.budget_s > 0 and math.isfinite(self.budget_s)):
            raise HetplanError(f"--budget-s: {self.budget_s!r} must be a number of seconds > 0")
        if self.min_samples_per_s is not None and not (self.min_samples_per_s > 0
                                                       and math.isfinite(self.min_samples_per_s)):
            raise HetplanError(f"--min-samples-per-s: {self.min_samples_per_s!r} must be a number > 0")
        if self.objective == "cost" and self.min_samples_per_s is None:
            raise HetplanError("--objective cost needs a throughput floor: add --min-samples-per-s X "
                               "(the fewest samples per second you accept)")
        if self.max_iters is not None and not _whole(self.max_iters):
            raise HetplanError(f"--max-iters: {self.max_iters!r} must be a whole number >= 1")
        if self.max_replicas is not None and not _whole(self.max_replicas):
            raise HetplanError(f"--max-replicas: {self.max_replicas!r} must be a whole number >= 1")
        if self.max_tp is not None and not _whole(self.max_tp):
            raise HetplanError(f"--max-tp: {self.max_tp!r} must be a whole number >= 1 or auto")

    def recompute_units(self, graph) -> tuple[str, ...]:
        """The `Stage.recompute` values a stage of `graph` may take under `recompute` (selective
        only where the graph carries its figures)."""
        units = RECOMPUTE_UNITS[self.recompute]
        return units if selective_allowed(graph, self.schedule) else tuple(u for u in units if u != "selective")

    @property
    def sp(self) -> bool:
        """Whether tensor-parallel stages are sequence-parallel too."""
        return self.sequence_parallel != "never"

    def allows(self, plan) -> bool:
        """Whether a plan keeps within `max_replicas`."""
        return self.max_replicas is None or all(len(s.devices) <= self.max_replicas for s in plan.stages)

    def _check_mdpe(self) -> None:
        """The routing, and the weights and tolerances of the `mdpe` objective."""
        if self.routing not in ("relay", "direct"):
            raise HetplanError(f"--routing: {self.routing!r} is unknown (allowed: relay, direct)")
        for name in ("alpha", "beta", "gamma"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise HetplanError(f"--{name}: {getattr(self, name)!r} must be a number >= 0")
        for name in ("comm_tolerance", "mem_tolerance"):
            if not 0 < getattr(self, name) <= 1:
                raise HetplanError(f"--{name.replace('_', '-')}: {getattr(self, name)!r} must be in (0, 1]")


def _whole(value: object) -> bool:
    """A whole number >= 1 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1
