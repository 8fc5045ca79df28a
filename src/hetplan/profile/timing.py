"""Timing the pieces of a training step, run in sequence as the step runs them.

Every repeat runs the forward pass of all pieces in their topological order and then the
backward pass in the reverse order, with a timestamp before and after each piece: on the CPU
`perf_counter`; on CUDA an event recorded on the stream, and one synchronisation at the end of
the repeat, so the CPU runs ahead and queues kernels as in a real step (a synchronisation per
piece made the GPU wait for every launch and overstated small pieces 1.3-3.3x on an H100).

Each piece receives the values it reads from other pieces as a pipeline stage does: detached,
asking for their gradient when they had one, and copied only where the piece changes them in
place (autograd forbids that on a leaf); the copy is made outside the timestamps. The backward
of a piece is `torch.autograd.backward` of its outputs with the gradients its consumers sent;
the gradients of its inputs go to their producers, summed over consumers (a residual stream
read by two pieces gets the sum of both). So every piece computes exactly the gradients of the
unsplit step (tests/test_profile.py checks it), with its own cache and allocator state as in
the step, rather than timed alone, repeat after repeat, with its weights and inputs hot.

Before the timed repeats, one untimed warm-up repeat; `warm_pass` also counts each piece's
forward FLOPs (torch's `FlopCounterMode`) and the bytes its backward keeps alive
(`saved_tensors_hooks`; storages of parameters are not counted, each storage is counted once);
`selective_pass` what selective recomputation keeps of a piece and builds again, and
`rerun_forwards` what recomputing it per block or selectively adds to its time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from hetplan.pieces import selective, split_acts
from hetplan.pieces.mixed import Mixed, WeightCasts
from hetplan.pieces.split import Piece, SplitStep, changed_in_place, checkpointable
from hetplan.precision import FP32


def _leaves(inputs: Sequence[Any], data: Sequence[bool]) -> list[Any]:
    """Copies of the floating inputs that require grad, for `warm_pass`: clones of a leaf
    rather than leaves, because a piece may change its input in place (ReLU(inplace=True)),
    which autograd forbids on a leaf. The batch's own values (`data`) stay as they are: they
    never need a gradient, and some models set `requires_grad` on views of them."""
    out = []
    for x, is_data in zip(inputs, data, strict=True):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not is_data:
            out.append(x.detach().requires_grad_(True).clone())
        else:
            out.append(x)
    return out


def _differentiable(outs: Sequence[Any]) -> list[torch.Tensor]:
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad and o.grad_fn is not None]


def _clear_grads(piece: Piece) -> None:
    # Training zeroes gradients with set_to_none each step, so every backward writes fresh ones.
    for p in piece.module.parameters():
        p.grad = None


@dataclass(frozen=True)
class Warm:
    """What `warm_pass` counts: forward FLOPs, the bytes saved for the backward, and of those
    apart, the 16-bit copies of the weights (mixed precision), which a step keeps once."""

    flops: float
    act_bytes: int
    cast_bytes: int


def warm_pass(piece: Piece, inputs: Sequence[Any], data: Collection[str] = (), mixed: Mixed | None = None) -> Warm:
    """One untimed forward and backward, in `mixed`'s precision (fp32 without). `data`: the
    names of the batch's values (`SplitStep.input_names`)."""
    mixed = mixed or Mixed(FP32, "cpu")
    weights = list(piece.module.parameters())
    params = {p.untyped_storage().data_ptr() for p in weights}
    casts = WeightCasts(weights)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in casts.storages:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    _clear_grads(piece)
    leaves = _leaves(inputs, [n in data for n in piece.inputs])
    with mixed.step():
        with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                mixed.forward(), casts:
            outs = piece.module(*leaves)
        diff = _differentiable(outs)
        if diff:
            torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
    return Warm(float(counter.get_total_flops()), sum(saved.values()), sum(casts.bytes.values()))


def selective_pass(piece: Piece, inputs: Sequence[Any], data: Collection[str] = (), mixed: Mixed | None = None,
                   device: str = "cpu") -> selective.Figures:
    """What selective recomputation keeps of the piece and builds again
    (`hetplan.pieces.selective.measure`), from a forward in `mixed`'s precision as `warm_pass`
    runs it."""
    mixed = mixed or Mixed(FP32, "cpu")
    weights = list(piece.module.parameters())
    params = {p.untyped_storage().data_ptr() for p in weights}
    casts = WeightCasts(weights)
    leaves = _leaves(inputs, [n in data for n in piece.inputs])

    def run() -> None:
        with mixed.step(), mixed.forward(), casts:
            piece.module(*leaves)

    return selective.measure(run, lambda ptr: ptr in params or ptr in casts.storages)


