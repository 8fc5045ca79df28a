"""Mixed precision as the profiler and the runtime run it: torch's autocast (what it costs, and
why it is laid out so: `hetplan.precision`).

A step runs inside one `Mixed.step()`, and each forward pass inside `Mixed.forward()`. autocast
keeps the 16-bit copy it makes of a weight until the outermost autocast context ends: with the
step's context outside (casting off), the copies are made at the first micro-batch's forward and
shared by every later one, rather than one copy per micro-batch in flight (each forward's own
context would drop its cache on exit, while the backward still holds the copy). Backward passes
run outside the casting context, as torch advises; they run in the dtypes their forwards chose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hetplan.precision import BF16, FP16, checked, is_mixed

DTYPES = {BF16: torch.bfloat16, FP16: torch.float16}


@dataclass(frozen=True)
class Mixed:
    """How to run passes in `precision` on devices of `device_type` ("cpu", "cuda")."""

    precision: str
    device_type: str

    def __post_init__(self) -> None:
        checked(self.precision)

    @property
    def on(self) -> bool:
        return is_mixed(self.precision)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around a whole step: the weights' 16-bit copies live until it ends (see the module)."""
        if not self.on:
            yield
            return
        with torch.autocast(self.device_type, dtype=DTYPES[self.precision], enabled=False):
            yield

    def forward(self) -> contextlib.AbstractContextManager:
        """Around a forward pass: products in 16 bits."""
        if not self.on:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=DTYPES[self.precision])


class WeightCasts(TorchDispatchMode):
    """While active, the copies autocast makes of `params` (dtype casts of their storage): what
    each costs (`bytes`, per parameter, once: the step's cache holds one) and the storages they
    live in (`storages`: a tensor saved for the backward there is one of them, not an activation).
    It sees every copy, saved for the backward or not (a first layer's weight, whose input needs
    no gradient, and the biases are cast and kept too)."""

    def __init__(self, params: Collection[torch.Tensor]) -> None:
        super().__init__()
        self._params = {p.untyped_storage().data_ptr(): i for i, p in enumerate(params)}
        self.bytes: dict[int, int] = {}
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            which = self._params.get(args[0].untyped_storage().data_ptr())
            if which is not None and isinstance(out, torch.Tensor):
                self.bytes[which] = out.nbytes
                self.storages.add(out.untyped_storage().data_ptr())
        return out

