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


def is_weight_copy(t: torch.Tensor, params: Collection[int]) -> bool:
    """Whether a tensor saved for the backward is (a view of) autocast's copy of one of the
    parameters whose `id`s are `params`: its autograd history is views of a dtype cast of it."""
    fn = t.grad_fn
    for _ in range(8):  # views (transpose, reshape) between the cast and the saved tensor
        if fn is None:
            return False
        if fn.name().startswith("ToCopyBackward"):
            source = fn.next_functions[0][0] if fn.next_functions else None
            return source is not None and id(getattr(source, "variable", None)) in params
        if len(fn.next_functions) != 1:
            return False
        fn = fn.next_functions[0][0]
    return False