def split_acts_pass(piece: Piece, inputs: Sequence[Any], kinds: Mapping[int, str], data: Collection[str] = (),
                    mixed: Mixed | None = None) -> split_acts.Shares:
    """What a tensor-parallel group splits of the piece's saved activations
    (`hetplan.pieces.split_acts.measure`), from a forward in `mixed`'s precision as `warm_pass`
    runs it; `kinds`: each parameter's split kind by its storage's address."""
    mixed = mixed or Mixed(FP32, "cpu")
    leaves = _leaves(inputs, [n in data for n in piece.inputs])

    def run() -> None:
        with mixed.step(), mixed.forward():
            piece.module(*leaves)

    return split_acts.measure(run, kinds)


def rerun_forwards(piece: Piece, inputs: Sequence[Any], data: Collection[str] = (), mixed: Mixed | None = None,
                   device: str = "cpu", repeats: int = 5) -> dict[str, float]:
    """Per unit checkpointed per node ("block", "selective"), what recomputing the piece that way
    adds to its forward and backward, in forwards of the piece (`Node.rerun_forwards`): the
    fastest of `repeats` runs of each way after one to warm up, the piece alone, its inputs hot."""
    mixed = mixed or Mixed(FP32, "cpu")
    clock = Clock(device)
    leaves = _leaves(inputs, [n in data for n in piece.inputs])
    safe = checkpointable(piece)  # as the runtime checkpoints it (`StageModule.run`)
    # an input the piece changes in place is given afresh to every call (in every way alike): a
    # change made in place on the same tensor would chain each call's graph to the last's
    changed = changed_in_place(piece)
    fresh = [n in changed and isinstance(x, torch.Tensor) for n, x in zip(piece.inputs, leaves, strict=True)]
    ways = {"none": piece.module,
            "block": lambda *xs: checkpoint(safe, *xs, use_reentrant=False),
            "selective": lambda *xs: checkpoint(safe, *xs, use_reentrant=False, context_fn=selective.contexts)}

    def timed(run: Callable[..., Any], backward: bool) -> float:
        best = math.inf
        for k in range(repeats + 1):
            _clear_grads(piece)
            with mixed.step():
                start = clock.stamp()
                with mixed.forward():
                    outs = run(*[x.clone() if copy else x for x, copy in zip(leaves, fresh, strict=True)])
                diff = _differentiable(outs if isinstance(outs, tuple) else (outs,))
                if backward and diff:
                    torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
                end = clock.stamp()
            clock.finish()
            best = min(best, clock.seconds(start, end)) if k else best
        return best

    forward = timed(piece.module, False)
    plain = timed(ways["none"], True)
    return {unit: max(0.0, timed(ways[unit], True) - plain) / forward if forward > 0 else 1.0
            for unit in ("block", "selective")}


@dataclass(frozen=True)
class Timing:
    """Forward and backward seconds: the median over the repeats (what the graph stores) and
    the fastest repeat (interference from other work only ever adds time, so the fastest is the
    steadiest estimate on a shared machine)."""

    fwd_s: float
    bwd_s: float
    fwd_min_s: float
    bwd_min_s: float


class Clock:
    """Timestamps on one device: `perf_counter` on the CPU, CUDA events recorded on the current
    stream on CUDA (no synchronisation: `finish` waits once, when all are recorded)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, start: Any, end: Any) -> float:
        """Between two stamps; on CUDA only after `finish`."""
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclass
class Pass:
    """One training step run piece by piece: the stamps around each piece's forward and backward."""

    fwd: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    bwd: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    called: set[str] = field(default_factory=set)  # the pieces whose backward ran (had a gradient to take)


def _received(piece: Piece, env: Mapping[str, Any], mutated: set[str]) -> tuple[list[Any], list[tuple[str, Any]]]:
    """The piece's arguments as a pipeline stage receives them (see the module docstring), and
    the leaves that will hold the gradients of the inputs that ask for one."""
    args, leaves = [], []
    for name in piece.inputs:
        x = env[name]
        if isinstance(x, torch.Tensor) and x.requires_grad:
            leaf = x.detach().requires_grad_(True)
            leaves.append((name, leaf))
            x = leaf.clone() if name in mutated else leaf
        args.append(x)
    return args, leaves


