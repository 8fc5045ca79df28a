"""Optimizer-state sharding among a stage's replicas (ZeRO stage 1: Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC 2020).

The stage's parameters (those its own gradient sum covers: not a tied parameter that other
stages use, which is summed with them) are laid end to end in one flat buffer, each parameter a
view of its part, so that updating the buffer updates the model. The buffer is cut into r
shares, one per replica, of equal size (within one element): replica p's optimizer holds Adam's
state for share p only, an r-th of it. Each step:

1. reduce-scatter: the gradients, laid out as the buffer, summed over the replicas so that
   replica p ends with the sum of share p;
2. replica p's optimizer steps share p (its views: the model's parameters);
3. all-gather: every replica's updated share to every other.

Among GPU workers under NCCL (`Transport.collectives`) both are NCCL's own collectives
(reduce-scatter, all-gather) on the GPUs, each share padded to the largest as they need. Where
gloo carries them (any CPU worker among the replicas) both are rings over the transport's
point-to-point messages on the host, r - 1 steps of a share each: gloo's own reduce-scatter is an
all-reduce of everything (its implementation), twice the bytes. Either way, together what a
ring all-reduce moves, in as many steps, which is what the cost model charges
(`hetplan.cost.formulas`).

Shares are equal, not in proportion to the replicas' speeds: each ring step waits for its
largest share, so equal shares make the rings the shortest, and the optimizer's step, which a
share changes, is a small part of a step. Tables with sparse gradients are not sharded (their
rows are not split into shares; `hetplan.plan` refuses such a plan).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.runtime.transport import Transport

RING_TAG = 1 << 28  # above the pipeline messages' two channels (`hetplan.lowering.ACTIVATIONS`, `GRADIENTS`)
GROUP_TAGS = 1 << 12  # tags per group: 2 rings of at most 2048 steps


def share_bounds(numel: int, shares: int) -> list[tuple[int, int]]:
    """[lo, hi) of each share of `numel` elements: equal, the first `numel % shares` one more."""
    base, extra = divmod(numel, shares)
    out, lo = [], 0
    for p in range(shares):
        hi = lo + base + (1 if p < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def lay_flat(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """One buffer holding `params` end to end, each parameter made a view of its part of it."""
    if len({p.dtype for p in params}) != 1 or len({p.device for p in params}) != 1:
        raise HetplanError("a stage shards over parameters of one dtype and device; give its replicas unsharded "
                           "stages (shard: 0)")
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    at = 0
    with torch.no_grad():
        for p in params:
            flat[at:at + p.numel()].copy_(p.reshape(-1))
            p.data = flat[at:at + p.numel()].view_as(p)
            at += p.numel()
    return flat


def summed_share(grads: torch.Tensor, bounds: Sequence[tuple[int, int]], ranks: Sequence[int], me: int,
                 transport: Transport, tag: int) -> torch.Tensor:
    """Share `me` of `grads` (laid out in shares `bounds`) summed over `ranks`: by the backend's
    reduce-scatter where it has one (`Transport.collectives`), on the device it leaves the share
    on, else by a ring on the host (`tag`: its messages'); a tensor that is the caller's to keep
    or copy, on either device."""
    group = tuple(ranks)
    lo, hi = bounds[me]
    if transport.collectives(group):
        width = max(b - a for a, b in bounds)
        padded = torch.zeros(len(bounds), width, dtype=grads.dtype, device=grads.device)
        for k, (a, b) in enumerate(bounds):
            padded[k, :b - a] = grads[a:b]
        out = torch.empty(width, dtype=grads.dtype, device=grads.device)
        transport.reduce_scatter(out, padded.reshape(-1), group)
        return out[:hi - lo]
    host = grads.cpu()
    ring_reduce_scatter(host, bounds, ranks, me, transport, tag)
    return host[lo:hi]


def gather_shares(flat: torch.Tensor, bounds: Sequence[tuple[int, int]], ranks: Sequence[int], me: int,
                  transport: Transport, tag: int) -> None:
    """Every rank's share of `flat` (laid out in shares `bounds`) into every rank's `flat`: by the
    backend's all-gather where it has one (`Transport.collectives`), else by a ring on the host."""
    group = tuple(ranks)
    with torch.no_grad():
        if transport.collectives(group):
            width = max(b - a for a, b in bounds)
            lo, hi = bounds[me]
            mine = torch.zeros(width, dtype=flat.dtype, device=flat.device)
            mine[:hi - lo] = flat[lo:hi]
            out = torch.empty(len(bounds), width, dtype=flat.dtype, device=flat.device)
            transport.all_gather(out.reshape(-1), mine, group)
            for k, (a, b) in enumerate(bounds):
                flat[a:b] = out[k, :b - a]
            return
        on_host = flat.device.type == "cpu"
        host = flat.detach() if on_host else flat.detach().cpu()
        ring_all_gather(host, bounds, ranks, me, transport, tag)
        if not on_host:
            flat.copy_(host)


def ring_reduce_scatter(flat: torch.Tensor, bounds: Sequence[tuple[int, int]], ranks: Sequence[int], me: int,
                        transport: Transport, tag: int) -> None:
    """Sum `flat` (a CPU tensor, laid out in shares `bounds`) over `ranks` in a ring: afterwards
    share `me` of this rank's `flat` is the sum of everyone's (the others hold partial sums)."""
    r = len(ranks)
    nxt, prev = ranks[(me + 1) % r], ranks[(me - 1) % r]
    for s in range(r - 1):
        lo, hi = bounds[(me - s - 1) % r]
        sent = transport.isend(flat[lo:hi].clone(), nxt, tag + s)
        lo, hi = bounds[(me - s - 2) % r]
        got = torch.empty(hi - lo, dtype=flat.dtype)
        transport.recv(got, prev, tag + s)
        flat[lo:hi] += got
        sent.wait()


def ring_all_gather(flat: torch.Tensor, bounds: Sequence[tuple[int, int]], ranks: Sequence[int], me: int,
                    transport: Transport, tag: int) -> None:
    """Every rank's share `p` of `flat` (a CPU tensor) to every other, in a ring."""
    r = len(ranks)
    nxt, prev = ranks[(me + 1) % r], ranks[(me - 1) % r]
    for s in range(r - 1):
        lo, hi = bounds[(me - s) % r]
        sent = transport.isend(flat[lo:hi].clone(), nxt, tag + s)
        lo, hi = bounds[(me - s - 1) % r]
        got = torch.empty(hi - lo, dtype=flat.dtype)
        transport.recv(got, prev, tag + s)
        flat[lo:hi] = got
        sent.wait()


class ShardedParameters:
    """One group's parameters laid end to end (see the module), replica `me` of `ranks` holding
    share `me`: `shard` is the parameter its optimizer steps; `exchange` runs a step's rings
    around it; `index` numbers the group among the worker's, for message tags."""

    def __init__(self, params: Sequence[nn.Parameter], ranks: Sequence[int], me: int, index: int = 0) -> None:
        self.params, self.ranks, self.me = list(params), tuple(ranks), me
        self.tag = RING_TAG + index * GROUP_TAGS
        self.flat = lay_flat(self.params)
        self.bounds = share_bounds(self.flat.numel(), len(self.ranks))
        lo, hi = self.bounds[me]
        self.shard = nn.Parameter(self.flat[lo:hi])  # shares the buffer's storage

    def reduce(self, transport: Transport) -> None:
        """The step's gradients summed into this replica's share (`shard.grad`); the parameters'
        own gradients are dropped (the optimizer steps the share), and only the share is kept."""
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        for p in self.params:
            p.grad = None
        share = summed_share(grads, self.bounds, self.ranks, self.me, transport, self.tag)
        self.shard.grad = share.to(self.flat.device, copy=True)

    def gather(self, transport: Transport) -> None:
        """The updated shares from every replica into this one's buffer (the model's weights)."""
        gather_shares(self.flat.detach(), self.bounds, self.ranks, self.me, transport, self.tag + GROUP_TAGS // 2)
