"""Summing the gradients of a stage's replicas (and of parameters several stages share).

Dense gradients go in one flat buffer per group of ranks and one all-reduce (gloo pays its
latency once, not once per tensor). An embedding table built with `sparse=True` has a sparse
gradient, the rows a replica's slice of the batch looked up; summing it densely would put the
whole table on the wire (26 tables of up to 1M rows in ctr-dnn: hundreds of MB per step for a
few thousand rows). So, as data-parallel CTR training exchanges rows rather than tables
(HeterPS; Horovod's and torch DDP's sparse all-reduce gather the indices and values), the
replicas of a group exchange only the rows:

1. an all-reduce of how many rows each replica has, per table (each writes its own slot);
2. an all-reduce of their indices, each replica writing into its own span: after it every
   replica knows every replica's rows, and so their union;
3. the rows' values, each replica adding its own into the union's positions, ride with the dense
   gradients in the flat buffer of the group's one all-reduce.

The sum is the sparse gradient of the whole batch: the union of the rows, as one process
training on the whole batch would get, so SparseAdam updates the same rows. Which parameters are
tables is known from the model before any step (`sparse_parameter_ids`), the same on every rank,
so that a group without tables pays nothing more and a replica that looked up no row agrees.
`hetplan.cost.CostModel.gradient_sync_s` charges the same: the dense bytes and the rows, and
the two collectives more.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

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
    union of the replicas' rows, the others with the dense sum. GPU gradients go through the CPU."""
    for ranks, params in groups:
        if len(ranks) < 2 or not params:
            continue
        tables = [prm for prm in params if id(prm) in sparse_ids]
        dense = [prm for prm in params if id(prm) not in sparse_ids]
        mine = [_rows_of(prm) for prm in tables]
        unions = _union_of_rows([idx for idx, _ in mine], ranks, transport) if tables else []
        for prm in dense:
            if prm.grad is None:
                prm.grad = torch.zeros_like(prm)
            elif prm.grad.is_sparse:  # sparse, though not a table built so (F.embedding(sparse=True))
                prm.grad = prm.grad.to_dense()
        # the dense gradients joined where they are (one copy off a GPU), then the tables' rows
        joined = [torch.cat([prm.grad.reshape(-1) for prm in dense]).cpu()] if dense else []
        flat = torch.cat([*joined, *(_spread(vals, idx, union, prm) for prm, (idx, vals), union
                                     in zip(tables, mine, unions, strict=True))])
        if flat.numel():
            transport.all_reduce(flat, tuple(ranks))
        offset = 0
        for prm in dense:
            prm.grad.copy_(flat[offset:offset + prm.numel()].view_as(prm))
            offset += prm.numel()
        for prm, union in zip(tables, unions, strict=True):
            size = len(union) * math.prod(prm.shape[1:])
            prm.grad = _sparse(union, flat[offset:offset + size], prm) if len(union) else None
            offset += size


def _rows_of(prm: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's rows of a table's gradient, on the CPU: sorted distinct indices and their values."""
    g = prm.grad
    if g is None:
        return torch.zeros(0, dtype=torch.int64), torch.zeros((0, *prm.shape[1:]), dtype=prm.dtype)
    if not g.is_sparse:  # a table whose gradient came out dense after all: its rows not all zero
        rows = torch.nonzero(g.reshape(g.shape[0], -1).abs().sum(dim=1)).flatten()
        return rows.cpu(), g[rows].cpu()
    g = g.coalesce()
    return g.indices()[0].cpu(), g.values().cpu()


def _union_of_rows(indices: Sequence[torch.Tensor], ranks: Sequence[int], transport: Transport
                   ) -> list[torch.Tensor]:
    """Per table, the sorted union of the rows every rank of the group has (steps 1 and 2)."""
    me, r = list(ranks).index(transport.rank), len(ranks)
    counts = torch.zeros(len(indices) * r, dtype=torch.int64)
    for t, idx in enumerate(indices):
        counts[t * r + me] = idx.numel()
    transport.all_reduce(counts, tuple(ranks))
    per = counts.view(len(indices), r)
    everyone = torch.zeros(int(per.sum()), dtype=torch.int64)
    starts = torch.cumsum(per.reshape(-1), 0) - per.reshape(-1)  # each (table, rank)'s span
    for t, idx in enumerate(indices):
        at = int(starts[t * r + me])
        everyone[at:at + idx.numel()] = idx
    if everyone.numel():  # every rank knows the counts: all skip alike
        transport.all_reduce(everyone, tuple(ranks))
    ends = starts.view(len(indices), r)[:, 0] + per.sum(dim=1)
    return [torch.unique(everyone[int(starts[t * r]):int(ends[t])]) for t in range(len(indices))]


def _spread(values: torch.Tensor, idx: torch.Tensor, union: torch.Tensor, prm: nn.Parameter) -> torch.Tensor:
    """This replica's rows placed at their positions in the union, zeros elsewhere, flat."""
    out = torch.zeros((len(union), *prm.shape[1:]), dtype=prm.dtype)
    out.index_add_(0, torch.searchsorted(union, idx), values)
    return out.reshape(-1)


def _sparse(union: torch.Tensor, flat: torch.Tensor, prm: nn.Parameter) -> torch.Tensor:
    """The summed rows as a table's sparse gradient, on the table's device."""
    values = flat.view((len(union), *prm.shape[1:])).to(prm.device, prm.dtype)
    # the indices are torch.unique's, sorted, distinct and in range: coalesced, nothing to check
    return torch.sparse_coo_tensor(union.unsqueeze(0).to(prm.device), values, prm.shape,
                                   check_invariants=False, is_coalesced=True)
