"""Everything one rank builds before its first step, the same way on every rank.

Every rank builds the whole model from the same seed (so the weights agree without sending them)
and cuts the training step into the profiler's pieces for each number of rows it runs
(`runtime.traces`), reads the layouts of the values crossing each boundary, makes its stage
tensor-parallel where the plan says so, works out which gradients it sums with whom and in what
order (`hetplan.sync`, `hetplan.lowering`), and places its own stage on its device
(`pieces.portable`: no device of the tracing machine survives in it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hetplan.lowering import Op, lower, place_sums
from hetplan.pieces.portable import place
from hetplan.pieces.tensor_stage import parallelize
from hetplan.plan import Plan
from hetplan.rows import StepRows, step_rows
from hetplan.runtime.boundary import ValueLayout
from hetplan.runtime.executor import Role
from hetplan.runtime.gradients import sparse_parameter_ids
from hetplan.runtime.sharding import ShardedParameters
from hetplan.runtime.spec import RunSpec
from hetplan.runtime.stages import StageModule
from hetplan.runtime.traces import SharedTraces, Traces, boundary_layouts, layout_rows
from hetplan.runtime.zero import ShardedUnits
from hetplan.sync import sync_groups


def rank_table(spec: RunSpec) -> tuple[tuple[int, ...], ...]:
    """`table[k][p]`: the rank of replica p of stage k (RUN.json names each worker by its first
    stage; under an interleaved schedule it holds every stage of its pipeline rank, `Plan.rank_stages`)."""
    plan = spec.plan
    held = plan.rank_stages
    first = [held[r][0] for r in plan.stage_ranks]
    table: dict[int, dict[int, int]] = {}
    for rank, me in enumerate(spec.ranks):
        if me.tp == 0:
            table.setdefault(me.stage, {})[me.replica] = rank
    return tuple(tuple(table[first[k]][p] for p in range(len(table[first[k]]))) for k in range(len(plan.stages)))


def group_table(spec: RunSpec) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`table[k][p]`: the ranks of replica p of stage k, its tensor-parallel group in order (one
    rank unless the stage is tensor-parallel)."""
    members: dict[tuple[int, int], dict[int, int]] = {}
    for rank, me in enumerate(spec.ranks):
        members.setdefault((me.stage, me.replica), {})[me.tp] = rank

    def group(lead: int) -> tuple[int, ...]:
        found = members[(spec.ranks[lead].stage, spec.ranks[lead].replica)]
        return tuple(found[i] for i in sorted(found))

    return tuple(tuple(group(lead) for lead in leads) for leads in rank_table(spec))


def spec_rows(spec: RunSpec, plan: Plan) -> StepRows:
    return step_rows(spec.settings.batch_size, plan.microbatches, spec.replica_weights)


def gradient_groups(traces: Traces, table: tuple[tuple[int, ...], ...],
                    names: Mapping[int, str]) -> list[tuple[tuple[int, ...], list[nn.Parameter], frozenset[int]]]:
    """Every set of ranks whose gradients are summed, with its parameters in one order and the
    stages that use them (`hetplan.sync.sync_groups`: the replicas of a stage, and, for a
    parameter several stages use, the replicas of all those stages), in the order every rank
    runs them."""
    mods = traces.stages(min(traces.by_rows, default=traces.batch_rows))
    holders: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for k, mod in enumerate(mods):
        for prm in mod.parameters():
            if prm.requires_grad:
                holders.setdefault(id(prm), set()).add(k)
                params[id(prm)] = prm
    out = []
    for group in sync_groups(holders, {(k, p): r for k, ranks in enumerate(table) for p, r in enumerate(ranks)}):
        ranks = tuple(dict.fromkeys(table[k][p] for k, p in group.members))  # a worker's stages share a gradient
        out.append((ranks, sorted((params[pid] for pid in group.params), key=lambda prm: names[id(prm)]),
                    frozenset(k for k, _ in group.members)))
    return out


def slice_sizes(roles: Sequence[Role]) -> set[int]:
    """The numbers of rows a worker runs its stages on (one per distinct slice of a micro-batch)."""
    return {r.rows.rows(r.stage, j, r.replica) for r in roles for j in range(len(r.rows.micro))} - {0} or {1}


