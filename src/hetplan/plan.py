"""Plans (stages in pipeline order, their devices, micro-batches, schedule) and estimates.

A plan is valid for a graph and a cluster when:
- every node of the graph is in exactly one stage;
- each stage is convex (no path leaves the stage and comes back into it);
- no edge goes from a later stage to an earlier one, so the stages can run as a pipeline;
- every device exists, no device appears twice in a stage, and no device holds two stages
  unless the plan sets `shared_devices` (a worker per stage, sharing the device) or its schedule
  interleaves (`Schedule.interleaved`: each stage on the devices of its rank's first stage, by
  the schedule's map, `Plan.stage_ranks`; ranks' devices apart; one worker per device running
  all its stages);
- each tensor-parallel replica (`Stage.tp` > 1) is a group of devices of one type on one host,
  its stage shards no optimizer state nor recomputes per block (or selectively), runs under a
  schedule of one stage per device without shared devices, and its nodes split its degrees
  (`hetplan.tp.splits_in`);
- no stage recomputes selectively, nor shards its gradients (`Stage.shard` 2 or 3), under a
  schedule that splits the backward (zero bubble);
- there are no more micro-batches than samples in the batch.
`validate_plan` checks all of it and names the offending node, edge, stage or device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hetplan._frozen import FILE_SCHEMA, FrozenMap, freeze
from hetplan.cluster import Cluster
from hetplan.errors import PlanError, listing
from hetplan.graph import Graph
from hetplan.precision import FP32, PRECISIONS
from hetplan.schedule import SCHEDULE_NAMES, get_schedule, stage_ranks
from hetplan.schedule import SCHEDULES as REGISTRY
from hetplan.tp import splits_in

SCHEDULES = SCHEDULE_NAMES  # hetplan.schedule owns what each means
OBJECTIVES = ("time", "cost", "mdpe", "throughput")
RECOMPUTE_UNITS = ("none", "stage", "block", "selective")  # what a stage's recomputation rebuilds at once (`Stage`)
SHARD_LEVELS = (0, 1, 2, 3)  # what a stage's replicas shard (`Stage.shard`): ZeRO's stages


@dataclass(frozen=True)
class Stage:
    """A convex set of nodes run by one device, or by several data-parallel replicas. Its
    `recompute` (`RECOMPUTE_UNITS`) trades memory for time by running the forward again in the
    backward (activation recomputation, torch.utils.checkpoint): "stage" keeps only the stage's
    inputs and outputs per micro-batch and rebuilds all its activations at once; "block" keeps
    each node's (block's) inputs and rebuilds one node at a time, as Megatron-LM's full
    recomputation checkpoints each transformer layer; "selective" checkpoints each node as "block"
    does but keeps the outputs of its products too and rebuilds only the rest (norms, activation
    functions: `hetplan.pieces.selective`); "none" keeps every activation. A plan file's
    `true` and `false` read as "stage" and "none".
    `shard` (`SHARD_LEVELS`, two replicas or more) is what its r replicas shard, ZeRO's stages:
    1, the optimizer state (`hetplan.runtime.sharding`): each updates a 1/r share of its
    parameters, summed to it by a reduce-scatter at the step's end, and the updated shares are
    all-gathered: an r-th of Adam's state each; 2, the gradients too, reduce-scattered node by
    node in each backward (`hetplan.runtime.zero`); 3, the parameters too, all-gathered node by
    node before each forward and backward. A plan file's `true` and `false` read as 1 and 0.
    With `tp` > 1, its replicas are tensor-parallel groups of devices of one type on one host
    (`hetplan.tp`), of up to `tp` devices each (replicas of a stage may differ: four A100s of
    one device each beside four V100s as one group): `tp_devices[p]` lists replica p's devices,
    the first of them `devices[p]`, the device that stands for the replica (its rows of the
    batch, its messages). With `sequence_parallel` its groups split the values between
    projection pairs along their tokens too (Korthikanti et al. 2022: norms and dropout on a
    share of the tokens; an all-gather and a reduce-scatter in place of each all-reduce), so a
    device keeps less of its blocks' activations (`Node.act_sequence_share`;
    `hetplan.pieces.tensor_stage.gathered`)."""

    __pydantic_config__ = FILE_SCHEMA

    nodes: tuple[str, ...]
    devices: tuple[str, ...]
    recompute: Literal["none", "stage", "block", "selective"] | bool = "none"
    shard: int = 0
    tp: int = 1
    tp_devices: tuple[tuple[str, ...], ...] = ()
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "tp_devices", tuple(tuple(g) for g in self.tp_devices))
        if isinstance(self.recompute, bool):
            object.__setattr__(self, "recompute", "stage" if self.recompute else "none")
        if isinstance(self.shard, bool):
            object.__setattr__(self, "shard", int(self.shard))
        if self.shard not in SHARD_LEVELS:
            raise PlanError(f"a stage has shard {self.shard!r}; it must be one of {', '.join(map(str, SHARD_LEVELS))}")
        if self.recompute not in RECOMPUTE_UNITS:
            raise PlanError(f"a stage has recompute {self.recompute!r}; it must be one of {', '.join(RECOMPUTE_UNITS)}")
        if not self.nodes:
            raise PlanError("a stage needs at least one node")
        if not self.devices:
            raise PlanError(f"the stage starting at node {self.nodes[0]!r} has no device")
        who = f"the stage starting at node {self.nodes[0]!r}"
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise PlanError(f"{who} has tp {self.tp!r}; it must be a whole number >= 1")
        listed = len(self.tp_devices) == len(self.devices) and all(
            1 <= len(g) <= self.tp and g[0] == d for g, d in zip(self.tp_devices, self.devices, strict=True)) \
            and max(map(len, self.tp_devices)) == self.tp
        if self.tp > 1 and not listed:
            raise PlanError(f"{who} has tp {self.tp}: tp_devices must list each replica's devices (the largest group "
                            f"{self.tp}), the first of them the replica's entry in devices")
        if self.tp == 1 and self.tp_devices:
            raise PlanError(f"{who} lists tp_devices but has tp 1")
        if not isinstance(self.sequence_parallel, bool) or (self.sequence_parallel and self.tp == 1):
            raise PlanError(f"{who} has sequence_parallel {self.sequence_parallel!r}; it is true only for a "
                            "tensor-parallel stage (tp 2 or more), else false")

    @property
    def recomputes(self) -> bool:
        """Whether its backward runs its forward again (at any unit)."""
        return self.recompute != "none"

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        """Per replica, its devices (one each unless the stage is tensor-parallel)."""
        return self.tp_devices or tuple((d,) for d in self.devices)

    @property
    def degrees(self) -> tuple[int, ...]:
        """Per replica, its devices' count (its tensor-parallel degree)."""
        return tuple(len(g) for g in self.groups)

    @property
    def all_devices(self) -> tuple[str, ...]:
        return tuple(d for g in self.groups for d in g)


