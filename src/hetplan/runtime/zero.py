"""Gradient and parameter sharding among a stage's replicas, node by node (ZeRO stages 2 and 3:
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC
2020; the unit of gathering is FSDP's, Zhao et al., "PyTorch FSDP", VLDB 2023: one per node).

The stage's parameters that its own gradient sum covers (`hetplan.runtime.sharding`) are grouped
into units, one per node (piece) of the stage: a parameter belongs to the first piece that reads
it. Each unit's parameters are laid end to end in a flat buffer cut into r equal shares
(`sharding.share_bounds`); replica p's optimizer steps share p of every unit.

- Level 2 (gradients): the parameters stay whole. When the backward has made a unit's
  gradients (every parameter's `post_accumulate_grad` hook), they are reduce-scattered at once
  and the replica adds its share to what it keeps for the step; the unit's whole gradients are
  dropped. After the optimizer's step, each unit's updated shares are all-gathered (as ZeRO-1).
- Level 3 (gradients and parameters): besides, a unit's buffer holds no storage between uses:
  before a piece runs forward, and before its backward (a hook on its outputs' gradients, which
  autograd calls before it runs the piece's backward), its units are all-gathered into their
  buffers; after the forward and once its gradients are reduced, the storage is freed again.
  The parameters stay views of the buffer, so what autograd saved from them reads the gathered
  values again in the backward (FSDP's way: the storage is resized, the tensors stay).

Collectives run per micro-batch, in the order the same actions make on every replica: every
replica runs every action (`launch.run_spec` refuses a plan where one has no row of a
micro-batch), and the backward is not split (`hetplan.plan` refuses zero bubble's I and W with
these levels). FSDP2 (`fully_shard`) does the same per module, but on modules whose forward it
hooks, over collectives of a process group whose gradient it averages evenly: hetplan's stages
run traced pieces over point-to-point rings, and its replicas hold unequal rows, each slice's
loss weighted by its share of the batch; the rings of `sharding` are what the cost model charges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from hetplan.runtime.sharding import GROUP_TAGS, RING_TAG, gather_shares, lay_flat, share_bounds, summed_share
from hetplan.runtime.transport import Transport

UNIT_TAGS = 1 << 20  # above ZeRO-1's groups' tags: ZeRO-1 and these never shard the same stage


class _Unit:
    """One node's parameters in a flat buffer; `shard` the replica's share of it."""

    def __init__(self, params: Sequence[nn.Parameter], ranks: Sequence[int], me: int, level: int) -> None:
        self.params, self.level = list(params), level
        self.flat = lay_flat(self.params)
        self.bounds = share_bounds(self.flat.numel(), len(ranks))
        lo, hi = self.bounds[me]
        # level 2: a view of the buffer (its updates are the weights); level 3: the share alone
        self.shard = nn.Parameter(self.flat[lo:hi] if level == 2 else self.flat[lo:hi].clone())
        self.whole = True
        self.waiting = 0  # parameters whose gradient this backward has not made yet
        if level == 3:
            self.free()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def free(self) -> None:
        self.flat.untyped_storage().resize_(0)
        self.whole = False


class ShardedUnits:
    """Stage `stage`'s units (see the module) on replica `me` of `ranks`, at `level` 2 or 3;
    `index` numbers the stage among the worker's, for message tags. `call` runs a piece as the stage's
    forward does (`StageModule.run`), `finish` ends a backward, `gather_updates` ends a step."""

    def __init__(self, pieces: Sequence[Sequence[nn.Parameter]], ranks: Sequence[int], me: int, level: int,
                 index: int = 0, stage: int = 0) -> None:
        self.ranks, self.me, self.level, self.stage = tuple(ranks), me, level, stage
        self.tag = RING_TAG + UNIT_TAGS + index * GROUP_TAGS
        self.transport: Transport | None = None
        first: dict[int, int] = {}  # parameter id -> the piece that reads it first
        for i, params in enumerate(pieces):
            for p in params:
                first.setdefault(id(p), i)
        by_id = {id(p): p for params in pieces for p in params}
        members = [[by_id[pid] for pid, i in first.items() if i == k] for k in range(len(pieces))]
        made = {k: _Unit(ps, ranks, me, level) for k, ps in enumerate(members) if ps}
        self.units = list(made.values())
        # per piece, the units it reads
        self.needs = [tuple(dict.fromkeys(made[first[id(p)]] for p in params)) for params in pieces]
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._held: set[int] = set()  # units gathered for a backward (kept until their gradients are reduced)
        # called when a unit's gradients are reduced, its whole gradients and buffer still held
        # (with its gathered weights at level 3): the moment the worker's memory peaks inside a backward
        self.reduced: Callable[[], None] = lambda: None
        for u in self.units:
            for p in u.params:
                p.register_post_accumulate_grad_hook(self._accumulated)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    @property
    def shards(self) -> list[nn.Parameter]:
        """What the replica's optimizer steps in the parameters' stead."""
        return [u.shard for u in self.units]

    # --- the forward and the backward ------------------------------------------------------------
    def call(self, index: int, piece: nn.Module, args: list, inner: Callable[[nn.Module, list], tuple] | None):
        """Piece `index` run on `args` (by `inner` where given), its units gathered around it."""
        units = self.needs[index]
        self._gather(units)
        out = inner(piece, args) if inner is not None else piece(*args)
        results = out if isinstance(out, tuple) else (out,)
        if self.level == 3 and torch.is_grad_enabled():
            for r in results:
                if isinstance(r, torch.Tensor) and r.requires_grad:
                    r.register_hook(self._before_backward(units))
        for u in units:
            if self.level == 3 and id(u) not in self._held:
                u.free()
        return out

    def _before_backward(self, units: tuple[_Unit, ...]) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            self._gather(units)
            self._held.update(id(u) for u in units)
        return hook

    def _gather(self, units: Sequence[_Unit]) -> None:
        for u in units:
            if u.whole:
                continue
            u.flat.untyped_storage().resize_(u.nbytes)
            lo, hi = u.bounds[self.me]
            with torch.no_grad():
                u.flat[lo:hi].copy_(u.shard)
            self._all_gather(u)
            u.whole = True

    def _all_gather(self, u: _Unit) -> None:
        gather_shares(u.flat, u.bounds, self.ranks, self.me, self._transport(), self.tag + GROUP_TAGS // 2)

    def _accumulated(self, p: torch.Tensor) -> None:
        u = self._unit_of[id(p)]
        if u.waiting == 0:
            u.waiting = sum(q.requires_grad for q in u.params)
        u.waiting -= 1
        if u.waiting == 0:
            self._reduce(u)

    def _reduce(self, u: _Unit) -> None:
        """The unit's gradients summed over the replicas into this one's share; the whole ones dropped."""
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in u.params])
        for p in u.params:
            p.grad = None
        share = summed_share(grads, u.bounds, self.ranks, self.me, self._transport(), self.tag)
        self.reduced()
        mine = share.to(u.flat.device, copy=True)  # a copy: a view would keep every share alive
        u.shard.grad = mine if u.shard.grad is None else u.shard.grad.add_(mine)
        u.waiting = 0
        self._held.discard(id(u))
        if self.level == 3:
            u.free()

    def finish(self) -> None:
        """After a backward: the units some of whose parameters had no gradient in it, reduced in
        their order (the same on every replica), and every gathered one freed (level 3)."""
        for u in self.units:
            if u.waiting:
                self._reduce(u)
        for u in self.units:
            if self.level == 3 and u.whole:
                u.free()
        self._held.clear()

    # --- the step ---------------------------------------------------------------------------------
    def gather_updates(self) -> None:
        """After the optimizer's step (level 2): every replica's updated shares into every buffer."""
        if self.level == 2:
            for u in self.units:
                self._all_gather(u)

    def gather_all(self) -> None:
        """Every unit whole (at level 3 until the next piece's forward frees it): the end of a run."""
        self._gather(self.units)

    @contextlib.contextmanager
    def whole(self, loaded: bool = False) -> Iterator[None]:
        """The parameters whole for a while (a checkpoint saved or loaded, the weights read);
        `loaded`: they were written meanwhile, so the replica's shares are taken from them."""
        self.gather_all()
        try:
            yield
        finally:
            for u in self.units:
                if loaded:
                    lo, hi = u.bounds[self.me]
                    with torch.no_grad():
                        u.shard.copy_(u.flat[lo:hi])
                if self.level == 3:
                    u.free()

    def _transport(self) -> Transport:
        if self.transport is None:
            raise RuntimeError("a sharded stage's collectives need its transport (ShardedUnits.transport)")
        return self.transport
