"""Trace a training step into a DAG of executable pieces, one per hetplan node.

The step (model + loss) is captured with `torch.export` (non-strict, so ordinary Python control
flow in the model runs as usual), which records every ATen op together with the stack of
modules that called it (`nn_module_stack`). Each op is given to a *unit*:

- granularity `layer`: the innermost module that called it, if that module is a leaf (has no
  children);
- granularity `block`: the outermost module on its stack that is a block (its class is one of
  the block classes: a transformer block, a ResNet bottleneck, an Inception branch) or that
  contains no block at all (an embedding, a final norm, a head).

Ops that belong to no unit (functional code between modules: a residual add, a concatenation,
mask and position-id arithmetic, rotary embeddings applied inside attention, the loss) are
folded into a neighbour, so that every piece is code the runtime can run: into the first piece
that consumes their result, or, for the loss and other ops whose results no piece reads, into
their last producer (`_segments` says why this always gives a DAG). Each unit's ops are then copied into
a `torch.fx.GraphModule` of their own, which takes the values it reads from other pieces and
returns the values other pieces read. Parameters stay the very `Parameter` objects of the
model, so a piece trains the model's own weights.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from hetplan.errors import HetplanError
from hetplan.graph import GRANULARITIES
from hetplan.pieces.portable import portable
from hetplan.pieces.tracing import trace_step

_CALLS = ("call_function", "call_method", "call_module")

# A piece writes its Python code the first time it runs, not each time its graph is made, changed
# or copied (torch.fx's lazy graph module): a rank copies every piece of the step and places its
# own (`rank.prepare`), each a new compile of the code otherwise, and runs only its own stage's.
# A torch without it compiles at each of those, as fx always did.
try:
    from torch.fx._lazy_graph_module import _LazyGraphModule as _PIECE_CLASS
except ImportError:
    _PIECE_CLASS = fx.GraphModule


@dataclass(frozen=True)
class Piece:
    """One node's code: `module(*values named by inputs)` returns the values named by outputs."""

    name: str
    op: str
    modules: tuple[str, ...]
    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class SplitStep:
    """A training step cut into pieces in a topological order. `input_keys` are the batch's
    keys in the order of the graph's inputs, `input_names` the values they become, and `loss`
    the value that is the step's loss."""

    pieces: tuple[Piece, ...]
    input_keys: tuple[str, ...]
    input_names: tuple[str, ...]
    loss: str

    def run(self, batch: Mapping[str, Any], capture: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
        """Run the pieces in order; returns the loss and, with `capture`, every value."""
        env: dict[str, Any] = {name: batch[key] for key, name in zip(self.input_keys, self.input_names, strict=True)}
        for piece in self.pieces:
            outs = piece.module(*(env[n] for n in piece.inputs))
            env.update(zip(piece.outputs, outs, strict=True))
        return env[self.loss], (env if capture else {})


def _class_name(t: Any) -> str:
    return t.__name__ if isinstance(t, type) else str(t).rsplit(".", 1)[-1].rstrip("'>")


def find_block_classes(model: nn.Module) -> tuple[str, ...]:
    """Classes of the repeated blocks, for models that do not name them.

    transformers models list them in `_no_split_modules` (what accelerate never splits across
    devices). Otherwise: among the children of ModuleList/Sequential containers that are not
    leaves, the class with the most instances that appear at least twice side by side."""
    for mod in model.modules():
        names = getattr(mod, "_no_split_modules", None)
        if names:
            return tuple(sorted(names))
    counts: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList | nn.Sequential):
            kinds: dict[str, int] = {}
            for child in mod.children():
                if any(True for _ in child.children()):
                    kinds[type(child).__name__] = kinds.get(type(child).__name__, 0) + 1
            for cls, k in kinds.items():
                if k >= 2:
                    counts[cls] = counts.get(cls, 0) + k
    if not counts:
        return ()
    return (max(sorted(counts), key=counts.__getitem__),)


def _stack(n: fx.Node) -> list[str]:
    """Qualified names of the modules that called an op, outermost first (a call of a leaf
    module traced by torch.fx is an op of that module)."""
    names = [q for q, _ in (n.meta.get("nn_module_stack") or {}).values()]
    if n.op == "call_module" and (not names or names[-1] != n.target):
        names.append(str(n.target))
    return names


def _units(gm: fx.GraphModule, ops: list[fx.Node], model: nn.Module, granularity: str,
           block_classes: Iterable[str]) -> dict[fx.Node, str | None]:
    modules = dict(model.named_modules())
    unit: dict[fx.Node, str | None] = {}
    if granularity == "layer":
        for n in ops:
            stack = _stack(n)
            inner = stack[-1] if stack else None
            mod = modules.get(inner) if inner is not None else None
            unit[n] = inner if mod is not None and not any(True for _ in mod.children()) else None
        return unit
    classes = set(block_classes)
    blocks = {name for name, mod in modules.items() if type(mod).__name__ in classes}
    if not blocks:
        raise HetplanError(
            f"granularity block: no module of class {', '.join(sorted(classes)) or '(none found)'} in the model; "
            "name the repeated block with --block-class NAME or use --granularity layer"
        )
    holds_block = {".".join(b.split(".")[:i]) for b in blocks for i in range(len(b.split(".")))}
    for n in ops:
        unit[n] = next((q for q in _stack(n) if q in blocks or (q not in holds_block and q in modules)), None)
    return unit