def prediction_error(measured_s: float | None, predicted_s: float | None) -> float | None:
    """measured / predicted - 1 of a step time (+0.25: the step took 25% longer than predicted);
    None unless both are known and the prediction is not zero."""
    if measured_s is None or not predicted_s:
        return None
    return measured_s / predicted_s - 1


@dataclass(frozen=True)
class Estimate:
    """What a plan is predicted (or measured) to do in one training step.

    `busy_s` (compute time) and `peak_mem_bytes` are keyed by device id; `link_bytes` and
    `link_busy_s` by `"src->dst"` device ids, for the bytes sent that way in one step and the
    time the link spent sending them. `method` says where the numbers come from (`event`: the
    event-driven simulator; `fast`: the batched evaluator; `measured`: a real run)."""

    __pydantic_config__ = FILE_SCHEMA

    step_s: float
    samples_per_s: float
    busy_s: Mapping[str, float]
    peak_mem_bytes: Mapping[str, int]
    bubble_fraction: float
    link_bytes: Mapping[str, int]
    usd_per_step: float
    feasible: bool
    violations: tuple[str, ...] = ()
    method: str = "event"
    link_busy_s: Mapping[str, float] = field(default_factory=FrozenMap)
    bottleneck_s: float = 0.0  # PipeDream's steady-state time per batch (`CostModel.bottleneck_s`); 0: not known

    def __post_init__(self) -> None:
        for name in ("busy_s", "peak_mem_bytes", "link_bytes", "link_busy_s"):
            object.__setattr__(self, name, FrozenMap(getattr(self, name)))
        object.__setattr__(self, "violations", tuple(self.violations))
        for name in ("step_s", "samples_per_s", "bubble_fraction", "usd_per_step", "bottleneck_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise PlanError(f"estimate: {name} is {value!r}; it must be finite and >= 0")

    @property
    def peak_link(self) -> tuple[str, int] | None:
        """The busiest link (longest time sending, then most bytes) and the bytes it carries in a
        step; None without links."""
        if not self.link_bytes:
            return None
        key = max(self.link_bytes, key=lambda k: (self.link_busy_s.get(k, 0.0), self.link_bytes[k], k))
        return key, self.link_bytes[key]

    @property
    def usd_per_1k_samples(self) -> float:
        return 1000.0 * self.usd_per_step / (self.samples_per_s * self.step_s) if self.step_s else 0.0


@dataclass(frozen=True)
class Plan:
    """Stages in pipeline order, the number of micro-batches and the schedule.

    `planner` and `objective` say how the plan was made; `graph` and `cluster` name what it was
    made for; `precision` the arithmetic it runs in (`hetplan.precision`: the graph's, which was
    profiled in it); `meta` holds the planner's settings (seed, planning time, ...) as JSON values."""

    __pydantic_config__ = FILE_SCHEMA

    stages: tuple[Stage, ...]
    microbatches: int
    schedule: str
    planner: str
    objective: str = "time"
    graph: str = ""
    cluster: str = ""
    shared_devices: bool = False
    predicted: Estimate | None = None
    meta: Mapping[str, Any] = field(default_factory=FrozenMap)
    precision: str = FP32

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "meta", freeze(dict(self.meta)))
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlanError(f"microbatches is {self.microbatches!r}; it must be a whole number >= 1")
        if self.schedule not in REGISTRY:  # the registry itself: a schedule is its entry there
            raise PlanError(f"schedule {self.schedule!r} is unknown (allowed: {', '.join(REGISTRY)})")
        if self.objective not in OBJECTIVES:
            raise PlanError(f"objective {self.objective!r} is unknown (allowed: {', '.join(OBJECTIVES)})")
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision {self.precision!r} is unknown (allowed: {', '.join(PRECISIONS)})")

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device the plan uses, in stage order."""
        return tuple(dict.fromkeys(d for s in self.stages for d in s.all_devices))

    @property
    def ranks(self) -> int:
        """Workers along the pipeline: one per stage, or under an interleaved schedule one per
        group of devices (which stages each holds: `stage_ranks`)."""
        if not get_schedule(self.schedule).interleaved:
            return len(self.stages)
        return len(dict.fromkeys(s.devices for s in self.stages))

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """Per stage, the rank (worker, per replica) that holds it (`hetplan.schedule.stage_ranks`)."""
        return stage_ranks(self.schedule, len(self.stages), self.ranks)

    @property
    def rank_stages(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the stages it holds, in order (the first names it)."""
        held: dict[int, list[int]] = {}
        for k, r in enumerate(self.stage_ranks):
            held.setdefault(r, []).append(k)
        return tuple(tuple(held.get(r, ())) for r in range(self.ranks))

    def stage_of(self) -> dict[str, int]:
        """Node id -> index of its stage."""
        return {n: i for i, s in enumerate(self.stages) for n in s.nodes}


