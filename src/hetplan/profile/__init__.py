"""Profile a PyTorch training step into a hetplan `Graph`.

`profile(model, example_inputs, ...)` and `profile_step(step, batch, ...)` trace the step with
`torch.export`, cut it into one executable piece per node (`hetplan.pieces.split`), run it once
to capture every piece's inputs, and then time each piece's forward and backward pass on each
requested device, with all pieces run in sequence as the step runs them
(`hetplan.profile.timing`). Edges carry the bytes of the tensors that really flow between
pieces, so residual and skip connections and parallel branches appear as they are.

The user's model is never changed: the profiler works on a deep copy, and restores the random
number generators, the number of threads and the grad mode it found.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from hetplan._frozen import FrozenMap
from hetplan.errors import HetplanError
from hetplan.graph import Edge, Graph, Node, Tied
from hetplan.pieces.hostmem import keep_freed_memory
from hetplan.pieces.mixed import Mixed
from hetplan.pieces.selective import Figures
from hetplan.pieces.split import GRANULARITIES, Piece, SplitStep, split_step, tensor_bytes
from hetplan.pieces.split_acts import Shares
from hetplan.precision import FP32
from hetplan.precision import checked as checked_precision
from hetplan.profile.devices import ProfileDevice, parse_device
from hetplan.profile.timing import (
    Timing,
    fixed_parts,
    optimizer_times,
    rerun_forwards,
    selective_pass,
    small_part,
    split_acts_pass,
    time_in_sequence,
    warm_pass,
)

__all__ = ["GRANULARITIES", "ProfileReport", "profile", "profile_step"]


@dataclass(frozen=True)
class ProfileReport:
    """A profiled graph, with what it cost to make and, with `check`, how faithful it is.

    `whole_step_s` is the median measured forward+backward step of the unsplit model per device
    type and `whole_step_range_s` its fastest and slowest run, each run just before one repeat
    of the pieces. `check_ratio` is the median over the repeats of the pieces' time (the sum of
    the nodes) over the whole step run just before: each pair sees the same machine, which on a
    shared one drifts by 2x within a minute, and the median drops the pairs a burst of other
    work hit. `check_ratio_median` is the sum of the nodes' median times (what the graph
    stores) over the median whole step."""

    graph: Graph
    profile_s: float
    whole_step_s: Mapping[str, float] = field(default_factory=FrozenMap)
    whole_step_range_s: Mapping[str, tuple[float, float]] = field(default_factory=FrozenMap)
    check_ratio: Mapping[str, float] = field(default_factory=FrozenMap)
    check_ratio_median: Mapping[str, float] = field(default_factory=FrozenMap)


@contextlib.contextmanager
def _preserved(devices: Sequence[ProfileDevice]) -> Iterator[None]:
    cuda = sorted({int(d.torch_device.split(":")[1]) for d in devices if d.is_cuda})
    threads = torch.get_num_threads()
    grad = torch.is_grad_enabled()
    try:
        with torch.random.fork_rng(devices=cuda):
            torch.set_grad_enabled(True)
            yield
    finally:
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)


def _to(batch: Mapping[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


@dataclass
class _Measured:
    split: SplitStep
    values: dict[str, Any]
    times: dict[str, Timing]
    flops: dict[str, float]
    act_bytes: dict[str, int]
    totals_s: list[float]  # per repeat, the sum of all nodes
    whole_s: list[float]  # per repeat, the unsplit step (with check)
    repeats: int
    fixed: dict[str, tuple[float, float]] | None = None  # per node, the fixed parts (`_fixed_parts`)
    opt_s: dict[str, float] = field(default_factory=dict)  # per node with parameters, its optimizer step
    updated: dict[str, tuple[int | None, int]] = field(default_factory=dict)  # per node, `_updated_bytes`
    casts: dict[str, int] = field(default_factory=dict)  # per node, its weights' 16-bit copies (`Node.cast_bytes`)
    tp_units: dict[str, int] = field(default_factory=dict)  # per node, its most tensor-parallel ways (`Node.tp_units`)
    # per node that keeps activations, what selective recomputation keeps and builds again, and
    # what recomputing it adds per unit (`Node.rerun_forwards`)
    selective: dict[str, tuple[Figures, dict[str, float]]] = field(default_factory=dict)
    # per node that keeps activations, what a tensor-parallel group splits of them (`pieces.split_acts`)
    split_acts: dict[str, Shares] = field(default_factory=dict)


def _selective_fields(measured: tuple[Figures, dict[str, float]] | None) -> dict[str, object]:
    """A node's recomputation figures (`Node.selective_keep_bytes`, `rerun_forwards`, ...):
    nothing kept, built or run again for a node that keeps no activations (its checkpoint is
    never unpacked)."""
    if measured is None:
        return {"selective_keep_bytes": 0, "selective_rebuilt_bytes": 0,
                "rerun_forwards": {"block": 0.0, "selective": 0.0}}
    figures, rerun = measured
    return {"selective_keep_bytes": figures.keep_bytes, "selective_rebuilt_bytes": figures.rebuilt_bytes,
            "rerun_forwards": rerun}


def _split_fields(shares: Shares | None) -> dict[str, float]:
    """A node's `act_split_share` and `act_sequence_share` (0 where not measured)."""
    return {} if shares is None else {"act_split_share": shares.split_share,
                                      "act_sequence_share": shares.sequence_share}