def _to_send(piece: Piece, env: dict[str, Any], grads: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The piece's outputs that carry a gradient back, and their gradients. Both leave `env` and
    `grads`, as autograd frees the gradients and the graph of a step as it goes: held to the end
    of the pass, they made every piece after slower (inception-tiny's backward by 70%)."""
    outs, sent = [], []
    for name in piece.outputs:
        value, grad = env.pop(name), grads.pop(name, None)
        if grad is not None and isinstance(value, torch.Tensor) and value.requires_grad:
            outs.append(value)
            sent.append(grad)
    return outs, sent


def run_in_sequence(split: SplitStep, batch: Mapping[str, Any], clock: Clock,
                    mutated: Mapping[str, set[str]] | None = None, mixed: Mixed | None = None) -> Pass:
    """Forward and backward of every piece in turn, a stamp before and after each; leaves each
    parameter's gradient in `.grad` as the unsplit step's `loss.backward()` would. `mutated`:
    per piece, the inputs it changes in place (`changed_in_place`; found here if not given).
    `mixed`: the precision the passes run in, as a step (`hetplan.pieces.mixed`; fp32 without)."""
    with (mixed or Mixed(FP32, "cpu")).step():
        return _in_sequence(split, batch, clock, mutated, mixed or Mixed(FP32, "cpu"))


def _in_sequence(split: SplitStep, batch: Mapping[str, Any], clock: Clock, mutated: Mapping[str, set[str]] | None,
                 mixed: Mixed) -> Pass:
    if mutated is None:
        mutated = {p.name: changed_in_place(p) for p in split.pieces}
    env: dict[str, Any] = {name: batch[key] for key, name in zip(split.input_keys, split.input_names, strict=True)}
    leaves: dict[str, list[tuple[str, Any]]] = {}
    out = Pass()
    for piece in split.pieces:
        args, leaves[piece.name] = _received(piece, env, mutated[piece.name])
        start = clock.stamp()
        with mixed.forward():
            results = piece.module(*args)
        out.fwd[piece.name] = (start, clock.stamp())
        env.update(zip(piece.outputs, results, strict=True))
    grads: dict[str, Any] = {split.loss: torch.ones_like(env[split.loss])}
    for piece in reversed(split.pieces):
        outs, sent = _to_send(piece, env, grads)
        start = clock.stamp()
        if outs:
            torch.autograd.backward(outs, sent)
            out.called.add(piece.name)
        out.bwd[piece.name] = (start, clock.stamp())
        del outs, sent
        for name, leaf in leaves.pop(piece.name):
            if leaf.grad is not None:
                grads[name] = grads[name] + leaf.grad if name in grads else leaf.grad
                leaf.grad = None
    return out


@dataclass(frozen=True)
class InSequence:
    """Per node the forward and backward time over the repeats; per repeat the sum of all
    nodes (`totals_s`) and, when asked for, the unsplit step's time run just before it
    (`whole_s`); `also`: the node times of each other split timed in the same repeats."""

    times: dict[str, Timing]
    totals_s: list[float]
    whole_s: list[float]
    also: tuple[dict[str, Timing], ...] = ()


class _Samples:
    """The per-node forward and backward times of one split over the repeats."""

    def __init__(self, split: SplitStep, batch: Mapping[str, Any], mixed: Mixed) -> None:
        self.split, self.batch, self.mixed = split, batch, mixed
        self.mutated = {p.name: changed_in_place(p) for p in split.pieces}
        self.params = _params(split)
        self.fwd: dict[str, list[float]] = {p.name: [] for p in split.pieces}
        self.bwd: dict[str, list[float]] = {p.name: [] for p in split.pieces}

    def run(self, clock: Clock) -> Pass:
        for p in self.params:
            p.grad = None
        stamps = run_in_sequence(self.split, self.batch, clock, self.mutated, self.mixed)
        clock.finish()  # the one synchronisation of the repeat
        return stamps

    def add(self, stamps: Pass, clock: Clock, overhead_s: float) -> float:
        """Keeps one repeat's times; returns their sum."""
        total = 0.0
        for name, (a, b) in stamps.fwd.items():
            self.fwd[name].append(clock.seconds(a, b))
            total += self.fwd[name][-1]
        for name, (a, b) in stamps.bwd.items():
            took = clock.seconds(a, b)
            self.bwd[name].append(max(0.0, took - overhead_s) if name in stamps.called else took)
            total += self.bwd[name][-1]
        return total

    def timings(self) -> dict[str, Timing]:
        return {n: Timing(statistics.median(self.fwd[n]), statistics.median(self.bwd[n]), min(self.fwd[n]),
                          min(self.bwd[n])) for n in self.fwd}


def _params(split: SplitStep) -> list[torch.nn.Parameter]:
    return list({id(p): p for piece in split.pieces for p in piece.module.parameters()}.values())


def time_whole(step: torch.nn.Module, batch: Mapping[str, Any], clock: Clock, mixed: Mixed | None = None) -> float:
    """One forward and backward of the unsplit step, with fresh gradients, in `mixed`'s precision."""
    mixed = mixed or Mixed(FP32, "cpu")
    for p in step.parameters():
        p.grad = None
    start = clock.stamp()
    with mixed.step():
        with mixed.forward():
            loss = step(**batch)
        loss.backward()
    end = clock.stamp()
    clock.finish()
    return clock.seconds(start, end)


def empty_backward_s(calls: int = 50) -> float:
    """The median CPU time of one call of `torch.autograd.backward` that does nothing (a copy of
    four numbers): what taking each piece's backward separately adds (~30-40 us here), which a
    step or a pipeline stage pays once, not once per node."""
    x = torch.zeros(4)
    times = []
    for _ in range(calls):
        y = x.detach().requires_grad_(True).clone()
        g = torch.ones_like(y)
        start = time.perf_counter()
        torch.autograd.backward([y], [g])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_in_sequence(split: SplitStep, batch: Mapping[str, Any], device: str, repeats: int,
                     whole: torch.nn.Module | None = None, progress: Callable[[float], None] | None = None,
                     also: Sequence[tuple[SplitStep, Mapping[str, Any]]] = (), precision: str = FP32) -> InSequence:
    """Times every piece in sequence (`run_in_sequence`) over `repeats` after one untimed
    warm-up. With `whole` (the unsplit step, sharing the pieces' parameters), each repeat first
    times a step of it: interleaved, the reference and the pieces see the same machine, which
    on a shared one drifts by 2x and more within a minute. `also`: other (split, batch) pairs
    (the step at a smaller batch, for the fixed parts) run in the same repeats, right after,
    so that a drift of the machine does not fall between the two sizes and into their line.
    `progress(share done)` is told before each repeat. Every pass runs in `precision`.

    On the CPU, the cost of an empty backward call (`empty_backward_s`) is taken off each
    piece's backward time. On CUDA the CPU's calls overlap the GPU's work, so nothing is."""
    clock = Clock(device)
    mixed = Mixed(precision, torch.device(device).type)
    overhead = 0.0 if clock.cuda else empty_backward_s()
    samples = [_Samples(split, batch, mixed), *(_Samples(s, b, mixed) for s, b in also)]
    totals, wholes = [], []
    for i in range(repeats + 1):
        if progress:
            progress(i / (repeats + 1))  # the share of the repeats done (the warm-up counts as one)
        if whole is not None:
            took = time_whole(whole, batch, clock, mixed)
            if i:
                wholes.append(took)
        stamps = [x.run(clock) for x in samples]
        if i:
            sums = [x.add(st, clock, overhead) for x, st in zip(samples, stamps, strict=True)]
            totals.append(sums[0])
    return InSequence(samples[0].timings(), totals, wholes, tuple(x.timings() for x in samples[1:]))


def fixed_parts(full: Mapping[str, Any], part: Mapping[str, Any], big: int,
                 small: int) -> dict[str, tuple[float, float]]:
    """Per node, the intercept of the line through (small, t_small) and (big, t_big) for the
    forward and the backward pass, kept between 0 and the smaller of the two times (timing noise
    can put it outside)."""
    out = {}
    for node, t_big in full.items():
        t_small = part.get(node)
        if t_small is None:
            continue
        pair = []
        for a, b in ((t_small.fwd_s, t_big.fwd_s), (t_small.bwd_s, t_big.bwd_s)):
            intercept = (a * big - b * small) / (big - small)
            pair.append(min(max(intercept, 0.0), a, b))
        out[node] = (pair[0], pair[1])
    return out


def small_part(batch: Mapping[str, Any], device: str, batch_size: int) -> tuple[int, dict] | None:
    """The batch's first eighth (at least two samples), on `device`, and its size; None when
    the batch is too small to shrink."""
    small = max(2, batch_size // 8)
    if small >= batch_size:
        return None
    return small, {k: (v[:small].to(device) if isinstance(v, torch.Tensor) and v.dim() > 0 else
                       v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def optimizer_times(split: SplitStep, device: str, repeats: int) -> dict[str, float]:
    """Per piece with parameters, the median time of the runtime's Adam step over them
    (`hetplan.pieces.optim.StageOptimizer`: SparseAdam for the sparse gradients), from the
    gradients the timed passes left: a step has a cost per tensor besides its bytes (SparseAdam
    on one 1M-row table's looked-up rows: 0.18 ms for 30 KB on this machine's CPU), which a
    formula of the bytes misses. It updates the profiler's own copy of the model."""
    from hetplan.pieces.optim import StageOptimizer

    clock, out = Clock(device), {}
    for piece in split.pieces:
        params = [p for p in piece.module.parameters() if p.grad is not None]
        if not params:
            continue
        opt = StageOptimizer(params, "adam", lr=1e-6)
        opt.step()  # makes the optimizers and their state: once per run, not per step
        stamps = []
        for _ in range(max(repeats, 1)):
            start = clock.stamp()
            opt.step()
            stamps.append((start, clock.stamp()))
        clock.finish()
        out[piece.name] = statistics.median(clock.seconds(a, b) for a, b in stamps)
    return out