def plan_problems(plan: Plan, graph: Graph, cluster: Cluster) -> list[str]:
    """Every reason the plan is not valid for this graph and cluster (empty when it is)."""
    problems, where = _node_problems(plan, graph)
    problems += _order_problems(plan, graph, where)
    problems += _device_problems(plan, cluster)
    problems += _rank_problems(plan)
    problems += _shard_problems(plan, graph)
    problems += _tp_problems(plan, graph, cluster)
    if get_schedule(plan.schedule).split_backward:
        problems += [f"stage {i} recomputes selectively under {plan.schedule}, whose backward runs in two actions; "
                     "torch's selective checkpoint allows one backward per block: set recompute \"block\" or a "
                     "schedule that does not split the backward (1f1b)"
                     for i, s in enumerate(plan.stages) if s.recompute == "selective"]
        problems += [f"stage {i} shards its gradients (shard {s.shard}) under {plan.schedule}, whose backward runs in "
                     "two actions; hetplan reduces a node's gradients when its backward has made them all: set shard "
                     "1 or a schedule that does not split the backward (1f1b)"
                     for i, s in enumerate(plan.stages) if s.shard >= 2]
    if plan.precision != graph.precision:
        problems.append(f"the plan runs in {plan.precision} but graph {graph.name!r} was profiled in "
                        f"{graph.precision}; plan again from a profile in {plan.precision} "
                        f"(hetplan profile --precision {plan.precision})")
    if plan.microbatches > graph.batch_size:
        problems.append(f"{plan.microbatches} micro-batches for a batch of {graph.batch_size} samples; "
                        f"use at most {graph.batch_size}")
    return problems