@dataclass(frozen=True)
class Prepared:
    """A worker ready to train: its roles (one per stage it holds, in stage order: one unless the
    schedule interleaves), its actions, its stages' modules and what it sums with whom."""

    roles: tuple[Role, ...]
    ops: tuple[Op, ...]  # its list of the step (`hetplan.lowering`)
    traces: Traces
    layouts: tuple[tuple[tuple[ValueLayout, ...], tuple[ValueLayout, ...]], ...]  # per role: (in, out)
    groups: list[tuple[tuple[int, ...], list[nn.Parameter], frozenset[int]]]  # all, mine or not; their stages
    device: torch.device
    sparse: frozenset[int] = frozenset()  # the ids of the tables with sparse gradients (`gradients`)
    shards: tuple[ShardedParameters, ...] = ()  # its stages' groups that shard the optimizer's state
    units: tuple[ShardedUnits, ...] = ()  # those that shard gradients, or parameters too (`runtime.zero`)
    # sums over replicas of unlike tensor-parallel degrees (`tensor_parallel.mixed_sum`): the
    # replicas' first ranks, each replica's ranks, the parameters; each group's ranks, for its
    # mesh; this worker's split parameters' dimensions, by id
    mixed: tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...], list[nn.Parameter]], ...] = ()
    tp_groups: tuple[tuple[int, ...], ...] = ()
    tp_dims: Mapping[int, int] = field(default_factory=dict)
    # every gradient sum of the step, in the order every rank runs them (`summed`): what it sums
    # (("sum", i) of `groups`, ("mixed", j) of `mixed`) and over which ranks (its list's REDUCE_GRAD)
    sums: tuple[tuple[tuple[str, int], tuple[int, ...]], ...] = ()

    @property
    def role(self) -> Role:
        """The role of its first stage (its rank's stage in RUN.json)."""
        return self.roles[0]

    @property
    def first(self) -> bool:
        return any(r.first for r in self.roles)

    @property
    def last(self) -> bool:
        return any(r.last for r in self.roles)

    @property
    def sizes(self) -> set[int]:
        return slice_sizes(self.roles)

    def module_for(self, rows: int, stage: int) -> StageModule:
        return self.traces.stages(rows)[stage]

    @property
    def modules(self) -> list[StageModule]:
        """Its stages' modules (any trace: they hold the same parameters), for weights and checkpoints."""
        return [self.module_for(max(self.sizes), r.stage) for r in self.roles]

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {name: prm for mod in self.modules for name, prm in mod.named_parameters()}

    def parameters(self) -> list[nn.Parameter]:
        return [prm for prm in dict.fromkeys(p for mod in self.modules for p in mod.parameters()) if prm.requires_grad]

    def optimized(self) -> list[nn.Parameter]:
        """What its optimizer steps: its parameters, a share of each sharded group in its stead."""
        sharded = {id(p) for sh in (*self.shards, *self.units) for p in sh.params}
        mine = [sh.shard for sh in self.shards] + [s for u in self.units for s in u.shards]
        return mine + [p for p in self.parameters() if id(p) not in sharded]


def _roles(spec: RunSpec, rank: int, plan: Plan) -> tuple[Role, ...]:
    """The rank's roles, one per stage it holds."""
    table, members = rank_table(spec), group_table(spec)
    me = spec.ranks[rank]
    rows = spec_rows(spec, plan)
    return tuple(Role(k, me.replica, table, rows, plan.stages[k].recompute, plan.precision, members, me.tp)
                 for k in plan.rank_stages[plan.stage_ranks[me.stage]])


def traces_of(spec: RunSpec, zoo_model: Any, plan: Plan, on_trace: Callable[[int], None] | None = None,
              shared: SharedTraces | None = None) -> Traces:
    """The step's traces for the run, none made yet."""
    return Traces(zoo_model.step, zoo_model.batch, plan, spec.settings.granularity,
                  tuple(spec.settings.block_classes or zoo_model.block_classes or ()) or None, {}, on_trace, shared,
                  spec_rows(spec, plan))


def traced_rows(spec: RunSpec, rank: int, traces: Traces) -> list[int]:
    """The numbers of rows `prepare` traces the rank's step at, in its order: each slice size it
    runs, then the two at which the boundaries' layouts are read (`layout_rows`)."""
    sizes = sorted(slice_sizes(_roles(spec, rank, traces.plan)))
    if len(traces.plan.stages) > 1:
        sizes += [r for r in layout_rows(traces.rows, traces.batch_rows) if r not in sizes]
    return sizes


