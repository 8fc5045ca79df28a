"""Selective activation recomputation: a checkpoint around a piece that keeps the outputs of its
products (matrix products, convolutions, attention) and rebuilds the rest in the backward (norms,
activation functions, dropout, element-wise work: large to keep, cheap to run again).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023),
rebuild only the parts of a layer that take much memory and little time; this is the policy
torch's selective checkpoint runs (`torch.utils.checkpoint.create_selective_checkpoint_contexts`:
a policy per operator, here "save" for products, "prefer recompute" for everything else). The
runtime checkpoints each piece of a stage under it (`Stage.recompute` "selective"); the profiler
measures, per piece, the bytes it keeps and builds again (`measure`), and the time it adds
(`hetplan.profile.timing.rerun_forwards`), which the cost model reads (`Node.selective_keep_bytes`,
`Node.rerun_forwards`).
"""

from __future__ import annotations

import functools
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


class _Kept(TorchDispatchMode):
    """Per forward: the outputs of the operators the policy keeps (each storage once, not those
    `skip` says), held as the checkpoint holds them, so that no address is reused."""

    def __init__(self, skip: Callable[[int], bool]):
        super().__init__()
        self.skip = skip
        self.kept: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if keeps(func):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not self.skip(t.untyped_storage().data_ptr()):
                    self.kept[t.untyped_storage().data_ptr()] = t
        return out


@dataclass(frozen=True)
class Figures:
    """What selective recomputation keeps of a piece per batch besides its inputs (its products'
    outputs), and what its backward builds again (what autograd saves, less what is kept)."""

    keep_bytes: int
    rebuilt_bytes: int


def measure(run: Callable[[], Any], skip: Callable[[int], bool]) -> Figures:
    """`Figures` of a piece from one run of `run`, its forward: each storage once, not those
    `skip` says, by address (the weights and their 16-bit copies)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not skip(t.untyped_storage().data_ptr()):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with _Kept(skip) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    keep = sum(t.untyped_storage().nbytes() for t in counter.kept.values())
    both = sum(n for ptr, n in saved.items() if ptr in counter.kept)
    return Figures(keep, sum(saved.values()) - both)
