"""Which parameters a tensor-parallel group splits, and how: the rule of Megatron-LM (Shoeybi et
al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", section 3), read off the model's modules.

In a transformer block the first projection of each pair is split by columns (its outputs:
attention heads, MLP hidden units) and the second by rows (its inputs), so that each device
computes its heads and its part of the MLP with no communication in between, and one all-reduce
joins the second projection's partial sums, once after the attention and once after the MLP.
The language-model head is split by columns too (each device its rows of the vocabulary).

- column: `q_proj`, `k_proj`, `v_proj`, `c_attn` (GPT-2's joined q, k, v), `gate_proj`,
  `up_proj`, `c_fc`, `fc1`, `query`, `key`, `value`, `lm_head` (the bias, when there is one, with
  its columns);
- row: `o_proj`, `out_proj`, `c_proj`, `down_proj`, `fc2`, `dense` inside attention;
- whole on every device: norms, embeddings, a weight tied to another module (GPT-2's token
  embedding is its head: it cannot be split one way here and kept whole there), and the key and
  value projections when the degree does not divide the key-value heads (grouped-query attention
  with fewer groups than devices: each device computes them all, as Megatron-LM does then).

The loss on the head's logits is vocabulary-parallel (Megatron-LM's cross-entropy, section 3:
each device its share of the words' log-probabilities, three all-reduces of one number per
token instead of gathering the logits) where `class_split_loss` says the piece's graph allows it.

A degree must divide the heads, the MLP's hidden units and the vocabulary of every module split;
`units` is the largest such number (their greatest common divisor). A projection under another
name (a `Linear` or GPT-2's `Conv1D` that is neither of the above) cannot be split:
`tensor_splits` names it.

Nothing here runs on a device: `hetplan.pieces.tensor_stage` puts these splits on a mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn

from hetplan.errors import HetplanError

COLUMN = ("q_proj", "k_proj", "v_proj", "c_attn", "gate_proj", "up_proj", "c_fc", "fc1", "query", "key", "value",
          "lm_head")
ROW = ("o_proj", "out_proj", "c_proj", "down_proj", "fc2")
KEY_VALUE = ("k_proj", "v_proj", "key", "value")
COLUMN_KIND, ROW_KIND = "column", "row"


@dataclass(frozen=True)
class Split:
    """How a parameter is laid out on a group: `dim` the dimension its shards cut (None: whole on
    every device), in `units` whole things (heads, hidden units, words); `kind` the projection's
    side in Megatron's pair (`column`: it splits its outputs; `row`: its inputs; "" otherwise)."""

    dim: int | None
    units: int = 0
    kind: str = ""


WHOLE = Split(None)


PRODUCTS = {torch.ops.aten.linear.default, torch.ops.aten.addmm.default, torch.ops.aten.mm.default,
             torch.ops.aten.matmul.default}
# what passes the head's logits to the loss unchanged but for their layout or type
_CARRIERS = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default, torch.ops.aten.reshape.default,
             torch.ops.aten.view.default, torch.ops.aten.alias.default, torch.ops.aten.contiguous.default,
             torch.ops.aten.clone.default, torch.ops.aten.to.dtype_layout}
_LOSS = torch.ops.aten.cross_entropy_loss.default
# what else reads log-probabilities: a graph with one of these keeps its logits whole
_LOG_PROBS = {torch.ops.aten.log_softmax.int, torch.ops.aten._log_softmax.default, torch.ops.aten.nll_loss.default,
              torch.ops.aten.nll_loss_nd.default, torch.ops.aten.nll_loss_forward.default}


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _out_dim(module: nn.Module) -> int:
    """The dimension of the weight that indexes the outputs: Linear's [out, in], Conv1D's [in, out]."""
    return 1 if type(module).__name__ == "Conv1D" else 0