def _segments(ops: list[fx.Node], unit: dict[fx.Node, str | None]) -> tuple[dict[fx.Node, int], list[str]]:
    """Number the pieces and give every op one (see the module docstring).

    Ops with a unit are cut into maximal runs of the same unit, in graph order; each run is a
    segment (a module called twice gives two). An op without a unit takes the smallest segment
    among its consumers, or, if no consumer has one (the loss, shape assertions), the largest
    among its producers. Then every data edge u -> v has seg(u) <= seg(v): anchored ops are
    ordered like their positions, a folded op is no later than any consumer and no earlier than
    any producer. So the segments, in number order, are a topological order of the pieces and
    the piece graph is a DAG by construction. Last, an element taken from a multi-output op joins
    that op's segment: no earlier than its producer, and no later than before (which was already
    no later than its consumers), so the order holds."""
    seg: dict[fx.Node, int] = {}
    units: list[str] = []
    for n in ops:
        u = unit[n]
        if u is None:
            continue
        if not units or units[-1] != u:
            units.append(u)
        seg[n] = len(units) - 1
    for n in reversed(ops):
        if n not in seg:
            consumers = [seg[c] for c in n.users if c in seg]
            if consumers:
                seg[n] = min(consumers)
    for n in ops:
        if n not in seg:
            producers = [seg[a] for a in n.all_input_nodes if a in seg]
            if producers:
                seg[n] = max(producers)
    if not units:
        units.append("model")
    for n in ops:
        seg.setdefault(n, 0)
    _elements_with_their_producer(ops, seg)
    return seg, units


def _elements_with_their_producer(ops: list[fx.Node], seg: dict[fx.Node, int]) -> None:
    for n in ops:  # in graph order: an element of an element follows its own producer
        if _takes_an_element(n):
            seg[n] = seg[n.args[0]]


