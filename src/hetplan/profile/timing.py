"""Timing one piece's forward and backward pass, on CPU and CUDA.

CPU: each repeat runs forward, then backward, timed with `perf_counter`; the result is the
median over repeats.

CUDA: timing every launch with a synchronisation makes small layers look slow, because the GPU
then waits for the CPU to launch each kernel, while in a whole training step the CPU runs ahead
and hides launch time behind the previous kernels. So the repeats are queued back to back
between two CUDA events, with no synchronisation in between, and the time is their mean: a
layer whose kernels take longer than their launch is timed by its kernels, a layer that is
launch-bound by its launch rate, as in a real step.

Before the timed repeats, one untimed pass warms the allocator and caches up; it also counts
the forward FLOPs (torch's `FlopCounterMode`) and the bytes the backward pass keeps alive
(`saved_tensors_hooks`; storages of parameters are not counted, each storage is counted once).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from hetplan.profile.split import Piece


def _leaves(inputs: Sequence[Any]) -> list[Any]:
    """Fresh copies of the floating inputs that require grad, so each repeat has its own
    autograd graph and the backward pass computes the gradients a pipeline stage sends
    upstream. They are clones of a leaf rather than leaves, because a piece may change its
    input in place (ReLU(inplace=True)), which autograd forbids on a leaf; the clone is made
    here, outside the timed region, and its backward is the identity."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
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


def warm_pass(piece: Piece, inputs: Sequence[Any]) -> tuple[float, int]:
    """One untimed forward and backward: returns forward FLOPs and bytes saved for backward."""
    params = {p.untyped_storage().data_ptr() for p in piece.module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    _clear_grads(piece)
    leaves = _leaves(inputs)
    with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = piece.module(*leaves)
    diff = _differentiable(outs)
    if diff:
        torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
    return float(counter.get_total_flops()), sum(saved.values())


@dataclass(frozen=True)
class Timing:
    """Forward and backward seconds: the median over the repeats (what the graph stores) and
    the fastest repeat (interference from other work only ever adds time, so the fastest is the
    steadiest estimate on a shared machine; `--check` compares fastest with fastest)."""

    fwd_s: float
    bwd_s: float
    fwd_min_s: float
    bwd_min_s: float


def time_cpu(piece: Piece, inputs: Sequence[Any], repeats: int) -> Timing:
    """Forward and backward time over `repeats`. (Evicting the last-level cache before each
    pass, to mimic a real step where other layers ran in between, changed the sums by less than
    this machine's run-to-run noise, so it is not done.)"""
    fwd: list[float] = []
    bwd: list[float] = []
    for _ in range(repeats):
        _clear_grads(piece)
        leaves = _leaves(inputs)
        t0 = time.perf_counter()
        outs = piece.module(*leaves)
        t1 = time.perf_counter()
        diff = _differentiable(outs)
        grads = [torch.ones_like(o) for o in diff]
        t2 = time.perf_counter()
        if diff:
            torch.autograd.backward(diff, grads)
        t3 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t3 - t2)
    return Timing(statistics.median(fwd), statistics.median(bwd), min(fwd), min(bwd))


def time_cuda(piece: Piece, inputs: Sequence[Any], repeats: int) -> Timing:
    leaves = [_leaves(inputs) for _ in range(repeats)]
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize()
    start.record()
    outs = [piece.module(*leaf) for leaf in leaves]
    mid.record()
    diffs = [_differentiable(o) for o in outs]
    grads = [[torch.ones_like(o) for o in d] for d in diffs]
    torch.cuda.synchronize()
    _clear_grads(piece)
    begin = torch.cuda.Event(enable_timing=True)
    begin.record()
    for d, g in zip(diffs, grads, strict=True):
        if d:
            torch.autograd.backward(d, g)
    end.record()
    torch.cuda.synchronize()
    fwd, bwd = start.elapsed_time(mid) / 1e3 / repeats, begin.elapsed_time(end) / 1e3 / repeats
    return Timing(fwd, bwd, fwd, bwd)  # one back-to-back batch: its mean is both
