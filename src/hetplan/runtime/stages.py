"""One `nn.Module` per stage of a plan, from the pieces of the profiled training step.

The profiler cut the step into pieces, one per graph node (`hetplan.pieces.split`); the same
cut, made again here from the same model and batch shapes, gives pieces with the same names. A
stage runs its pieces in topological order. The runtime connects only neighbouring stages
(`hetplan.runtime.support.ROUTING`), so every value that crosses boundary k (made at or before stage k, used
after it: activations, skip connections, the batch's labels on their way to the loss) is an
output of stage k and an input of stage k + 1, in a fixed order; a stage passes on the values it
does not use itself. The first stage takes the batch's tensors in the order of the step's
inputs, and the last stage returns the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.pieces.split import Piece, SplitStep, changed_in_place, checkpointable
from hetplan.plan import Plan


@dataclass(frozen=True)
class StageSpec:
    """What one stage reads, runs and sends on."""

    index: int
    pieces: tuple[str, ...]
    inputs: tuple[str, ...]  # value names, in the order the stage receives them
    outputs: tuple[str, ...]  # value names it sends to the next stage (the loss for the last)


BATCH_NODES = ("input", "batch")  # the node the profiler adds for the batch: no code, not a piece


def check_names_modules(step: nn.Module, plan: Plan, strip_prefix: str = "model.") -> None:
    """Refuse a plan made for another model, before any worker traces the step: every piece the
    profiler cuts is named after a module of the step (`split_step`: the module's path less
    `strip_prefix`, "#k" for its k-th call), so a node that names none cannot be in the model.
    The workers' full check (`stage_specs`) still follows."""
    names = {n for name, _ in step.named_modules() for n in (name, name.removeprefix(strip_prefix))}
    stray = [v for v in plan.stage_of() if v not in BATCH_NODES and v.split("#")[0] not in names]
    if stray:
        raise HetplanError(f"the model does not split like the plan's graph: the plan names node {stray[0]!r}, "
                           f"which is not a module of the model ({len(stray)} such nodes); plan a graph profiled "
                           "from this model, or pass the model the plan was made for")


def stage_specs(split: SplitStep, plan: Plan) -> list[StageSpec]:
    """The values crossing each boundary of the plan's chain of stages."""
    names = {p.name for p in split.pieces}
    where = {v: s for v, s in plan.stage_of().items() if v in names or v not in BATCH_NODES}
    missing = [n for n in where if n not in names]
    extra = [p.name for p in split.pieces if p.name not in where]
    if missing or extra:
        what = f"the plan names node {missing[0]!r}, which" if missing else f"node {extra[0]!r} of the model"
        raise HetplanError(f"the model does not split like the plan's graph: {what} is not in "
                           f"{'the model' if missing else 'the plan'}; profile the model again with the same "
                           "batch size, sequence length and granularity, and plan that graph")
    n = len(plan.stages)
    made_in: dict[str, int] = {v: -1 for v in split.input_names}  # batch values: before stage 0
    last_use: dict[str, int] = {}
    for piece in split.pieces:
        s = where[piece.name]
        for v in piece.outputs:
            made_in[v] = s
        for v in piece.inputs:
            last_use[v] = max(last_use.get(v, -1), s)
    for piece in split.pieces:
        for v in piece.inputs:
            if made_in.get(v, -1) > where[piece.name]:
                raise HetplanError(f"node {piece.name!r} reads {v!r} from a later stage; "
                                   "the plan is not in pipeline order")
    specs = []
    order = [p.name for p in split.pieces]  # a topological order
    for k in range(n):
        inputs = tuple(split.input_names) if k == 0 else specs[-1].outputs
        if k == n - 1:
            outputs: tuple[str, ...] = (split.loss,)
        else:
            # every value made at or before stage k that some later stage reads, in a fixed order
            outputs = tuple(v for v in [*split.input_names, *(o for p in split.pieces for o in p.outputs)]
                            if made_in.get(v, -2) <= k < last_use.get(v, -1))
            outputs = tuple(dict.fromkeys(outputs))
        mine = tuple(name for name in order if where[name] == k)
        specs.append(StageSpec(k, mine, inputs, outputs))
    return specs


class StageModule(nn.Module):
    """Runs a stage's pieces; `forward(*inputs)` returns the stage's outputs (a tuple, or the loss
    alone for the last stage). The pieces hold the model's own parameters."""

    def __init__(self, spec: StageSpec, pieces: Sequence[Piece]):
        super().__init__()
        self.spec = spec
        self.pieces = nn.ModuleList([p.module for p in pieces])
        self._io = [(p.inputs, p.outputs) for p in pieces]
        self._mutated = frozenset(v for p in pieces for v in changed_in_place(p)) & set(spec.inputs)
        self._checkpointable = [checkpointable(p) for p in pieces]  # a plain list: the same parameters
        # what runs each piece where its stage shards its parameters (`hetplan.runtime.zero`):
        # around(index, piece, inputs, call) gathers them for it, then calls as below
        self.around: Callable[[int, nn.Module, list, Callable | None], tuple] | None = None

    def forward(self, *values: torch.Tensor):
        return self.run(values)

    def run(self, values: Sequence[torch.Tensor], call: Callable[[nn.Module, list], tuple] | None = None):
        """The forward, each piece run by `call(piece, inputs)` where given (a checkpoint per piece:
        `Stage.recompute` "block"); such a call runs a piece that changes its inputs in place on
        copies made inside it (`checkpointable`), so that running it again in the backward reads
        what the forward read."""
        # a received value that a piece changes in place (ResNet's ReLU(inplace=True)) is copied
        # first: autograd forbids changing a leaf that asks for its gradient
        env = {v: x.clone() if v in self._mutated and x.requires_grad else x
               for v, x in zip(self.spec.inputs, values, strict=True)}
        for i, (module, (ins, outs)) in enumerate(zip(self.pieces, self._io, strict=True)):
            args = [env[v] for v in ins]
            if call is not None:
                module = self._checkpointable[i]
            if self.around is not None:
                results = self.around(i, module, args, call)
            elif call is None:
                results = module(*args)
            else:
                results = call(module, args)
            env.update(zip(outs, results, strict=True))
        # a value passed on unchanged is cloned: the pipeline's send and receive buffers must
        # not alias the stage's inputs
        received = set(self.spec.inputs)
        out = tuple(env[v].clone() if v in received else env[v] for v in self.spec.outputs)
        return out[0] if len(out) == 1 else out


def stage_modules(split: SplitStep, plan: Plan) -> list[StageModule]:
    by_name = {p.name: p for p in split.pieces}
    return [StageModule(spec, [by_name[name] for name in spec.pieces]) for spec in stage_specs(split, plan)]
