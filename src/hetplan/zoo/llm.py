"""Transformer language models as layer chains from their shapes alone (no weights, no device).

For models too big to profile on this machine: a chain `embed -> block_0 .. block_(L-1) -> head`
whose FLOPs, parameter, activation and message bytes are counted from the configuration, and
whose times on each device type come from the roofline model (`hetplan.cost.projection`) at a
stated achieved fraction of the peak. The counts follow Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC 2021: 24 b s h^2 +
4 b s^2 h FLOPs per block forward, with a 4h or `ffn` wide MLP) and Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023: 34 s b h bytes of
16-bit stash per block when attention's s^2 scores are not kept, as memory-efficient attention
does).

The graph says it was counted, not measured (`meta["source"] = "analytic"`); its times are as
good as the achieved fraction. Profile a block on the real device where you can.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hetplan.catalog import DeviceType, lookup
from hetplan.cost.projection import roofline_s
from hetplan.errors import HetplanError
from hetplan.graph import Edge, Graph, Node, Tied
from hetplan.precision import FP32, checked, is_mixed

# A whole block's forward and backward in fp32 (OPT-350M, OPT-1.3B, Llama-3-8B at 4-8 k tokens,
# sdpa attention) ran at 0.71-0.74 of the fp32 peak on an H200 (bench/llm_block_gpu.py,
# BENCHMARKS.md). Other GPUs are assumed to reach the same fraction of their own peak.
ACHIEVED_FRACTION = 0.72
# The same blocks in bf16 autocast reached 0.34-0.46 of the 16-bit tensor peak on that H200
# (0.43 for Llama-3-8B): 16-bit products are bound by the rest of the block (normalisation,
# attention's softmax, element-wise work) far sooner.
ACHIEVED_FRACTION_16 = 0.43
# Per pass of a block, what a micro-batch pays whatever its size: about 20 kernel launches.
BLOCK_FIXED_S = 20 * 10e-6
BACKWARD_FLOPS = 2.0  # a backward pass does twice the forward's FLOPs
STASH_ELEMENTS_PER_TOKEN_H = 17  # Korthikanti et al.'s 34 s b h bytes at 2 bytes an element
# of those 34, the 24 a t-way tensor-parallel group splits (attention's q, k, v and its output
# before the projection, the MLP's inner values; the rest, the layer's input and norms, whole)
TP_SPLIT_SHARE = 24 / 34
# with sequence parallelism a group splits the norms' inputs and dropout's masks too (6 more); the
# runtime keeps the all-gathered inputs of the column-split products (4) whole (`Node.act_sequence_share`)
SEQUENCE_SPLIT_SHARE = 6 / 34
# Selective recomputation (`hetplan.pieces.selective`: products' outputs kept) of a block, in
# Korthikanti et al.'s 34: it keeps q, k, v (6), attention's output (2), the MLP's first product
# (8) and two products autograd would not save (the projections' outputs, 2 + 2): 20; it builds
# again the norms' inputs and outputs, the products' inputs, the activation function's output and
# dropout's masks: 18 (the 34 less the 16 it keeps of them), each read and written once.
SELECTIVE_KEEP, SELECTIVE_REBUILT = 20 / 34, 18 / 34


@dataclass(frozen=True)
class TransformerShape:
    """The shape of a decoder-only transformer, as its transformers configuration gives it."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    kv_heads: int | None = None  # grouped-query attention; None: as many as heads
    gated: bool = False  # a gated MLP (SwiGLU: Llama, Mistral, Qwen2): three matrices, not two
    # the output layer is the token embedding (OPT, GPT-2): stages holding the two sum its
    # gradient every step (Megatron-LM's embedding group; `Graph.tied`)
    tied_embeddings: bool = False

    def block_params(self) -> int:
        kv = (self.kv_heads or self.heads) * (self.hidden // self.heads)
        attention = self.hidden * (self.hidden + 2 * kv) + self.hidden * self.hidden
        return attention + (3 if self.gated else 2) * self.hidden * self.ffn + 4 * self.hidden

    @classmethod
    def from_config(cls, config: Mapping, name: str) -> TransformerShape:
        """The shape a transformers configuration (its `config.json`, or `PretrainedConfig.to_dict()`)
        describes: decoder-only models with the usual key names (OPT, GPT-2, Llama, Mistral, Qwen2)."""
        def key(*names: str) -> int:
            for k in names:
                if isinstance(config.get(k), int) and not isinstance(config.get(k), bool) and config[k] > 0:
                    return config[k]
            raise HetplanError(f"{name}: the configuration has no whole number > 0 for {' or '.join(names)}")

        hidden = key("hidden_size", "n_embd", "d_model")
        ffn = config.get("intermediate_size") or config.get("ffn_dim") or config.get("n_inner") or 4 * hidden
        heads = key("num_attention_heads", "n_head")
        kv = config.get("num_key_value_heads")
        return cls(str(config.get("_name_or_path") or config.get("model_type") or name),
                   key("num_hidden_layers", "n_layer"), hidden, int(ffn), heads, key("vocab_size"),
                   kv_heads=kv if isinstance(kv, int) and kv != heads else None,
                   gated=config.get("hidden_act") in ("silu", "swiglu"),
                   tied_embeddings=config.get("tie_word_embeddings", True) is not False)


SHAPES = {
    s.name: s
    for s in (
        TransformerShape("opt-350m", 24, 1024, 4096, 16, 50272, tied_embeddings=True),
        TransformerShape("opt-1.3b", 24, 2048, 8192, 32, 50272, tied_embeddings=True),
        TransformerShape("opt-2.7b", 32, 2560, 10240, 32, 50272, tied_embeddings=True),
        TransformerShape("opt-6.7b", 32, 4096, 16384, 32, 50272, tied_embeddings=True),
        TransformerShape("llama-3-8b", 32, 4096, 14336, 32, 128256, kv_heads=8, gated=True),
        # EleutherAI/gpt-neo-2.7B's config.json: num_layers 32, hidden_size 2560, num_heads 20,
        # intermediate_size null (4 x hidden), vocab_size 50257, embeddings tied (transformers'
        # default). Its layers alternate global and local attention (window_size 256); the count
        # treats every layer as global, an upper bound on its attention FLOPs.
        TransformerShape("gpt-neo-2.7b", 32, 2560, 10240, 20, 50257, tied_embeddings=True),
        # meta-llama/Meta-Llama-3-70B's config.json: num_hidden_layers 80, hidden_size 8192,
        # intermediate_size 28672, num_attention_heads 64, num_key_value_heads 8, vocab_size
        # 128256, hidden_act silu (SwiGLU), tie_word_embeddings false.
        TransformerShape("llama-3-70b", 80, 8192, 28672, 64, 128256, kv_heads=8, gated=True),
    )
}


def shape(name: str) -> TransformerShape:
    """A shape by name (`SHAPES`), or read from a transformers `config.json`."""
    if name in SHAPES:
        return SHAPES[name]
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise HetplanError(f"{name}: cannot read a transformers configuration: {exc}") from None
        if not isinstance(config, dict):
            raise HetplanError(f"{name}: a transformers configuration is a JSON object")
        return TransformerShape.from_config(config, path.stem)
    raise HetplanError(f"unknown transformer shape {name!r}: give a config.json or one of {', '.join(SHAPES)}")


@dataclass(frozen=True)
class _Counting:
    """How a chain is counted in a precision: the bytes of an activation element, the achieved
    fraction of the precision's peak, and whether products use 16-bit copies of the weights."""

    precision: str
    types: tuple[DeviceType, ...]

    @property
    def value_bytes(self) -> int:
        return 2 if is_mixed(self.precision) else 4

    @property
    def fraction(self) -> float:
        return ACHIEVED_FRACTION_16 if is_mixed(self.precision) else ACHIEVED_FRACTION

    def times(self, flops: float, traffic_bytes: float, fixed_s: float) -> dict[str, float]:
        """The roofline time at the achieved fraction of the precision's peak, plus the fixed part."""
        return {t.name: fixed_s + roofline_s(flops / self.fraction, traffic_bytes, t, self.precision)
                for t in self.types}

    def node(self, node_id: str, op: str, flops: float, params: int, out_bytes: int, act_bytes: int,
             fixed_s: float, cast: bool = True, tp_units: int = 0, act_split_share: tuple[float, float] = (0.0, 0.0),
             selective: tuple[float, float] = (0.0, 0.0)) -> Node:
        """`cast`: its products use its weights (an embedding's lookup does not); `tp_units`:
        the most ways it splits tensor-parallel (`Node.tp_units`), `act_split_share` the shares of
        its activations that then split (`Node.act_split_share`, `act_sequence_share`); `selective`, what selective
        recomputation keeps and builds again (`Node.selective_keep_bytes`, `selective_rebuilt_bytes`),
        the rebuilt bytes' element-wise work timed at the memory's bandwidth."""
        casts = 2 * params if cast and is_mixed(self.precision) and flops > 0 else 0
        traffic = (casts or 4 * params) + out_bytes + act_bytes
        fwd = self.times(flops, traffic, fixed_s)
        bwd = self.times(BACKWARD_FLOPS * flops, 2 * traffic, fixed_s)
        keep, again = selective
        # the rebuilt values read and written once, as a share of the forward on the slowest type for it
        share = max((roofline_s(0.0, 2 * again, t) / fwd[t.name] for t in self.types if fwd[t.name] > 0), default=0.0)
        return Node(node_id, op, fwd, bwd, flops=flops, param_bytes=4 * params, out_bytes=out_bytes,
                    act_bytes=act_bytes, module=(node_id,), cast_bytes=casts, tp_units=tp_units,
                    act_split_share=act_split_share[0], act_sequence_share=act_split_share[1],
                    selective_keep_bytes=round(keep),
                    selective_rebuilt_bytes=round(again), rerun_forwards={"selective": min(share, 1.0)},
                    fwd_fixed_s={t.name: fixed_s for t in self.types},
                    bwd_fixed_s={t.name: fixed_s for t in self.types})


def transformer_chain(model: TransformerShape | str, batch_size: int, seq_len: int,
                      device_types: Sequence[str], precision: str = FP32) -> Graph:
    """The chain of `model` for a batch of `batch_size` sequences of `seq_len` tokens, in
    `precision` (`hetplan.precision`: activations of that width, 16-bit copies of the weights in
    mixed precision, the precision's peak rate), with times on each of `device_types` (catalog
    names; the first is the graph's `profiled_on`)."""
    m = shape(model) if isinstance(model, str) else model
    if not device_types:
        raise HetplanError("transformer_chain needs at least one device type")
    count = _Counting(checked(precision), tuple(lookup(t) for t in device_types))
    tokens, h = batch_size * seq_len, m.hidden
    hidden_bytes = count.value_bytes * tokens * h
    embed = count.node("embed", "Embedding", 0.0, (m.vocab + seq_len) * h, hidden_bytes, 0, 0.0, cast=False)
    block_flops = 2.0 * tokens * m.block_params() + 4.0 * batch_size * seq_len * seq_len * h
    stash = count.value_bytes * STASH_ELEMENTS_PER_TOKEN_H * tokens * h
    # tensor parallelism (`hetplan.pieces.tensor_split`) splits a block's heads and MLP units, and
    # the head's vocabulary unless it is the embedding's (tied weights stay whole)
    blocks = [count.node(f"block_{i}", "TransformerBlock", block_flops, m.block_params(), hidden_bytes, stash,
                         BLOCK_FIXED_S, tp_units=math.gcd(m.heads, m.ffn),
                         act_split_share=(TP_SPLIT_SHARE, SEQUENCE_SPLIT_SHARE),
                         selective=(SELECTIVE_KEEP * stash, SELECTIVE_REBUILT * stash))
              for i in range(m.layers)]
    # the loss's softmax is fp32 in every precision (autocast runs it so), after 16-bit logits;
    # a group splits the logits by words and computes the loss on the split (vocabulary-parallel,
    # `hetplan.pieces.tensor_stage.running`), the input whole (gathered under sequence
    # parallelism); a head tied to the embedding is whole, its loss too
    logits = (4 + (count.value_bytes if is_mixed(precision) else 0)) * tokens * m.vocab
    split = 0.0 if m.tied_embeddings else logits / (hidden_bytes + logits)
    # selectively: the product's logits kept, the input and the softmax's fp32 output built again
    head = count.node("head", "LMHead", 2.0 * tokens * h * m.vocab, h * m.vocab + 2 * h, 4 * batch_size,
                      hidden_bytes + logits, BLOCK_FIXED_S, tp_units=0 if m.tied_embeddings else m.vocab,
                      act_split_share=(split, 0.0),
                      selective=(count.value_bytes * tokens * m.vocab, hidden_bytes + 4 * tokens * m.vocab))
    nodes = (embed, *blocks, head)
    edges = tuple(Edge(a.id, b.id, hidden_bytes) for a, b in itertools.pairwise(nodes))
    meta = {"source": "analytic", "granularity": "block", "seq_len": str(seq_len),
            "achieved_fraction": str(count.fraction)}
    tied = (Tied(("embed", "head"), 4 * h * m.vocab),) if m.tied_embeddings else ()
    return Graph(m.name, nodes, edges, batch_size, count.types[0].name, source="analytic", meta=meta, tied=tied,
                 precision=precision)
