"""The training step traced for a run: the model built once for the ranks of a process, the step
cut into the profiler's pieces for each number of rows a rank runs, and the layouts of the values
crossing each boundary.

`torch.export` records shapes as numbers, so a piece traced for 4 rows runs on 4 rows only: a rank
traces the step once per slice size it will run (`hetplan.rows`: its rows of each micro-batch), and
all traces share the model's parameters. Ranks that share a process or a launch build and trace it
once between them (`SharedTraces`, `runtime.group`). Examples at two numbers of rows (`layout_rows`:
the step's smallest slice and one more, the same on every rank, so all agree) show which dimension
of every value crossing a boundary follows the batch (`boundary.layouts`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.pieces.mixed import Mixed
from hetplan.pieces.split import Holdings, SplitStep, holdings, rebind, split_step
from hetplan.pieces.tracing import DoesNotRun, export_step
from hetplan.plan import Plan
from hetplan.rows import StepRows
from hetplan.runtime.boundary import ValueLayout, layouts
from hetplan.runtime.stages import StageModule, stage_modules
from hetplan.zoo import load_model


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