def _small_batch(step: nn.Module, batch: Mapping[str, Any], device: ProfileDevice, granularity: str,
                 block_classes: Sequence[str] | None, batch_size: int) -> tuple[int, SplitStep, dict] | None:
    """The step cut again at an eighth of the batch (a micro-batch of 8, so that the line between
    the two sizes covers the micro-batches plans use rather than extrapolates to them; two
    samples at least: batch norm needs them), on a copy of its own; None when the batch is too
    small to shrink or the model runs only at its size."""
    cut = small_part(batch, device.torch_device, batch_size)
    if cut is None:
        return None
    small, part = cut
    try:
        return small, split_step(copy.deepcopy(step).to(device.torch_device).train(), part, granularity,
                                 block_classes), part
    except HetplanError:  # a model that only runs at its own batch size: no fixed parts
        return None


def _measure(step: nn.Module, batch: Mapping[str, Any], device: ProfileDevice, granularity: str,
             block_classes: Sequence[str] | None, repeats: int, seed: int, check: bool, fixed: bool,
             progress: Callable[[float], None] | None, batch_size: int, precision: str) -> _Measured:
    """Cuts a copy of the step into pieces, counts each piece's FLOPs and saved bytes, and times
    the pieces in sequence; with `check`, also the unsplit copy, a step before each repeat (at
    least 5: a shared machine's speed drifts by 10% and more between runs, so a reference from
    fewer runs misleads); with `fixed`, also the pieces at a smaller batch, right after each
    repeat, for each node's fixed parts."""
    work = copy.deepcopy(step).to(device.torch_device).train()
    data = _to(batch, device.torch_device)
    split = split_step(work, data, granularity, block_classes)
    torch.manual_seed(seed)
    mixed = Mixed(precision, torch.device(device.torch_device).type)
    with torch.no_grad(), mixed.step(), mixed.forward():  # the values as they are in that precision
        _, values = split.run(data, capture=True)
    warm = {p.name: warm_pass(p, [values[n] for n in p.inputs], split.input_names, mixed) for p in split.pieces}
    kept = {p.name: (selective_pass(p, [values[n] for n in p.inputs], split.input_names, mixed),
                     rerun_forwards(p, [values[n] for n in p.inputs], split.input_names, mixed, device.torch_device))
            for p in split.pieces if warm[p.name].act_bytes > 0}
    small = _small_batch(step, batch, device, granularity, block_classes, batch_size) if fixed else None
    repeats = max(repeats, 5) if check else repeats
    timed = time_in_sequence(split, data, device.torch_device, repeats, whole=work if check else None,
                             progress=progress, also=[small[1:]] if small else [], precision=precision)
    parts = fixed_parts(timed.times, timed.also[0], batch_size, small[0]) if small else None
    updated = {p.name: _updated_bytes(p.module.parameters()) for p in split.pieces}  # before the steps below
    opt = optimizer_times(split, device.torch_device, repeats)
    return _Measured(split, values, timed.times, {n: w.flops for n, w in warm.items()},
                     {n: w.act_bytes for n, w in warm.items()}, timed.totals_s, timed.whole_s, repeats, parts, opt,
                     updated, {n: w.cast_bytes for n, w in warm.items()}, _tp_units(work, split), kept,
                     _split_acts(work, split, values, mixed, [p.name for p in split.pieces if p.name in kept]))


