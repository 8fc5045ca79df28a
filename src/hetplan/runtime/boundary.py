"""The values that cross a stage boundary: what they look like for any number of rows, and how
they travel.

A stage's outputs (`StageSpec.outputs`) are activations, skip connections, labels, masks, token
ids, rotary tables... Replicas of neighbouring stages may slice a micro-batch differently
(`hetplan.rows`), so the runtime must know, for every value, which dimension follows the batch:

- a value with a batch dimension (`batch_dim`, `per_row` entries per sample: 1 for (B, S, H),
  S for labels flattened to (B*S,)) is cut by rows: a replica sends each replica of the next
  stage the rows their slices share;
- a value without one (a causal mask (1, 1, S, S), rotary tables (1, S, D), positions (1, S))
  is the same for every slice: a replica takes it whole from the replica that holds its first
  row, and sends its gradient back there.

`layouts` finds this by comparing the values of two example micro-batches of different sizes,
and takes from the first which values carry gradients. Integer and boolean values never do: they
travel forward only, and no receive buffer of theirs ever asks for a gradient (torch 2.11's
pipelining did, and failed on them).

A message is one flat byte buffer per peer, micro-batch and direction (`pack` / `unpack`): one
send whatever the number of values, any dtype, any memory layout (views are copied in), and on a
GPU one device-to-host copy per message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hetplan.errors import HetplanError

_ALIGN = 16  # bytes: every value starts aligned, so that a byte slice can be viewed as any dtype


@dataclass(frozen=True)
class ValueLayout:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # at `rows` rows
    rows: int
    batch_dim: int | None  # None: the same for every slice of the batch
    per_row: int  # entries of batch_dim per row
    grad: bool  # carries a gradient back

    def shape_for(self, rows: int) -> tuple[int, ...]:
        if self.batch_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.batch_dim] = rows * self.per_row
        return tuple(shape)

    def take(self, value: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Rows [first, end) of a value of this layout (the whole value if it has no batch dim)."""
        if self.batch_dim is None:
            return value
        return value.narrow(self.batch_dim, first * self.per_row, (end - first) * self.per_row)

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Slices of consecutive rows, in order, as one value."""
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=self.batch_dim)


def _batch_dim(name: str, a: tuple[int, ...], rows_a: int, b: tuple[int, ...], rows_b: int) -> tuple[int | None, int]:
    if len(a) != len(b):
        raise HetplanError(f"value {name!r} has {len(a)} dimensions for {rows_a} rows and {len(b)} for {rows_b}: "
                           "the runtime can only pass values whose rank does not depend on the batch")
    differ = [d for d in range(len(a)) if a[d] != b[d]]
    if not differ:
        return None, 0
    d = differ[0]
    if len(differ) > 1 or a[d] % rows_a or b[d] % rows_b or a[d] // rows_a != b[d] // rows_b:
        raise HetplanError(f"value {name!r} has shape {a} for {rows_a} rows and {b} for {rows_b}: the runtime can "
                           "only pass values with one dimension proportional to the batch")
    return d, a[d] // rows_a


def layouts(names: Sequence[str], values_a: Sequence[torch.Tensor], rows_a: int,
            values_b: Sequence[torch.Tensor], rows_b: int) -> tuple[ValueLayout, ...]:
    """The layouts of a boundary's values from two examples of `rows_a` != `rows_b` rows (the
    first with its real gradient flags)."""
    if len(values_a) != len(values_b):
        raise HetplanError(f"the model passes {len(values_a)} values across a boundary at {rows_a} rows and "
                           f"{len(values_b)} at {rows_b}: it does not trace the same way at every batch size")
    out = []
    for name, a, b in zip(names, values_a, values_b, strict=True):
        if a.dtype != b.dtype:
            raise HetplanError(f"value {name!r} is {a.dtype} at {rows_a} rows and {b.dtype} at {rows_b}")
        if rows_a == rows_b:
            dim, per_row = (0, a.shape[0] // rows_a) if a.dim() and a.shape[0] % rows_a == 0 else (None, 0)
        else:
            dim, per_row = _batch_dim(name, tuple(a.shape), rows_a, tuple(b.shape), rows_b)
        grad = bool(a.requires_grad and a.is_floating_point())
        out.append(ValueLayout(name, a.dtype, tuple(a.shape), rows_a, dim, per_row, grad))
    return tuple(out)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def pack(values: Sequence[torch.Tensor], where: torch.device | str = "cpu") -> torch.Tensor:
    """The values' bytes in one buffer (uint8) on `where` (the transport's `wire`: the host, or
    the values' GPU where the message stays on GPUs), each aligned; at least one byte."""
    parts = []
    for v in values:
        flat = v.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = _padded(flat.numel()) - flat.numel()
        parts.append(flat)
        if pad:
            parts.append(flat.new_zeros(pad))
    if not parts:
        return torch.zeros(1, dtype=torch.uint8, device=where)
    return torch.cat(parts).to(where)


def packed_bytes(metas: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    total = sum(_padded(_numel(shape) * torch.empty((), dtype=dtype).element_size()) for dtype, shape in metas)
    return max(total, 1)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def unpack(buffer: torch.Tensor, metas: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """The values packed into `buffer` (on any device), given their dtypes and shapes; each value
    owns its memory (a copy), so that it can be a leaf of autograd or be changed in place."""
    out, at = [], 0
    for dtype, shape in metas:
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(buffer[at:at + nbytes].view(dtype).reshape(shape).clone())
        at += _padded(nbytes)
    return out
