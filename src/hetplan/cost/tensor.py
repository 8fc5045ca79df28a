"""What tensor parallelism costs a stage replica that is a group of t devices (Megatron-LM,
Shoeybi et al., 2019, section 3; the split is `hetplan.pieces.tensor_split`).

- Compute: a node that splits (`Node.tp_units` > 0: a transformer block, a projection, the
  vocabulary's head) takes 1/t of the part of its time that scales with the samples on the
  group's type; the fixed part of each pass (calling the operators) does not shrink, and the
  rest (norms, embeddings, the loss) runs whole on every device.
- Communication: each node that splits sums its partial outputs with two all-reduces of its
  output in the forward (after the attention and after the MLP) and two in the backward (the
  inputs' gradients), on the group's links (one host: `CostModel.allreduce_s`). Charged per
  batch, with the pass's time that scales with the samples; latency paid per micro-batch and
  per layer is left out, as is DTensor's gathering of the vocabulary's logits for the loss.
- Memory: a node's parameters (their gradients and optimizer state, their 16-bit copies) are
  1/t on each device; activations are counted whole (Megatron-LM without sequence parallelism
  keeps the blocks' inputs and norms whole on every device: an upper bound).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetplan.graph import Graph

ALLREDUCES_PER_PASS = 2  # per transformer block: after the attention, after the MLP


def split_nodes(graph: Graph, nodes: Sequence[str]) -> set[str]:
    return {n for n in nodes if graph.by_id[n].tp_units}


def node_tp_times_s(cm, node: str, device_type: str, group: Sequence[str]) -> tuple[float, float]:
    """A node's forward and backward for the whole batch on a group of devices of one type: the
    part that scales with the samples 1/t when it splits, plus its all-reduces."""
    whole = cm.node_times_s(device_type)[node]
    t = len(group)
    if t == 1 or not cm.graph.by_id[node].tp_units:
        return whole
    fixed = cm.node_fixed_s(device_type)[node]
    comm = ALLREDUCES_PER_PASS * cm.allreduce_s(cm.graph.by_id[node].out_bytes, group)
    return tuple(f + (w - f) / t + comm for w, f in zip(whole, fixed, strict=True))


def tp_times_s(cm, nodes: Sequence[str], device_type: str, group: Sequence[str]) -> tuple[float, float]:
    """Forward and backward of `nodes` for the whole batch on a group of devices of one type."""
    if len(group) == 1:
        return cm.stage_times_s(nodes, device_type)
    times = [node_tp_times_s(cm, n, device_type, group) for n in nodes]
    return math.fsum(t[0] for t in times), math.fsum(t[1] for t in times)


def tp_bytes(graph: Graph, nodes: Sequence[str], t: int) -> tuple[int, int]:
    """The parameters and 16-bit weight copies each device of a group of `t` holds."""
    split = split_nodes(graph, nodes) if t > 1 else set()
    whole = [n for n in nodes if n not in split]
    params = graph.param_bytes_of(whole) + sum(graph.by_id[n].param_bytes for n in split) // t
    casts = graph.cast_bytes_of(whole) + sum(graph.by_id[n].cast_bytes for n in split) // t
    return params, casts