def _takes_an_element(n: fx.Node) -> bool:
    """An `operator.getitem` of an op that returns several tensors (split, chunk, unbind, topk):
    it stays in its producer's piece, so that only tensors cross between pieces, never the list."""
    return n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0].op in _CALLS


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _extract(gm: fx.GraphModule, nodes: list[fx.Node], produced_outside: set[fx.Node],
             needed_outside: set[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """Copy `nodes` into a GraphModule of their own. Values from outside become placeholders;
    parameters, buffers and constants become attributes of the piece (the same objects)."""
    graph = fx.Graph()
    root = nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    members = set(nodes)

    def lookup(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a.op == "get_attr":
            value = _attr(gm, a.target)
            name = a.target.replace(".", "_")
            if isinstance(value, nn.Parameter):
                root.register_parameter(name, value)
            elif isinstance(value, torch.Tensor):
                root.register_buffer(name, value)
            else:
                setattr(root, name, value)
            env[a] = graph.get_attr(name)
        else:
            env[a] = graph.placeholder(a.name)
            env[a].meta = copy.copy(a.meta)
            inputs.append(a)
        return env[a]

    # Inputs first, in the order the pieces read them, so that placeholders precede all ops.
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and (a.op == "placeholder" or a in produced_outside):
                lookup(a)
    for n in nodes:
        args = fx.map_arg(n.args, lookup)
        kwargs = fx.map_arg(n.kwargs, lookup)
        target = n.target
        if n.op == "call_module":
            sub = _attr(gm, n.target)
            target = n.target.replace(".", "_")
            root.add_module(target, sub)
        env[n] = graph.create_node(n.op, target, args, kwargs, name=n.name)
        env[n].meta = copy.copy(n.meta)
    outputs = [n for n in nodes if n in needed_outside]
    graph.output(tuple(env[n] for n in outputs))
    # device-neutral, so that a piece traced here runs on any device (`hetplan.pieces.portable`)
    return portable(_PIECE_CLASS(root, graph, class_name="Piece")), inputs, outputs


def split_step(step: nn.Module, batch: Mapping[str, torch.Tensor], granularity: str = "layer",
               block_classes: Iterable[str] | None = None, strip_prefix: str = "model.",
               export: fx.GraphModule | HetplanError | None = None) -> SplitStep:
    """Trace `step(**batch)` (which returns the loss) and cut it into pieces; `export`: what
    `tracing.export_step` gave for this batch before (`trace_step`), whose parameters the pieces
    then hold."""
    if granularity not in GRANULARITIES:
        raise HetplanError(f"--granularity {granularity!r}: allowed are {', '.join(GRANULARITIES)}")
    if not block_classes and granularity == "block":
        block_classes = find_block_classes(step)
    gm, root, strip_prefix = trace_step(step, batch, granularity, block_classes or (), strip_prefix, export)
    modules = dict(root.named_modules())  # the user's classes (the exported module has plain ones)
    ops = [n for n in gm.graph.nodes if n.op in _CALLS and n.target != "_guards_fn"]
    unit = _units(gm, ops, root, granularity, block_classes or ())
    seg, units = _segments(ops, unit)
    members: list[list[fx.Node]] = [[] for _ in units]
    for n in ops:
        members[seg[n]].append(n)
    # A module called more than once gives one piece per call: name the later ones name#2, ...
    calls: dict[str, int] = {}
    names: list[str] = []
    for u in units:
        calls[u] = calls.get(u, 0) + 1
        base = u.removeprefix(strip_prefix)
        names.append(base if calls[u] == 1 else f"{base}#{calls[u]}")

    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_values = list(output_node.all_input_nodes)
    if len(out_values) != 1:
        raise HetplanError("the training step must return one tensor, the loss")
    pieces: list[Piece] = []
    for i, nodes in enumerate(members):
        if not nodes:
            continue
        mine = set(nodes)
        produced_outside = {n for n in ops if n not in mine}
        needed = {n for n in nodes if any(user not in mine for user in n.users)}
        module, inputs, outputs = _extract(gm, nodes, produced_outside, needed)
        for a in inputs:
            if a in seg and seg[a] > i:
                raise AssertionError(f"piece {names[i]} reads {a.name} from a later piece")
        owner = modules.get(units[i])
        op = type(owner).__name__ if owner is not None else "Functional"
        module_name = units[i].removeprefix(strip_prefix)
        pieces.append(Piece(names[i], op, (module_name,), module, tuple(a.name for a in inputs),
                            tuple(n.name for n in outputs)))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return SplitStep(tuple(pieces), tuple(batch), tuple(p.name for p in placeholders), out_values[0].name)


Holdings = dict[tuple[str, str], tuple[Any, tuple]]


def holdings(model: nn.Module) -> Holdings:
    """What `model` holds now, by kind and name: each parameter, buffer and module, with its class
    and, for a tensor, its shape and dtype (what `rebind` maps by)."""
    out = {}
    for kind in ("parameters", "buffers", "modules"):
        for name, obj in getattr(model, f"named_{kind}")(remove_duplicate=False):
            tensor = (tuple(obj.shape), obj.dtype) if isinstance(obj, torch.Tensor) else ()
            out[kind, name] = (obj, (type(obj).__name__, *tensor))
    return out


def rebind(split: SplitStep, traced: Holdings, step: nn.Module) -> SplitStep:
    """`split`, cut from a model that held `traced` (`holdings`) then, as the same cut of `step`,
    another instance of that model: copies of the pieces holding `step`'s own parameters, buffers
    and modules, found by name (the trace's constants are copied). Ranks that share a process take
    their pieces this way instead of tracing again: `torch.export` of a model costs seconds, the
    copy milliseconds."""
    now = holdings(step)
    if now.keys() != traced.keys() or any(now[k][1] != traced[k][1] for k in now):
        raise HetplanError("cannot take over the pieces of another model: the two models hold different "
                           "parameters, buffers or modules; trace this one (split_step)")
    memo: dict[int, Any] = {id(traced[k][0]): now[k][0] for k in now}
    modules = copy.deepcopy(tuple(p.module for p in split.pieces), memo)
    mine = {id(p) for p in step.parameters()}
    if any(id(p) not in mine for m in modules for p in m.parameters()):
        raise HetplanError("the pieces hold a parameter that is not the model's; trace this model (split_step)")
    pieces = tuple(replace(p, module=m) for p, m in zip(split.pieces, modules, strict=True))
    return replace(split, pieces=pieces)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a value (a tensor, or nested tuples/lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def changed_in_place(piece: Piece) -> set[str]:
    """Names of the piece's inputs that one of its operators writes to (an in-place op)."""
    out = set()
    placeholders = [n for n in piece.module.graph.nodes if n.op == "placeholder"]  # in the order of inputs
    for name, ph in zip(piece.inputs, placeholders, strict=True):
        for user in ph.users:
            schema = getattr(user.target, "_schema", None)
            if schema is None:
                continue
            for i, arg in enumerate(schema.arguments):
                value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
                if value is ph and arg.alias_info is not None and arg.alias_info.is_write:
                    out.add(name)
    return out


class CopiesItsInputs(nn.Module):
    """A piece that writes to some of its inputs (ResNet's `add_` of the shortcut, a ReLU in
    place), run on copies of them made inside the call. Under a checkpoint that matters: torch
    keeps the call's inputs to run the forward again in the backward, and refuses one that was
    changed since; copied inside, the kept inputs stay as they were, and the copy is made again
    when the forward is."""

    def __init__(self, module: nn.Module, positions: Iterable[int]):
        super().__init__()
        self.module = module
        self.positions = frozenset(positions)

    def forward(self, *inputs: Any) -> Any:
        return self.module(*[x.clone() if i in self.positions else x for i, x in enumerate(inputs)])


def checkpointable(piece: Piece) -> nn.Module:
    """The piece's module, as a checkpoint around it must call it (`CopiesItsInputs` where it
    changes an input in place)."""
    changed = changed_in_place(piece)
    positions = [i for i, name in enumerate(piece.inputs) if name in changed]
    return CopiesItsInputs(piece.module, positions) if positions else piece.module
