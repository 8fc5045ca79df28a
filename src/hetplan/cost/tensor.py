"""What tensor parallelism costs a stage replica that is a group of t devices (Megatron-LM,
Shoeybi et al., 2019, section 3; the split is `hetplan.pieces.tensor_split`).

- Compute: a node that splits (`Node.tp_units` > 0: a transformer block, a projection, the
  vocabulary's head) takes 1/t of the part of its time that scales with the samples on the
  group's type; the rest (norms, embeddings, the loss) runs whole on every device. The fixed
  part of each pass (calling the operators) does not shrink: it grows by DTENSOR_FIXED_FACTOR,
  what DTensor's dispatch adds to each operator.
- Communication: each node that splits sums its partial outputs with two all-reduces of its
  output in the forward (after the attention and after the MLP) and two of its input in the
  backward (the gradients of the column-split products' inputs), on the group's links (one host:
  `CostModel._allreduce_s`), each of a micro-batch's bytes, paid per action. A head split by words
  computes its loss vocabulary-parallel (`hetplan.pieces.tensor_split.class_split_loss`): its
  forward's all-reduces are of one number per token, which its output (the loss) stands for, and
  its backward runs one of its input where two are charged. GPT-2's joined q, k, v (gathered
  before they are split) are left out.
- Measured: where the profiler timed the node on a group of the type and size on one host
  (`Node.tp_s`, `hetplan profile --tp-degrees`), its times replace all of the above for a group
  on one host (their fixed parts paid per action as any node's): they hold what the projection
  leaves out or guesses (DTensor's dispatch, the collectives' real cost on those links).
- Memory: a node's parameters (their gradients and optimizer state, their 16-bit copies) are
  1/t on each device; of its activations, the share the node says splits (`Node.act_split_share`:
  a counted transformer block's 24 of 34 s b h bytes, Korthikanti et al. 2022, the heads' and the
  MLP's inner values) is 1/t on each device, the rest (the blocks' inputs and norms, without
  sequence parallelism) whole on every device (`tp_act_bytes`). A profiled node says 0 until
  the profiler measures it: counted whole, an upper bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetplan.graph import Graph

ALLREDUCES_PER_PASS = 2  # per transformer block: after the attention, after the MLP
# DTensor's dispatch (sharding propagation in Python) per operator, over eager torch's: the
# fixed part of a pass on a group is this much more (gpt2-tiny and llama-tiny on this VM's CPU,
# bench/tp_choices.py: about 50 us per operator for the forward and backward together, against
# 15-20 us eager)
DTENSOR_FIXED_FACTOR = 3.0


def split_nodes(graph: Graph, nodes: Sequence[str]) -> set[str]:
    return {n for n in nodes if graph.by_id[n].tp_units}


def node_tp_times_s(cm, node: str, device_type: str, group: Sequence[str],
                    microbatches: int | None = None, share: float = 1.0) -> tuple[float, float, float, float]:
    """A node's forward and backward for the whole batch on a group of devices of one type, and
    the fixed part of each (paid per micro-batch). With `microbatches` (a plan's), each pass's
    all-reduces are read off the all-reduce curve at the bytes of the group's rows of a
    micro-batch (`share` of the batch over the micro-batches: a replica sums its own rows) and
    paid per action (a measured curve is not a line: gloo on this VM took 1.4 ms for 64 kB and
    for 1 MB alike); without (a planner's grouped problem, whose micro-batches are not chosen
    yet), as latency per action plus bytes over the batch, which its share of the rows scales."""
    whole, fixed = cm._node_times_s(device_type)[node], cm._node_fixed_s(device_type)[node]
    t = len(group)
    if t == 1:
        return (*whole, *fixed)
    measured = measured_tp_s(cm, node, device_type, group)
    if measured is not None:
        return measured
    split = bool(cm.graph.by_id[node].tp_units)
    out = []
    for w, f, nbytes in zip(whole, fixed, _summed_bytes(cm.graph, node), strict=True):
        if not split:
            per_action, per_batch = 0.0, 0.0
        elif microbatches:
            per_action, per_batch = cm._allreduce_s(nbytes * share / microbatches, group), 0.0
        else:  # an all-reduce as a + b * bytes: a per action, b * bytes over the batch
            per_action = cm._allreduce_s(1.0, group)
            per_batch = cm._allreduce_s(nbytes, group) - per_action
        f_tp = f * (1 + DTENSOR_FIXED_FACTOR) + ALLREDUCES_PER_PASS * per_action
        out.append((f_tp + (w - f) / (t if split else 1) + ALLREDUCES_PER_PASS * per_batch, f_tp))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def measured_tp_s(cm, node: str, device_type: str, group: Sequence[str]) -> tuple[float, float, float, float] | None:
    """The node's times on a group as the profiler measured them on a group of that type and
    size on one host (`Node.tp_s`), where the group is on one host too; else None. The group's
    own workers slowed each other while measured: that slowdown (`CostModel._corun_factor` of
    the group alone) is taken out, as the stage's replica puts in the plan's."""
    own = cm.measured_name(device_type)
    measured = cm.graph.by_id[node].tp_s.get(own, {}).get(len(group)) if own is not None else None
    if measured is None or len({cm.cluster.device(d).host for d in group}) > 1:
        return None
    alone = cm._corun_factor(group[0], group)
    return tuple(t / alone for t in measured)


def _summed_bytes(graph: Graph, node: str) -> tuple[float, float]:
    """The bytes of each all-reduce a split node runs in its forward (its output) and in its
    backward (the gradient of its input: the largest value it reads; its output where no edge
    says)."""
    out_bytes = float(graph.by_id[node].out_bytes)
    read = [graph.edge_bytes[(p, node)] for p in graph.predecessors(node)]
    return out_bytes, float(max(read, default=0) or out_bytes)


def tp_times_s(cm, nodes: Sequence[str], device_type: str, group: Sequence[str],
               microbatches: int | None = None, share: float = 1.0) -> tuple[float, float, float, float]:
    """Forward and backward of `nodes` for the whole batch on a group of devices of one type,
    and their fixed parts (`node_tp_times_s`)."""
    if len(group) == 1:
        return (*cm._stage_times_s(nodes, device_type), *cm._stage_fixed_s(nodes, device_type))
    times = [node_tp_times_s(cm, n, device_type, group, microbatches, share) for n in nodes]
    return tuple(math.fsum(t[i] for t in times) for i in range(4))


def node_tp_act_bytes(graph: Graph, node: str, t: int, sequence_parallel: bool = False) -> float:
    """The activations one device of a group of `t` keeps of a node for its backward, per batch:
    of a node that splits, its `act_split_share` split t ways (and its `act_sequence_share` with
    sequence parallelism, `Stage.sequence_parallel`) and the rest whole."""
    n = graph.by_id[node]
    if t == 1 or not n.tp_units:
        return float(n.act_bytes)
    split = n.act_split_share + (n.act_sequence_share if sequence_parallel else 0.0)
    return n.act_bytes * (1.0 - split + split / t)


def tp_act_bytes(graph: Graph, nodes: Sequence[str], t: int, sequence_parallel: bool = False) -> float:
    """`node_tp_act_bytes` of a stage's nodes, summed."""
    return math.fsum(node_tp_act_bytes(graph, n, t, sequence_parallel) for n in nodes)


def tp_bytes(graph: Graph, nodes: Sequence[str], t: int) -> tuple[int, int]:
    """The parameters and 16-bit weight copies each device of a group of `t` holds."""
    split = split_nodes(graph, nodes) if t > 1 else set()
    whole = [n for n in nodes if n not in split]
    params = graph.param_bytes_of(whole) + sum(graph.by_id[n].param_bytes for n in split) // t
    casts = graph.cast_bytes_of(whole) + sum(graph.by_id[n].cast_bytes for n in split) // t
    return params, casts