def twice_placed(plan: Plan) -> list[str]:
    """Nodes a plan puts in two places, one line each (what needs no graph to see)."""
    problems: list[str] = []
    where: dict[str, int] = {}
    for i, stage in enumerate(plan.stages):
        for n in stage.nodes:
            if n in where:
                problems.append(f"node {n!r} is in stage {where[n]} and in stage {i}; each node goes in one stage")
            else:
                where[n] = i
    return problems


def _node_problems(plan: Plan, graph: Graph) -> tuple[list[str], dict[str, int]]:
    """Nodes the graph lacks, nodes in two stages and nodes in none; with each node's stage."""
    problems: list[str] = twice_placed(plan)
    where: dict[str, int] = {}
    for i, stage in enumerate(plan.stages):
        for n in stage.nodes:
            if n not in graph.by_id:
                problems.append(f"stage {i} names node {n!r}, which graph {graph.name!r} does not have")
            elif n not in where:
                where[n] = i
    missing = [n for n in graph.topo_order if n not in where]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        problems.append(f"no stage holds node{'s' if len(missing) > 1 else ''} {', '.join(missing[:3])}{more}")
    return problems, where


def _order_problems(plan: Plan, graph: Graph, where: Mapping[str, int]) -> list[str]:
    """Stages that are not convex and edges that go from a later stage to an earlier one."""
    problems: list[str] = []
    for i, stage in enumerate(plan.stages):
        known = [n for n in stage.nodes if n in graph.by_id]
        witness = graph.convexity_witness(known)
        if witness:
            problems.append(f"stage {i} is not convex: the path {' -> '.join(witness)} leaves it and comes back")
    for e in graph.edges:
        if e.src in where and e.dst in where and where[e.src] > where[e.dst]:
            problems.append(
                f"edge {e.src} -> {e.dst} goes backwards, from stage {where[e.src]} to stage {where[e.dst]}"
            )
    return problems


def _device_problems(plan: Plan, cluster: Cluster) -> list[str]:
    """Devices listed twice in a stage, unknown to the cluster, or holding two stages unshared."""
    problems: list[str] = []
    holder: dict[str, int] = {}
    for i, stage in enumerate(plan.stages):
        if len(set(stage.all_devices)) != len(stage.all_devices):
            problems.append(f"stage {i} lists a device twice: {', '.join(stage.all_devices)}")
        for d in dict.fromkeys(stage.all_devices):
            if d not in cluster.by_id:
                problems.append(f"stage {i} uses device {d!r}, which cluster {cluster.name!r} does not have "
                                f"(devices: {listing(cluster.ids)})")
            elif d in holder and not plan.shared_devices and not get_schedule(plan.schedule).interleaved:
                problems.append(f"device {d!r} holds stage {holder[d]} and stage {i}; "
                                "set shared_devices to allow it")
            holder.setdefault(d, i)
    return problems


