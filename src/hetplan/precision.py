"""The arithmetic a step runs in: fp32, or 16-bit mixed precision (bf16, fp16).

Mixed precision as torch's automatic mixed precision does it (Micikevicius et al., "Mixed
Precision Training", ICLR 2018): the parameters, their gradients and Adam's moments stay fp32
(the master weights); the matrix products and convolutions run in 16 bits on 16-bit copies of
the weights, and most activations between layers are 16-bit. fp16's narrow range needs the loss
scaled up before the backward and the gradients scaled down before the step, with steps skipped
while the scale is too large (`hetplan.runtime.precision`); bf16 has fp32's range and needs none.

What each choice costs (`hetplan.cost`):
- memory: the fp32 state is what it is in fp32 (4 copies of the parameters' fp32 bytes); the
  16-bit copies of the weights a step's products use are made once per step and kept for it
  (`Node.cast_bytes`, counted by the profiler); activations are as measured in that precision;
- time: the profiler times the passes in that precision; a projection to a device type it was not
  timed on uses that type's peak FLOP rate for the precision (`DeviceType.peak_flops_in`);
- messages between stages: the bytes of the values as they are in that precision (profiled);
- gradient sums and the optimizer step: fp32, as in fp32.

The core reads only the names here; `hetplan.runtime.precision` turns them into torch's dtypes.
"""

from __future__ import annotations

from hetplan.errors import HetplanError

FP32, BF16, FP16 = "fp32", "bf16", "fp16"
PRECISIONS = (FP32, BF16, FP16)


def checked(precision: str) -> str:
    """`precision`, if hetplan knows it; a one-line error otherwise."""
    if precision not in PRECISIONS:
        raise HetplanError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return precision


def is_mixed(precision: str) -> bool:
    """Whether the step runs its products in 16 bits on fp32 master weights."""
    return checked(precision) != FP32


def scales_loss(precision: str) -> bool:
    """Whether the loss is scaled to keep small gradients representable (fp16's narrow range)."""
    return checked(precision) == FP16