def _count(holder, *names: str) -> int:
    """The first of `names` on `holder` that is a whole number (0: none is; a list, one per stage
    of a model as Swin's heads are, is not one)."""
    for name in names:
        value = getattr(holder, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


_HEADS = ("num_attention_heads", "num_heads", "n_head", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def _config(model: nn.Module) -> tuple[int, int]:
    """The model's attention heads and key-value heads from its configuration (0 where it has
    none, or gives them per stage)."""
    cfg = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    heads = _count(cfg, *_HEADS)
    return heads, _count(cfg, *_KV_HEADS) or heads


def _heads_of(model: nn.Module, name: str, heads: int, kv_heads: int) -> tuple[int, int]:
    """The heads of the attention a projection `name` sits in: its enclosing modules' own counts
    (a model whose stages differ in heads keeps them there), else the configuration's."""
    parts = name.split(".")
    for depth in (len(parts) - 1, len(parts) - 2):
        if depth > 0:
            holder = model.get_submodule(".".join(parts[:depth]))
            own = _count(holder, *_HEADS)
            if own:
                return own, _count(holder, *_KV_HEADS) or own
    return heads, kv_heads


def hidden_size(model: nn.Module) -> int:
    """The width of the model's residual stream, from its configuration (0 where it has none)."""
    cfg = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    return _count(cfg, "hidden_size", "n_embd", "d_model")


def _projection_split(name: str, module: nn.Module, degree: int, heads: int, kv_heads: int) -> dict[str, Split]:
    leaf = name.rsplit(".", 1)[-1]
    out, weight = _out_dim(module), module.weight
    attention = "attn" in name or "attention" in name
    by_heads = leaf in KEY_VALUE + ("q_proj", "query", "c_attn") or (attention and leaf not in COLUMN)
    if by_heads and not heads:
        raise HetplanError(f"module {name!r} is an attention projection whose heads are not known (no whole number "
                           "of heads on its attention nor in the configuration): it cannot be split tensor-parallel; "
                           "plan its stage with --max-tp 1")
    if leaf in COLUMN:
        if leaf in KEY_VALUE and kv_heads % degree:
            return {"weight": WHOLE, "bias": WHOLE}
        if leaf in KEY_VALUE:
            units = kv_heads
        elif leaf in ("q_proj", "query", "c_attn"):
            units = heads
        else:  # MLP hidden units, or the head's words
            units = weight.shape[out]
        return {"weight": Split(out, units, COLUMN_KIND), "bias": Split(0, units)}
    if leaf in ROW or (leaf == "dense" and "attention" in name):
        units = heads if attention else weight.shape[1 - out]
        return {"weight": Split(1 - out, units, ROW_KIND), "bias": WHOLE}
    raise HetplanError(f"module {name!r} ({type(module).__name__}) cannot be split tensor-parallel: hetplan splits "
                       f"attention and MLP projections named {', '.join(COLUMN + ROW)}; plan its stage with --max-tp 1")


def tensor_splits(model: nn.Module, degree: int, names: set[str] | None = None) -> dict[str, Split]:
    """Each parameter's split at `degree`, by its name in `model` (all of them, or those in
    `names`); a parameter several modules hold stays whole."""
    heads, kv_heads = _config(model)
    holders: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    out: dict[str, Split] = {}
    for name, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        wanted = [k for k in own if names is None or f"{name}.{k}" in names]
        if not wanted:
            continue
        rule = _projection_split(name, module, degree, *_heads_of(model, name, heads, kv_heads)) \
            if _is_projection(module) and degree > 1 else {}
        for k in wanted:
            split = rule.get(k, WHOLE)
            out[f"{name}.{k}"] = WHOLE if holders[id(own[k])] > 1 else split
    return out


def split_units(model: nn.Module, names: set[str]) -> int:
    """The largest degree that divides every split of the parameters `names` (0: none of them
    splits; 1: they cannot be split at all)."""
    try:
        splits = tensor_splits(model, 2, names)
    except HetplanError:
        return 1
    # key and value projections split evenly or stay whole (`_projection_split`): they never forbid a degree
    units = [s.units for name, s in splits.items()
             if s.dim is not None and name.rsplit(".", 2)[-2] not in KEY_VALUE]
    return math.gcd(*units) if units else 0


def products_weights(gm: fx.GraphModule, node: fx.Node) -> list[torch.Tensor]:
    """The parameters a product node of `gm` reads (its `get_attr` arguments)."""
    return [getattr(gm, a.target) for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]


def class_split_loss(module: nn.Module, kinds: Mapping[int, str]) -> bool:
    """Whether `module`'s graphs compute a cross-entropy on logits that a column-split product
    made (the head's: `kinds` by parameter id), unweighted and unsmoothed, with nothing else
    reading log-probabilities: then a group keeps the logits split by words and computes the loss
    vocabulary-parallel (torch's `loss_parallel`, `hetplan.pieces.tensor_stage.running`)."""
    found = False
    for gm in (m for m in module.modules() if isinstance(m, fx.GraphModule)):
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in _LOG_PROBS:
                return False
            if node.target is _LOSS:
                if not _plain_loss(node) or not _from_column_product(gm, node.args[0], kinds):
                    return False
                found = True
    return found


def _plain_loss(node: fx.Node) -> bool:
    """cross_entropy_loss(input, target, weight=None, reduction, ignore_index, label_smoothing=0)."""
    args = list(node.args) + [None] * (6 - len(node.args))
    weight = node.kwargs.get("weight", args[2])
    smoothing = node.kwargs.get("label_smoothing", args[5]) or 0.0
    return weight is None and smoothing == 0.0


def _from_column_product(gm: fx.GraphModule, value, kinds: Mapping[int, str]) -> bool:
    while isinstance(value, fx.Node) and value.op == "call_function" and value.target in _CARRIERS:
        value = value.args[0]
    if not isinstance(value, fx.Node) or value.op != "call_function" or value.target not in PRODUCTS:
        return False
    return any(kinds.get(id(p)) == COLUMN_KIND for p in products_weights(gm, value))