def profile_step(
    step: nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    name: str = "model",
    devices: Sequence[str] = ("cpu",),
    granularity: str = "layer",
    block_classes: Sequence[str] | None = None,
    repeats: int = 3,
    seed: int = 0,
    check: bool = False,
    fixed: bool = True,
    progress: Callable[[float, str], None] | None = None,
    precision: str = FP32,
    tp_degrees: Sequence[int] = (),
) -> ProfileReport:
    """Profile `step(**batch)`, a module whose forward returns the training loss.

    Node times come from all pieces run in sequence, as the step runs them
    (`hetplan.profile.timing`). With `check`, the unsplit step is timed too, interleaved with
    the repeats, for the ratios of `ProfileReport`. With `fixed`, every node is timed again
    (in sequence too) at an eighth of the batch (a micro-batch of 8, so that the line between
    the two sizes covers the micro-batches plans use rather than extrapolates to them), and
    the two times give the part of each pass that does not shrink with the batch
    (`Node.fwd_fixed_s`): t(b) = fixed + rate * b. It keeps this process's freed memory for
    reuse, as the runtime's workers do (`hetplan.pieces.hostmem`), so both measure one allocator.
    `progress(share of the whole profile done, what it is doing)` is told as it goes. Every pass
    runs in `precision` (`hetplan.precision`: torch's autocast for bf16 and fp16), and the graph
    says so (`Graph.precision`). With `tp_degrees`, each node is timed too on tensor-parallel
    groups of that many workers of each CPU device (`Node.tp_s`, `hetplan.profile.tensor_times`)."""
    parsed, batch_size = _checked(granularity, repeats, devices, batch)
    checked_precision(precision)
    keep_freed_memory()
    start = time.perf_counter()
    measured: dict[str, _Measured] = {}
    fixed_parts: dict[str, dict[str, tuple[float, float]]] = {}
    with _preserved(parsed):
        for k, device in enumerate(parsed):
            if device.threads:
                torch.set_num_threads(device.threads)
            told = (lambda share, k=k, d=device.spec: progress((k + share) / len(parsed), f"timing on {d}")
                    ) if progress else None
            try:
                measured[device.device_type] = _measure(step, batch, device, granularity, block_classes,
                                                         repeats, seed, check, fixed, told, batch_size, precision)
                if measured[device.device_type].fixed is not None:
                    fixed_parts[device.device_type] = measured[device.device_type].fixed
                if len(measured) > 1:  # sizes come from the first device: let the rest go
                    measured[device.device_type].values.clear()
            except Exception as exc:
                if _is_oom(exc):
                    raise HetplanError(
                        f"out of memory while profiling {name} at batch size {batch_size} on {device.spec}: "
                        "try a smaller --batch-size"
                    ) from None
                raise
    graph = _build_graph(name, measured, parsed, batch, batch_size, granularity, fixed_parts, host_modules(step),
                         precision)
    if tp_degrees:
        from hetplan.profile.tensor_times import with_group_times

        if progress:
            progress(1.0, f"timing tensor-parallel groups of {', '.join(map(str, tp_degrees))}")
        graph = with_group_times(graph, step, batch, parsed, tp_degrees, granularity, block_classes, repeats,
                                 precision, fixed)
    if granularity == "block" and block_classes:  # so that `hetplan run` cuts the model the same way
        graph = replace(graph, meta={**graph.meta, "block_classes": ",".join(block_classes)})
    return _report(graph, start, measured)


