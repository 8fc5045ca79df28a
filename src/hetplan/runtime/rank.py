"""Everything one rank builds before its first step, the same way on every rank.

Every rank builds the whole model from the same seed (so the weights agree without sending them)
and cuts the training step into the profiler's pieces (`hetplan.pieces.split`); ranks that share
a process or a launch build and trace it once between them (`SharedTraces`, `runtime.group`). `torch.export`
records shapes as numbers, so a piece traced for 4 rows runs on 4 rows only: a rank traces the
step once per slice size it will run (`hetplan.rows`: its rows of each micro-batch), and all
traces share the model's parameters. Examples at two numbers of rows (`layout_rows`: the step's
smallest slice and one more, the same on every rank, so all agree) show which dimension of every
value crossing a boundary follows the batch (`boundary.layouts`). The rank then places its own
stage on its device (`profile.portable`: no device of the tracing machine survives in it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.lowering import Op, lower, place_sums
from hetplan.pieces.mixed import Mixed
from hetplan.pieces.portable import place
from hetplan.pieces.split import Holdings, SplitStep, holdings, rebind, split_step
from hetplan.pieces.tensor_stage import parallelize
from hetplan.pieces.tracing import DoesNotRun, export_step
from hetplan.plan import Plan
from hetplan.rows import StepRows, step_rows
from hetplan.runtime.boundary import ValueLayout, layouts
from hetplan.runtime.executor import Role
from hetplan.runtime.gradients import sparse_parameter_ids
from hetplan.runtime.sharding import ShardedParameters
from hetplan.runtime.spec import RunSpec
from hetplan.runtime.stages import StageModule, stage_modules
from hetplan.runtime.zero import ShardedUnits
from hetplan.sync import sync_groups
from hetplan.zoo import load_model


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


@dataclass(frozen=True)
class SharedTraces:
    """The model built and the step traced once for all ranks of one process (`runtime.local`'s
    threads): each rank takes a copy of the model and a copy of the cut bound to its own model
    (`split.rebind`), which holds the same weights (every rank's model is from the same seed); the
    first trace stays as it was made, for the next rank, whatever a rank then does to its copy
    (tensor parallelism rewrites it)."""

    made: dict[tuple, tuple[Holdings, SplitStep]] = field(default_factory=dict)
    # what exporting the step for each batch's shapes gave (the module, or the error): cut again at
    # another granularity, not exported again
    exports: dict[tuple, tuple[Holdings, Any]] = field(default_factory=dict)
    built: dict[tuple, Any] = field(default_factory=dict)
    # the boundaries' layouts, the same for every rank of a run (`boundary_layouts`): read once, a
    # rank then traces no size it does not run
    layouts: dict[tuple, tuple[tuple[ValueLayout, ...], ...]] = field(default_factory=dict)
    # one rank takes them, in a process forked after they were made (`runtime.group`): it takes
    # the model and the traces themselves, its own by the fork, not copies
    sole: bool = False

    def model(self, name: str, batch_size: int, seq_len: int, seed: int):
        """The zoo model, built once for the ranks of this process: each rank takes a copy, which
        holds what its own build from the same seed would (a large model's build takes seconds)."""
        key = (name, batch_size, seq_len, seed)
        if key not in self.built:
            self.built[key] = load_model(name, batch_size=batch_size, seq_len=seq_len, seed=seed)
        return self.built[key] if self.sole else copy.deepcopy(self.built[key])

    def split(self, step: nn.Module, batch: Mapping[str, torch.Tensor], granularity: str,
              block_classes: tuple[str, ...] | None) -> SplitStep:
        key = (granularity, block_classes, _shapes(batch))
        if key not in self.made:
            self.made[key] = self._cut(step, batch, granularity, block_classes)
        traced, split = self.made[key]
        now = holdings(step)
        if self.sole and now.keys() == traced.keys() and all(traced[k][0] is obj for k, (obj, _) in now.items()):
            return split
        return rebind(split, traced, step)

    def _cut(self, step: nn.Module, batch: Mapping[str, torch.Tensor], granularity: str,
             block_classes: tuple[str, ...] | None) -> tuple[Holdings, SplitStep]:
        """The step cut at `granularity` from what exporting it for the batch's shapes gave, tried
        once for every granularity (the cut then holds the parameters of the model exported), and
        what it holds. A model that cannot be exported is traced by torch.fx or refused
        (`tracing.trace_step`)."""
        shapes = _shapes(batch)
        if shapes not in self.exports:
            try:
                self.exports[shapes] = (holdings(step), export_step(step, batch))
            except DoesNotRun:
                raise
            except HetplanError as exc:  # kept without its traceback, which holds torch.export's frames
                self.exports[shapes] = (holdings(step), exc.with_traceback(None))
        traced, export = self.exports[shapes]
        if isinstance(export, HetplanError):  # traced again at this granularity, held by `step`
            traced = holdings(step)
        return traced, split_step(step, batch, granularity=granularity, block_classes=block_classes, export=export)


def _shapes(batch: Mapping[str, torch.Tensor]) -> tuple:
    """A batch's keys with each tensor's shape and dtype: what a trace of it depends on."""
    return tuple((k, tuple(v.shape), v.dtype) for k, v in batch.items())


@dataclass(frozen=True)
class Traces:
    """The step cut into stage modules for each number of rows traced (they share parameters);
    `by_rows` fills as sizes are asked for."""

    step: nn.Module
    batch: Mapping[str, torch.Tensor]
    plan: Plan
    granularity: str
    block_classes: tuple[str, ...] | None
    by_rows: dict[int, list[StageModule]]
    on_trace: Callable[[int], None] | None = None  # told before each trace (the launcher's heartbeat)
    shared: SharedTraces | None = None  # traces of the ranks in this process (`runtime.local`)
    rows: StepRows | None = None  # the step's slices, of which the boundaries' layouts are read

    @property
    def input_keys(self) -> tuple[str, ...]:
        return tuple(self.batch)  # the step's inputs, in the batch's order (`SplitStep.input_keys`)

    @property
    def batch_rows(self) -> int:
        return next(iter(self.batch.values())).shape[0]

    def stages(self, rows: int) -> list[StageModule]:
        if rows not in self.by_rows:
            if rows > self.batch_rows:
                raise HetplanError(f"cannot trace {rows} rows from an example batch of fewer")
            if self.on_trace is not None:
                self.on_trace(rows)
            batch = {k: v[:rows] for k, v in self.batch.items()}
            split = (split_step(self.step, batch, granularity=self.granularity, block_classes=self.block_classes)
                     if self.shared is None else self.shared.split(self.step, batch, self.granularity,
                                                                   self.block_classes))
            mods = stage_modules(split, self.plan)
            if self.by_rows:
                _same_cut(next(iter(self.by_rows.values())), mods, rows)
            self.by_rows[rows] = mods
        return self.by_rows[rows]


def _same_cut(a: list[StageModule], b: list[StageModule], rows: int) -> None:
    for x, y in zip(a, b, strict=True):
        if x.spec.pieces != y.spec.pieces or len(x.spec.outputs) != len(y.spec.outputs):
            raise HetplanError(f"the model cuts differently at {rows} rows (stage {x.spec.index}): its code "
                               "depends on the batch size in a way the runtime cannot follow")


def boundary_layouts(traces: Traces) -> tuple[tuple[ValueLayout, ...], ...]:
    """Per boundary k (stage k to k + 1), the layouts of the values it carries: read by the first
    rank of a process that shares its traces (`SharedTraces`), taken by the others."""
    a, b = layout_rows(traces.rows, traces.batch_rows)
    key = (a, b, traces.granularity, traces.block_classes, _shapes(traces.batch), repr(traces.plan))
    if traces.shared is not None and key in traces.shared.layouts:
        return traces.shared.layouts[key]
    runs = [_example_boundaries(traces, r) for r in (a, b)]
    out = tuple(layouts(traces.by_rows[a][k].spec.outputs, va, a, vb, b)
                for k, (va, vb) in enumerate(zip(runs[0], runs[1], strict=True)))
    if traces.shared is not None:
        traces.shared.layouts[key] = out
    return out


def layout_rows(rows: StepRows | None, batch_rows: int) -> tuple[int, int]:
    """The two numbers of rows at which every rank reads the boundaries' layouts, the same on
    every rank: the fewest rows of 2 or more that a slice of the step has (2 if none), and one more
    (one fewer where that is the whole batch). A rank that runs slices of that size traces one
    size beyond those it runs, not two."""
    if batch_rows < 3:
        return 1, batch_rows
    sizes = set() if rows is None else {
        rows.rows(k, j, p) for k, per_micro in enumerate(rows.slices) for j, slices in enumerate(per_micro)
        for p in range(len(slices))}
    a = min((n for n in sizes if n >= 2), default=2)
    return a, a + 1 if a < batch_rows else a - 1


def _example_boundaries(traces: Traces, rows: int) -> list[tuple[torch.Tensor, ...]]:
    """The values crossing each boundary for an example of `rows` rows, with their gradient flags
    as a real step has them; the model's random state and buffers (batch-norm statistics) are
    left as they were."""
    mods = traces.stages(rows)
    buffers = {name: b.clone() for name, b in traces.step.named_buffers()}
    out: list[tuple[torch.Tensor, ...]] = []
    mixed = Mixed(traces.plan.precision, "cpu")  # the values' dtypes as a run makes them
    with torch.random.fork_rng(devices=[]), mixed.step(), mixed.forward():
        values: tuple[torch.Tensor, ...] = tuple(traces.batch[k][:rows] for k in traces.input_keys)
        for k, mod in enumerate(mods[:-1]):
            if k > 0:  # received floating values that carry gradients ask for them, as in a run
                values = tuple(v.detach().requires_grad_(v.requires_grad and v.is_floating_point())
                               for v in values)
            res = mod(*values)
            values = res if isinstance(res, tuple) else (res,)
            out.append(values)
    with torch.no_grad():
        for name, b in traces.step.named_buffers():
            b.copy_(buffers[name])
    return out


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
