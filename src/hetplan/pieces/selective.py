"""Selective activation recomputation: a checkpoint around a piece that keeps the outputs of its
products (matrix products, convolutions, attention) and rebuilds the rest in the backward (norms,
activation functions, dropout, element-wise work: large to keep, cheap to run again).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023),
rebuild only the parts of a layer that take much memory and little time; this is the policy
torch's selective checkpoint runs (`torch.utils.checkpoint.create_selective_checkpoint_contexts`:
a policy per operator, here "save" for products, "prefer recompute" for everything else). The
runtime checkpoints each piece of a stage under it (`Stage.recompute` "selective"); the profiler
measures, per piece, the bytes it keeps and the share of its forward the backward runs again
(`measure`), which the cost model reads (`Node.selective_keep_bytes`, `selective_rebuild_share`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# aten operators whose outputs the policy keeps; names a torch version lacks are skipped
_PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


@functools.cache
def _saved_ops() -> frozenset:
    return frozenset(getattr(torch.ops.aten, name) for name in _PRODUCTS if hasattr(torch.ops.aten, name))


def keeps(func: Any) -> bool:
    """Whether the policy keeps this aten operator's outputs (an `OpOverload`)."""
    return getattr(func, "overloadpacket", None) in _saved_ops()


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if keeps(func) else CheckpointPolicy.PREFER_RECOMPUTE


def contexts() -> tuple:
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` for selective recomputation."""
    return create_selective_checkpoint_contexts(_policy)


class _Counter(TorchDispatchMode):
    """Per forward: the bytes of the kept operators' outputs (each storage once, weights not
    counted) and the seconds spent in kept and in other operators."""

    def __init__(self, skip: Callable[[int], bool], sync: Callable[[], None]):
        super().__init__()
        self.skip, self.sync = skip, sync
        self.kept: dict[int, torch.Tensor] = {}  # held, as the checkpoint holds them: no address reused
        self.kept_s = self.other_s = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sync()
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.sync()
        seconds = time.perf_counter() - start
        if keeps(func):
            self.kept_s += seconds
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not self.skip(t.untyped_storage().data_ptr()):
                    self.kept[t.untyped_storage().data_ptr()] = t
        else:
            self.other_s += seconds
        return out


@dataclass(frozen=True)
class Figures:
    """What selective recomputation keeps of a piece per batch besides its inputs (its products'
    outputs), what its backward builds again (what autograd saves, less what is kept), and the
    share of its forward's time that rebuilding runs."""

    keep_bytes: int
    rebuilt_bytes: int
    rebuild_share: float


def measure(run: Callable[[], Any], skip: Callable[[int], bool], device: torch.device, repeats: int = 3) -> Figures:
    """`Figures` of a piece from `run`, its forward: the bytes from one run (each storage once,
    not those `skip` says, by address: the weights and their 16-bit copies), the share from the fastest of `repeats`
    runs after one to warm up (every operator timed alone, the device synchronised around each: a
    share, not a time to add up)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    runs, saved = [], {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not skip(t.untyped_storage().data_ptr()):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for k in range(repeats + 1):
        counter = _Counter(skip, sync)
        with counter, torch.autograd.graph.saved_tensors_hooks(pack if k == 0 else (lambda t: t), lambda t: t):
            run()
        runs.append(counter)
    kept = runs[0].kept
    keep = sum(t.untyped_storage().nbytes() for t in kept.values())
    both = sum(n for ptr, n in saved.items() if ptr in kept)
    fastest = min(runs[1:], key=lambda c: c.kept_s + c.other_s)
    total = fastest.kept_s + fastest.other_s
    return Figures(keep, sum(saved.values()) - both, fastest.other_s / total if total > 0 else 1.0)