def _checked(granularity: str, repeats: int, devices: Sequence[str],
             batch: Mapping[str, torch.Tensor]) -> tuple[list[ProfileDevice], int]:
    """The devices to profile on (one per device type) and the batch size; refuses bad settings."""
    if granularity not in GRANULARITIES:
        raise HetplanError(f"--granularity {granularity!r}: allowed are {', '.join(GRANULARITIES)}")
    if repeats < 1:
        raise HetplanError(f"--repeats {repeats}: must be >= 1")
    parsed = list({d.device_type: d for d in map(parse_device, devices)}.values())
    if not parsed:
        raise HetplanError("give at least one --device")
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise HetplanError("the example batch needs at least one tensor with a batch dimension")
    return parsed, int(tensors[0].shape[0])


def _report(graph: Graph, start: float, measured: Mapping[str, _Measured]) -> ProfileReport:
    """The graph with the profiling time and, for `check`, the whole step's times and ratios."""
    whole = {t: m for t, m in measured.items() if m.whole_s}
    return ProfileReport(
        graph, time.perf_counter() - start,
        whole_step_s={t: statistics.median(m.whole_s) for t, m in whole.items()},
        whole_step_range_s={t: (min(m.whole_s), max(m.whole_s)) for t, m in whole.items()},
        check_ratio={t: statistics.median(a / b for a, b in zip(m.totals_s, m.whole_s, strict=True))
                     for t, m in whole.items() if min(m.whole_s) > 0},
        check_ratio_median={t: (graph.fwd_s_total(t) + graph.bwd_s_total(t)) / statistics.median(m.whole_s)
                            for t, m in whole.items() if statistics.median(m.whole_s) > 0},
    )


def host_modules(step: nn.Module) -> tuple[str, ...]:
    """Qualified names (as `Node.module` writes them) of the modules whose work runs on the host
    whatever the device: those with a true `runs_on_host` attribute (`CriteoParser`)."""
    return tuple(q.removeprefix("model.") for q, m in step.named_modules() if getattr(m, "runs_on_host", False))


