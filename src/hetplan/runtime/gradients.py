"""Summing the gradients of a stage's replicas (and of parameters several stages share).

Dense gradients go in one flat buffer per group of ranks and one all-reduce (gloo pays its
latency once, not once per tensor). An embedding table built with `sparse=True` has a sparse
gradient, the rows a replica's slice of the batch looked up; summing it densely would put the
whole table on the wire (26 tables of up to 1M rows in ctr-dnn: hundreds of MB per step for a
few thousand rows). So, as data-parallel CTR training exchanges rows rather than tables
(HeterPS; Horovod's and torch DDP's sparse all-reduce gather the indices and values), the
replicas of a group exchange only the rows:

1. an all-reduce of how many rows each replica has (each writes its own slot);
2. an all-reduce of their indices, each replica writing into its own span: after it every
   replica knows every replica's rows, and so their union;
3. the rows' values, each replica adding its own into the union's positions, ride with the dense
   gradients in the flat buffer of the group's one all-reduce.

Tables whose rows have one shape and dtype (ctr-dnn's 26) go through these steps as one: row `i`
of the k-th table is row `offset_k + i` of their concatenation. Done table by table, the torch
calls on the host (a coalesce, a `unique`, a `searchsorted`, an `index_add_` per table, each a
few tens of microseconds) took 2.8 ms of ctr-dnn's 6.2 ms exchange at batch 512 here, as much
as its three collectives.

The sum is the sparse gradient of the whole batch: the union of the rows, as one process
training on the whole batch would get, so SparseAdam updates the same rows. Which parameters are
tables is known from the model before any step (`sparse_parameter_ids`), the same on every rank,
so that a group without tables pays nothing more and a replica that looked up no row agrees.
`hetplan.cost.CostModel._gradient_sync_s` charges the same: the dense bytes and the rows, and
the two collectives more.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hetplan.runtime.transport import Transport


def sparse_parameter_ids(module: nn.Module) -> frozenset[int]:
    """The ids of the parameters whose gradients are sparse: the weights of embedding tables
    built with `sparse=True` (`nn.Embedding`, `nn.EmbeddingBag`)."""
    return frozenset(id(m.weight) for m in module.modules()
                     if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse)


def reduce_gradients(groups: Sequence[tuple[tuple[int, ...], Sequence[nn.Parameter]]], transport: Transport,
                     sparse_ids: Collection[int] = frozenset()) -> None:
    """Sum each group's gradients over its ranks (see the module's docstring); every rank calls
    its groups in the same global order (`rank.gradient_groups`). `sparse_ids`: the parameters
    whose gradients are sparse (`sparse_parameter_ids`); they end with a sparse gradient over the
    union of the replicas' rows, the others with the dense sum; each sum where `Transport.wire`
    says (the host, unless the group's ranks are all on GPUs and NCCL sums)."""
    for ranks, params in groups:
        if len(ranks) < 2 or not params:
            continue
        kinds = _kinds([prm for prm in params if id(prm) in sparse_ids])
        dense = [prm for prm in params if id(prm) not in sparse_ids]
        mine = [_rows_of(kind) for kind in kinds]
        unions = _union_of_rows([ids for ids, _, _ in mine], ranks, transport) if kinds else []
        for prm in dense:
            if prm.grad is None:
                prm.grad = torch.zeros_like(prm)
            elif prm.grad.is_sparse:  # sparse, though not a table built so (F.embedding(sparse=True))
                prm.grad = prm.grad.to_dense()
        # the dense gradients joined where they are, then moved where the sum runs (the host,
        # unless every rank of the group is on a GPU and NCCL sums: `Transport.wire`), then the
        # tables' rows (gathered on the host)
        wire = transport.wire(tuple(ranks))
        parts = [torch.cat([prm.grad.reshape(-1) for prm in dense]).to(wire)] if dense else []
        parts += [_spread(raw, vals, union, kind).to(wire)
                  for kind, (_, raw, vals), union in zip(kinds, mine, unions, strict=True)]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # one part: no second copy of it
        if flat.numel():
            transport.all_reduce(flat, tuple(ranks))
        offset = 0
        for prm in dense:
            prm.grad.copy_(flat[offset:offset + prm.numel()].view_as(prm))
            offset += prm.numel()
        for kind, union in zip(kinds, unions, strict=True):
            size = len(union) * kind.row_numel
            _give_back(kind, union, flat[offset:offset + size])
            offset += size


@dataclass(frozen=True, eq=False)
class _Kind:
    """Tables whose rows have one shape and dtype, numbered as one: row i of tables[k] is row
    offsets[k] + i (offsets[-1]: the rows of them all; `bounds`, the same as a tensor)."""

    tables: tuple[nn.Parameter, ...]
    offsets: tuple[int, ...]
    bounds: torch.Tensor

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.tables[0].shape[1:])

    @property
    def row_numel(self) -> int:
        return math.prod(self.row_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tables[0].dtype


def _kinds(tables: Sequence[nn.Parameter]) -> list[_Kind]:
    """The tables grouped by row shape and dtype, in their order (the same on every rank)."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for prm in tables:
        groups.setdefault((tuple(prm.shape[1:]), prm.dtype), []).append(prm)
    kinds = []
    for group in groups.values():
        offsets = tuple(itertools.accumulate((p.shape[0] for p in group), initial=0))
        kinds.append(_Kind(tuple(group), offsets, torch.tensor(offsets)))
    return kinds


def _rows_of(kind: _Kind) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This replica's rows of a kind's tables, on the CPU, in the kind's numbering: the sorted
    distinct rows, and every row of the gradients as they came (repeats too) with its values."""
    ids, vals = [], []
    for prm, offset in zip(kind.tables, kind.offsets[:-1], strict=True):
        g = prm.grad
        if g is None:
            continue
        if g.is_sparse:  # as backward made it, maybe with repeated rows: `_spread` sums them
            idx, val = g._indices()[0], g._values()
        else:  # a table whose gradient came out dense after all: its rows not all zero
            idx = torch.nonzero(g.reshape(g.shape[0], -1).abs().sum(dim=1)).flatten()
            val = g[idx]
        ids.append(idx.cpu() + offset)
        vals.append(val.cpu())
    if not ids:
        return (torch.zeros(0, dtype=torch.int64),) * 2 + (torch.zeros((0, *kind.row_shape), dtype=kind.dtype),)
    raw = torch.cat(ids)
    return torch.unique(raw), raw, torch.cat(vals).to(kind.dtype)


def _union_of_rows(ids: Sequence[torch.Tensor], ranks: Sequence[int], transport: Transport) -> list[torch.Tensor]:
    """Per kind, the sorted union of the rows every rank of the group has (steps 1 and 2)."""
    me, r = list(ranks).index(transport.rank), len(ranks)
    counts = torch.zeros(len(ids) * r, dtype=torch.int64)
    for k, rows in enumerate(ids):
        counts[k * r + me] = rows.numel()
    transport.all_reduce(counts, tuple(ranks))
    per = counts.view(len(ids), r)
    everyone = torch.zeros(int(per.sum()), dtype=torch.int64)
    starts = torch.cumsum(per.reshape(-1), 0) - per.reshape(-1)  # each (kind, rank)'s span
    for k, rows in enumerate(ids):
        at = int(starts[k * r + me])
        everyone[at:at + rows.numel()] = rows
    if everyone.numel():  # every rank knows the counts: all skip alike
        transport.all_reduce(everyone, tuple(ranks))
    ends = starts.view(len(ids), r)[:, 0] + per.sum(dim=1)
    return [torch.unique(everyone[int(starts[k * r]):int(ends[k])]) for k in range(len(ids))]


def _spread(raw: torch.Tensor, values: torch.Tensor, union: torch.Tensor, kind: _Kind) -> torch.Tensor:
    """This replica's rows added at their positions in the union (a repeated row summed), zeros
    elsewhere, flat."""
    out = torch.zeros((len(union), *kind.row_shape), dtype=kind.dtype)
    out.index_add_(0, torch.searchsorted(union, raw), values)
    return out.reshape(-1)


def _give_back(kind: _Kind, union: torch.Tensor, flat: torch.Tensor) -> None:
    """Each table of the kind gets its summed rows as a sparse gradient on its device, or None
    when no replica looked any of them up."""
    values = flat.view((len(union), *kind.row_shape))
    cuts = torch.searchsorted(union, kind.bounds).tolist()
    for prm, offset, a, b in zip(kind.tables, kind.offsets[:-1], cuts[:-1], cuts[1:], strict=True):
        if a == b:
            prm.grad = None
            continue
        # torch.unique's indices are sorted, distinct and in range: coalesced, nothing to check
        prm.grad = torch.sparse_coo_tensor((union[a:b] - offset).unsqueeze(0).to(prm.device),
                                           values[a:b].to(prm.device, prm.dtype), prm.shape,
                                           check_invariants=False, is_coalesced=True)