def prepare(spec: RunSpec, rank: int, zoo_model: Any, plan: Plan, device: torch.device,
            on_trace: Callable[[int], None] | None = None, shared: SharedTraces | None = None) -> Prepared:
    table, members = rank_table(spec), group_table(spec)
    me = spec.ranks[rank]
    roles = _roles(spec, rank, plan)
    traces = traces_of(spec, zoo_model, plan, on_trace, shared)
    for size in sorted(slice_sizes(roles)):
        traces.stages(size)
    bounds = boundary_layouts(traces) if len(plan.stages) > 1 else []
    degree = plan.stages[me.stage].degrees[me.replica]
    # its shards in the model and its stage's traces (`tensor_parallel`)
    dims = _parallelize(traces, zoo_model.step, me.stage, degree, me.tp,
                        plan.stages[me.stage].sequence_parallel) if degree > 1 else {}
    names = {id(prm): name for name, prm in zoo_model.step.named_parameters()}
    groups, mixed, order = tp_sums(gradient_groups(traces, table, names), members)
    layouts = tuple((bounds[r.stage - 1] if r.stage > 0 else (), bounds[r.stage] if r.stage < len(bounds) else ())
                    for r in roles)
    sums = summed(groups, mixed, order)
    ops = lower(plan.schedule, members, plan.stage_ranks, spec_rows(spec, plan), [ranks for _, ranks in sums]).ops[rank]
    prepared = Prepared(roles, ops, traces, layouts, groups, device, sparse_parameter_ids(zoo_model.step),
                        mixed=mixed, tp_groups=tuple(g for stage in members for g in stage if len(g) > 1),
                        tp_dims=dims, sums=tuple(sums))
    for size in sorted(prepared.sizes):
        for r in roles:
            place(prepared.module_for(size, r.stage), device)
    sharded = _sharded_groups(plan, roles, groups, table[me.stage][me.replica])
    return replace(prepared, shards=tuple(ShardedParameters(params, ranks, me, index)
                                          for _, params, ranks, me, level, index in sharded if level == 1),
                   units=_with_units(traces, tuple(g for g in sharded if g[4] >= 2)))


def _parallelize(traces: Traces, model: nn.Module, stage: int, degree: int, index: int,
                 sequence_parallel: bool) -> dict[int, int]:
    """The stage's module in every trace made tensor-parallel (and sequence-parallel), worker
    `index` of `degree`; returns the dimension each of its shards splits, by the shard's id."""
    sizes = sorted(traces.by_rows)
    made, dims = parallelize([traces.by_rows[r][stage] for r in sizes], model, degree, index, sequence_parallel)
    for r, module in zip(sizes, made, strict=True):
        traces.by_rows[r][stage] = module
    return dims


def tp_sums(groups, members: tuple[tuple[tuple[int, ...], ...], ...]):
    """The gradient sums of `gradient_groups` (made over each replica's first rank) with tensor
    parallelism: a group of one stage whose replicas are groups of t ranks sums at each of the t
    places apart (each rank its shards, or its whole copies: the same on every rank of a group);
    a group over replicas of unlike degrees (a stage's A100s one by one beside V100s as a group,
    or a weight tied across stages) goes to `tensor_parallel.mixed_sum`. Returns the sums,
    those, and the order of both as every rank runs them (("sum", i) or ("mixed", j), in
    `gradient_groups`' order), the same on every rank."""
    sums, mixed, order = [], [], []
    for ranks, params, stages in groups:
        by_first = {g[0]: g for k in stages for g in members[k]}
        groups_of = tuple(by_first[r] for r in ranks)
        places = place_sums(groups_of, len(stages))
        if places is None:
            order.append(("mixed", len(mixed)))
            mixed.append((ranks, groups_of, params))
        else:
            order += [("sum", len(sums) + i) for i in range(len(places))]
            sums += [(place, params, stages) for place in places]
    return sums, tuple(mixed), tuple(order)


def summed(groups, mixed, order) -> list[tuple[tuple[str, int], tuple[int, ...]]]:
    """Of `tp_sums`' order, the sums of two ranks or more with gradients to sum, each with its
    ranks (a sum over replicas of unlike degrees: all their ranks, as `lowering.sum_ranks`)."""
    out = []
    for kind, i in order:
        if kind == "sum":
            ranks, params, _ = groups[i]
        else:
            _, replicas, params = mixed[i]
            ranks = tuple(dict.fromkeys(r for g in replicas for r in g))
        if len(ranks) > 1 and params:
            out.append(((kind, i), tuple(ranks)))
    return out


def _sharded_groups(plan: Plan, roles: Sequence[Role], groups, rank: int) -> list[tuple]:
    """The worker's groups its replicas shard: of each stage of its that shards, the group of
    the parameters only that stage uses, as (stage, params, ranks, this rank's place, level, index)."""
    out = []
    for index, (ranks, params, stages) in enumerate(groups):
        k = next(iter(stages))
        level = plan.stages[k].shard
        if len(stages) == 1 and level and rank in ranks and len(ranks) > 1 and params \
                and any(r.stage == k for r in roles):
            out.append((k, params, ranks, ranks.index(rank), level, index))
    return out


def _with_units(traces: Traces, wanted: tuple) -> tuple[ShardedUnits, ...]:
    """Each stage's `zero.ShardedUnits`, its units the stage's pieces (`StageModule.pieces`),
    and every trace's module of the stage running its pieces through them."""
    out = []
    for stage, params, ranks, me, level, index in wanted:
        modules = [mods[stage] for mods in traces.by_rows.values()]
        ids = {id(p) for p in params}
        pieces = [[p for p in piece.parameters() if id(p) in ids] for piece in modules[0].pieces]
        units = ShardedUnits(pieces, ranks, me, level, index, stage)
        for module in modules:
            module.around = units.call
        out.append(units)
    return tuple(out)