def _shard_problems(plan: Plan, graph: Graph) -> list[str]:
    """Stages that shard their optimizer state without replicas to shard it over, or with
    tables whose gradients are sparse (their rows are not split into shares)."""
    problems = []
    for i, stage in enumerate(plan.stages):
        if not stage.shard:
            continue
        if len(set(stage.devices)) < 2:
            problems.append(f"stage {i} shards its optimizer state but has one replica; shard needs two or more")
        sparse = [n for n in stage.nodes if n in graph.by_id and graph.by_id[n].updated_bytes is not None]
        if sparse:
            problems.append(f"stage {i} shards its optimizer state but node {sparse[0]!r} has sparse gradients; "
                            "set shard false for that stage")
    return problems


def _tp_group_problems(i: int, stage: Stage, cluster: Cluster) -> list[str]:
    out = []
    for group in stage.tp_devices:
        known = [cluster.by_id[d] for d in group if d in cluster.by_id]
        if len({d.type for d in known}) > 1 or len({d.host for d in known}) > 1:
            out.append(f"stage {i}'s tensor-parallel group {', '.join(group)} mixes device types or hosts; a group "
                       "is devices of one type on one host")
    return out


def _tp_problems(plan: Plan, graph: Graph, cluster: Cluster) -> list[str]:
    """Tensor-parallel stages that cannot run as planned, one line each."""
    problems: list[str] = []
    for i, stage in enumerate(plan.stages):
        if stage.tp == 1:
            continue
        problems += _tp_group_problems(i, stage, cluster)
        if stage.recompute in ("block", "selective"):
            problems.append(f"stage {i} is tensor-parallel and recomputes per block ({stage.recompute}); hetplan "
                            "does not combine the two: set recompute \"stage\" or tp 1")
        if stage.shard:
            problems.append(f"stage {i} is tensor-parallel and shards its optimizer state; hetplan does not combine "
                            "the two: set shard false or tp 1")
        if get_schedule(plan.schedule).interleaved or plan.shared_devices:
            problems.append(f"stage {i} is tensor-parallel under {plan.schedule}"
                            f"{' with shared devices' if plan.shared_devices else ''}; tensor-parallel stages run "
                            "one per group of devices, under gpipe, 1f1b or zero-bubble schedules")
        for degree in sorted(set(stage.degrees) - {1}):
            why = splits_in(graph, stage.nodes, degree)
            if why:
                problems.append(f"stage {i} cannot split {degree} ways: {why}")
    return problems


def _rank_problems(plan: Plan) -> list[str]:
    """An interleaved plan's stages that do not repeat its groups of devices in turn."""
    sched = get_schedule(plan.schedule)
    if not sched.interleaved:
        return []
    n = plan.ranks
    problem = sched.problem(len(plan.stages), n, plan.microbatches)
    if problem:
        return [problem]
    first = [held[0] for held in plan.rank_stages]
    holder = plan.stage_ranks
    problems = [f"stage {i} runs on {', '.join(s.devices)}, but under {plan.schedule} stage {i} runs on the devices "
                f"of stage {first[holder[i]]}: {', '.join(plan.stages[first[holder[i]]].devices)}"
                for i, s in enumerate(plan.stages) if s.devices != plan.stages[first[holder[i]]].devices]
    groups = [set(plan.stages[k].devices) for k in first]
    problems += [f"stages {first[a]} and {first[b]} share a device but not all their devices; under {plan.schedule} "
                 "each rank's devices are its own" for a in range(n) for b in range(a + 1, n) if groups[a] & groups[b]]
    return problems


def validate_plan(plan: Plan, graph: Graph, cluster: Cluster, source: str | None = None) -> None:
    """Raise `PlanError` naming the first problem (and how many more there are), and the plan's
    file when `source` gives it."""
    problems = plan_problems(plan, graph, cluster)
    if problems:
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise PlanError(f"{source + ': ' if source else ''}invalid plan: {problems[0]}{more}")
