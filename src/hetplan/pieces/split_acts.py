"""What a tensor-parallel group splits of a piece's saved activations, measured in one process:
Megatron-LM's regions (Shoeybi et al. 2019; Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", MLSys 2023) read off the operators a forward runs.

A product whose weight is split by columns (`hetplan.pieces.tensor_split`: q, k, v, the MLP's
first projection) makes a value each device holds a share of; every operator that reads a share
makes a share (attention, activation functions, dropout between the pair), until a product whose
weight is split by rows joins the shares into a whole value (after its all-reduce). Of the
tensors autograd saves for the backward (each storage once, the weights and their casts left out):

- `split_share`: those inside the pairs, a t-th of them on each of t devices;
- `sequence_share`: the rest, less the inputs of column-split products: what a sequence-parallel
  group splits along the tokens too (norms' inputs, dropout's masks outside the pairs); the
  inputs of the column-split products stay whole, as DTensor's autograd saves them all-gathered
  (`hetplan.pieces.tensor_stage.gathered`), and so does what is made from a share cut into
  parts (GPT-2's joined q, k and v: DTensor gathers the share first, `_SPLITS`) and the integers
  the piece is given (a loss's targets).

The profiler measures pieces that hold a whole pair (a row-split weight among theirs: a block),
and the head split by words whose loss is vocabulary-parallel (`tensor_split.class_split_loss`:
its share of the log-probabilities); a piece that only opens a pair (a head whose logits DTensor
gathers for another loss) or only carries a share (a layer between the two projections) it
leaves counted whole.

These are the shares the cost model reads (`Node.act_split_share`, `Node.act_sequence_share`,
`hetplan.cost.tensor`); the counted chains (`hetplan.zoo.llm`) count them from Megatron's table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hetplan.pieces.selective import keeps
from hetplan.pieces.tensor_split import COLUMN_KIND


@dataclass(frozen=True)
class Shares:
    """Of a piece's saved activations, the share a tensor-parallel group splits, and the share a
    sequence-parallel one splits besides (see the module)."""

    split_share: float
    sequence_share: float


# cutting a share into parts (GPT-2's joined q, k and v, split off its one product's output):
# DTensor gathers the share first (its parts do not fall on the devices' shares), so the parts
# are whole on every device
_SPLITS = (torch.ops.aten.split, torch.ops.aten.split_with_sizes)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Regions(TorchDispatchMode):
    """Which storages are the weights' (and their views' and casts': `weights`, by kind), which
    tensors hold a share inside a pair (`split`, by id: a view cut from a share may be whole), which
    storages are inputs of column-split products (`gathered`)."""

    def __init__(self, weights: Mapping[int, str]) -> None:
        super().__init__()
        self.weights = dict(weights)
        self.split: set[int] = set()
        self.gathered: set[int] = set()
        self.joined: set[int] = set()  # made from a share DTensor gathered (by id): whole either way
        self.held: list[torch.Tensor] = []  # every output, so that no address nor id is reused in the run
        self.made: set[int] = set()  # storages an operator of the run wrote

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.held += outs
        self.made.update(_ptr(t) for t in outs)
        kinds = {self.weights[_ptr(t)] for t in ins if _ptr(t) in self.weights}
        if kinds and keeps(func):  # a product with a weight: a column split starts a share, a row split ends it
            if COLUMN_KIND in kinds:
                self.split.update(id(t) for t in outs)
                self.gathered.update(_ptr(t) for t in ins if _ptr(t) not in self.weights)
        elif ins and all(_ptr(t) in self.weights for t in ins):  # a view or a cast of a weight is that weight
            self.weights.update((_ptr(t), next(iter(kinds))) for t in outs if _ptr(t) not in self.weights)
        elif any(id(t) in self.split for t in ins):
            cut = getattr(func, "overloadpacket", None) in _SPLITS
            (self.joined if cut else self.split).update(id(t) for t in outs)
        elif any(id(t) in self.joined for t in ins):
            self.joined.update(id(t) for t in outs)
        return out


def measure(run: Callable[[], Any], weights: Mapping[int, str]) -> Shares:
    """`Shares` of a piece from one run of `run`, its forward; `weights`: the storage address of
    each of its parameters and its split's kind (`tensor_split.Split.kind`; "" for one kept whole).
    A storage counts as split when every tensor saved from it is a share."""
    saved: dict[int, int] = {}
    whole: set[int] = set()  # storages some tensor saved from is not a share of
    joined: set[int] = set()  # storages some tensor saved from was gathered from a share
    labels: set[int] = set()  # integers the piece was given (a loss's targets): whole on every device
    with _Regions(weights) as regions:
        def pack(t: torch.Tensor) -> torch.Tensor:
            if _ptr(t) not in regions.weights:
                saved[_ptr(t)] = t.untyped_storage().nbytes()
                if id(t) not in regions.split:
                    whole.add(_ptr(t))
                if id(t) in regions.joined:
                    joined.add(_ptr(t))
                if not (t.is_floating_point() or _ptr(t) in regions.made):
                    labels.add(_ptr(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    total = sum(saved.values())
    if not total:
        return Shares(0.0, 0.0)
    split = sum(n for ptr, n in saved.items() if ptr not in whole)
    kept = sum(n for ptr, n in saved.items()
               if ptr in whole and (ptr in regions.gathered or ptr in joined or ptr in labels))
    return Shares(split / total, max(0.0, (total - split - kept) / total))