def _updated_bytes(params: Iterable[torch.Tensor]) -> tuple[int | None, int]:
    """The bytes of these parameters the optimizer updates, from the gradients the profiled step
    left: the looked-up rows of a sparse one (`Node.updated_bytes`), None if that is all; and
    how many rows of sparse ones the batch looked up (`Node.sparse_rows`)."""
    total, sparse, looked_up = 0, False, 0
    for p in params:
        g = p.grad
        if g is not None and g.is_sparse:
            sparse = True
            rows = g.coalesce().indices().shape[1]  # the distinct rows the batch looked up
            looked_up += rows
            total += rows * (p.numel() // max(p.shape[0], 1)) * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return (total if sparse else None), looked_up


def _tp_units(model: nn.Module, split: SplitStep) -> dict[str, int]:
    """Each piece's most tensor-parallel ways (`Node.tp_units`, `hetplan.pieces.tensor_split`)."""
    from hetplan.pieces.tensor_split import split_units

    names = {id(p): n for n, p in model.named_parameters()}
    return {piece.name: _or_whole(lambda piece=piece: split_units(
        model, {names[id(p)] for p in piece.module.parameters() if id(p) in names}), 1) for piece in split.pieces}


def _or_whole(rule, whole):
    """A tensor-parallel split rule's answer, or `whole` (the node never splits) where the rule
    cannot read the model: a profile asked of a model those rules do not know (a configuration
    laid out another way) still profiles it, for plans without tensor parallelism."""
    try:
        return rule()
    except Exception:  # noqa: BLE001 - any failure of the rules only takes tensor parallelism off the table
        return whole


def _split_acts(model: nn.Module, split: SplitStep, values: Mapping[str, Any], mixed: Mixed,
                wanted: Sequence[str]) -> dict[str, Shares]:
    """The `wanted` pieces' shares of their activations a tensor-parallel group splits
    (`Node.act_split_share`, `act_sequence_share`), for those that hold a whole pair of split
    projections, or a head split by words whose loss is vocabulary-parallel (`pieces.split_acts`);
    none for a piece with a projection that cannot split (it never runs tensor-parallel)."""
    from hetplan.pieces.tensor_split import ROW_KIND, class_split_loss, tensor_splits

    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for piece in (p for p in split.pieces if p.name in wanted):
        params = [p for p in piece.module.parameters() if id(p) in names]
        splits = _or_whole(lambda params=params: tensor_splits(model, 2, {names[id(p)] for p in params}), None)
        if splits is None:
            continue
        kinds = {p.untyped_storage().data_ptr(): splits[names[id(p)]].kind for p in params}
        by_param = {id(p): splits[names[id(p)]].kind for p in params}
        if ROW_KIND not in kinds.values() and not _or_whole(
                lambda piece=piece, by_param=by_param: class_split_loss(piece.module, by_param), False):
            continue
        out[piece.name] = split_acts_pass(piece, [values[n] for n in piece.inputs], kinds, split.input_names, mixed)
    return out


def _build_graph(name: str, measured: Mapping[str, _Measured], devices: Sequence[ProfileDevice],
                 batch: Mapping[str, Any], batch_size: int, granularity: str,
                 fixed_parts: Mapping[str, Mapping[str, tuple[float, float]]] | None = None,
                 host: Sequence[str] = (), precision: str = FP32) -> Graph:
    first = measured[devices[0].device_type]
    split = first.split
    names = [p.name for p in split.pieces]
    for dtype, m in measured.items():
        if [p.name for p in m.split.pieces] != names:
            raise HetplanError(f"the model was cut differently on {dtype}; profile one device type per run")
    input_id = "input" if "input" not in names else "batch"
    producer = {out: p.name for p in split.pieces for out in p.outputs}
    graph_inputs = set(split.input_names)
    values = first.values

    edges: dict[tuple[str, str], int] = {}
    for piece in split.pieces:
        for value in piece.inputs:
            src = input_id if value in graph_inputs else producer[value]
            edges[(src, piece.name)] = edges.get((src, piece.name), 0) + tensor_bytes(values[value])
    batch_bytes = sum(tensor_bytes(v) for v in batch.values())
    nodes = [Node(input_id, "Input", {t: 0.0 for t in measured}, {t: 0.0 for t in measured},
                  out_bytes=batch_bytes, is_input=True, tp_units=0)]
    for piece in split.pieces:
        params = {id(p): p for p in piece.module.parameters()}
        nodes.append(Node(
            id=piece.name,
            op=piece.op,
            fwd_s={t: m.times[piece.name].fwd_s for t, m in measured.items()},
            bwd_s={t: m.times[piece.name].bwd_s for t, m in measured.items()},
            flops=first.flops[piece.name],
            param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
            out_bytes=tensor_bytes([values[o] for o in piece.outputs]),
            act_bytes=first.act_bytes[piece.name],
            cast_bytes=first.casts.get(piece.name, 0),
            tp_units=first.tp_units.get(piece.name, 0),
            **_selective_fields(first.selective.get(piece.name)),
            **_split_fields(first.split_acts.get(piece.name)),
            module=piece.modules,
            runs_on_host=any(m == h or m.startswith(h + ".") for m in piece.modules for h in host),
            updated_bytes=first.updated[piece.name][0],
            sparse_rows=first.updated[piece.name][1],
            opt_s={t: m.opt_s[piece.name] for t, m in measured.items() if piece.name in m.opt_s},
            fwd_fixed_s={t: f[piece.name][0] for t, f in (fixed_parts or {}).items() if piece.name in f},
            bwd_fixed_s={t: f[piece.name][1] for t, f in (fixed_parts or {}).items() if piece.name in f},
        ))
    tied = _tied(split.pieces)
    shapes = ", ".join(f"{k}[{'x'.join(map(str, v.shape))}] {str(v.dtype).removeprefix('torch.')}"
                       for k, v in batch.items() if isinstance(v, torch.Tensor))
    return Graph(
        name=name,
        nodes=tuple(nodes),
        edges=tuple(Edge(s, d, b) for (s, d), b in edges.items()),
        batch_size=batch_size,
        profiled_on=devices[0].device_type,
        source=f"profile:{name}",
        meta={"granularity": granularity, "inputs": shapes, "torch": torch.__version__,
              # the sequence length, so that `hetplan run` rebuilds the model at the profiled shape
              **({"seq_len": str(batch["input_ids"].shape[1])}
                 if isinstance(batch.get("input_ids"), torch.Tensor) and batch["input_ids"].dim() == 2 else {}),
              "timing": f"pieces run in sequence, a timestamp between pieces, median of {first.repeats} repeats"},
        tied=tied,
        precision=precision,
    )


def _tied(pieces: Sequence[Piece]) -> tuple[Tied, ...]:
    """The parameters several pieces use (GPT-2's token embedding and output layer), their
    bytes summed per set of pieces: the graph's `tied`."""
    users: dict[int, list[str]] = {}
    size: dict[int, int] = {}
    for piece in pieces:
        for prm in dict.fromkeys(piece.module.parameters()):
            if prm.requires_grad:
                users.setdefault(id(prm), []).append(piece.name)
                size[id(prm)] = prm.numel() * prm.element_size()
    per_set: dict[tuple[str, ...], int] = {}
    for pid, names in users.items():
        if len(names) > 1:
            per_set[tuple(names)] = per_set.get(tuple(names), 0) + size[pid]
    return tuple(Tied(names, nbytes) for names, nbytes in per_set.items())


def profile(
    model: nn.Module,
    example_inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: str | Sequence[str] = "cpu",
    granularity: str = "layer",
    block_classes: Sequence[str] | None = None,
    repeats: int = 3,
    name: str | None = None,
    check: bool = False,
    precision: str = FP32,
) -> Graph:
    """Profile one training step of `model` on `example_inputs` (a dict of keyword arguments
    or a sequence of positional ones) into a `Graph`.

    `loss_fn(output)` turns the model's output into the scalar loss; by default the output's
    `.loss` if it has one, else the mean of the output tensor. `device` is one spec or several
    (`"cpu"`, `"cpu:4"`, `"cuda"`): each becomes a device type with its own times. `precision`:
    fp32, or bf16 / fp16 mixed precision (`hetplan.precision`)."""
    from hetplan.zoo.models import TrainStep, output_loss

    if isinstance(example_inputs, Mapping):
        batch = dict(example_inputs)
        call = None
    else:
        batch = {f"arg{i}": x for i, x in enumerate(example_inputs)}
        call = [f"arg{i}" for i in range(len(batch))]

    def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        out = m(*(b[k] for k in call)) if call is not None else m(**b)
        return loss_fn(out) if loss_fn is not None else output_loss(out)

    devices = [device] if isinstance(device, str) else list(device)
    report = profile_step(TrainStep(model, loss), batch, name=name or type(model).__name__, devices=devices,
                          granularity=granularity, block_classes=block_classes, repeats=repeats, check=check,
                          precision=precision)
    return report.graph
