"""Every cost formula of hetplan, each once, in a scalar form and an array form.

The event simulator, the fast path, dp, exact, local search, the RL environment, heterps and
scoring all call these; no other module turns bytes into seconds or works out a stage's memory
(a test over `src/` checks it). The array forms take numpy arrays of any broadcastable shape and
agree with the scalar forms element by element (`tests/test_cost_formulas.py`).

- Transfer (point to point): `latency + bytes / bandwidth`, nothing for no bytes. A cut between
  replicated stages moves its bytes over min(k, k') transfers at once (each device has one
  interface each way), within what the hosts' network interfaces carry (`shared_Bps`).
- All-reduce (ring, Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", 2009): 2 (r - 1) steps, each moving bytes / r over the ring's slowest link and
  paying its largest latency; nothing for one replica or no bytes.
- Gradient sum of a stage's replicas (`hetplan.runtime.gradients`): one all-reduce of the bytes
  the optimizer updates (dense parameters; of a table with sparse gradients only the rows the
  batch looked up), and for such tables two all-reduces before it: each replica's row count
  (`ROW_INDEX_BYTES` per replica) and the rows' indices (`ROW_INDEX_BYTES` per row); and on the
  host, the gradients copied into the all-reduced buffer and back (`gradient_pack_s`).
- Memory of a stage replica (DESIGN.md): `WEIGHT_COPIES` times its fp32 parameter bytes (weights,
  gradients, Adam's two fp32 moments; the moments an r-th where r replicas shard them, ZeRO-1:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  SC 2020), in mixed precision the 16-bit copies of its weights kept
  for the step (`Node.cast_bytes`), plus the activations it stashes at its peak: its
  activation bytes for the whole batch times the share of the batch in flight
  (`hetplan.schedule` says how many micro-batches a schedule holds).
- Compute: an action on a share of the batch costs its fixed part plus the rest of the batch's
  time scaled by the share (`action_s`).
- Optimizer-state sharding (ZeRO-1): a reduce-scatter of the gradients and an all-gather of the
  updated weights, both rings, move what the ring all-reduce moves in the same 2 (r - 1) steps
  (`allreduce_s` charges them); each replica's optimizer step updates an r-th of the weights.
- Optimizer step (Adam): `OPTIMIZER_PASSES` passes over the weights' bytes at the device's
  memory bandwidth, or, on a calibrated device, read off the times `hetplan calibrate` measured
  (`measured_s`; the same for an all-reduce measured by group size).
- Co-running: on a calibrated host, a CPU worker's compute takes `corun_factor` times as long
  when other CPU workers of the plan run on the same host (they share its memory bandwidth).
- Price: the devices' dollars per hour for the step's duration.
"""

from __future__ import annotations

import math

import numpy as np

OPTIMIZER_STATE_COPIES = 2  # Adam: first and second moments, fp32, each the size of the weights
WEIGHT_COPIES = 1 + 1 + OPTIMIZER_STATE_COPIES  # weights + gradients + optimizer state
# ZeRO's levels (`Stage.shard` 0-3), by level: of how many of those copies a replica keeps an r-th
# (1: Adam's moments; 2: the gradients too; 3: the weights too: `hetplan.runtime.zero`); how many
# copies of its largest node's parameters it holds whole while it gathers or reduces them (2: the
# node's gradients and the buffer they are reduce-scattered from; 3: the gathered weights too);
# and how many ring all-reduces' worth of the sharded bytes it moves per forward, per backward
# and after the step (2: a reduce-scatter per backward, the all-gather of the updated shares
# after the step; 3: an all-gather per forward, one and a reduce-scatter per backward, none after)
SHARDED_COPIES = (0, OPTIMIZER_STATE_COPIES, OPTIMIZER_STATE_COPIES + 1, OPTIMIZER_STATE_COPIES + 2)
UNIT_COPIES = (0, 0, 2, 3)
SHARD_RINGS = ((0.0, 0.0, 1.0), (0.0, 0.0, 1.0), (0.0, 0.5, 0.5), (0.5, 1.0, 0.0))
# An Adam step reads weights, gradients and both moments and writes weights and both moments:
# seven passes over the weights' bytes, bound by memory bandwidth.
OPTIMIZER_PASSES = 7
SECONDS_PER_HOUR = 3600.0
# The weights' share of the backward of a layer with weights, when a zero-bubble schedule splits
# the backward in two: a matmul's input gradient (dY W^T) and weight gradient (X^T dY) take the
# same FLOPs, and Qi et al. (2024) time the two as equal. A layer without weights has no weights'
# part; a stage whose inputs need no gradient (the first) has only that part.
WEIGHT_GRAD_SHARE = 0.5


# -- communication ---------------------------------------------------------------------------
def wire_s(nbytes, bandwidth_Bps):
    """Time on the wire of `nbytes` at `bandwidth_Bps`, without latency (numbers or arrays)."""
    return nbytes / bandwidth_Bps


def transfer_s(nbytes: float, bandwidth_Bps: float, latency_s: float) -> float:
    """One point-to-point transfer; nothing for no bytes."""
    if nbytes <= 0:
        return 0.0
    return latency_s + nbytes / bandwidth_Bps


def transfer_s_array(nbytes, bandwidth_Bps, latency_s) -> np.ndarray:
    """`transfer_s` element by element."""
    nbytes = np.asarray(nbytes, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(nbytes > 0, latency_s + wire_s(nbytes, bandwidth_Bps), 0.0)


def in_series(links) -> tuple[float, float]:
    """(bandwidth_Bps, latency_s) of one message that crosses `links` ((bandwidth_Bps, latency_s)
    each) one after the other, each whole before the next (a GPU's copy to the host, then gloo
    between two processes): their latencies add, and so do their seconds per byte."""
    links = list(links)
    return 1.0 / sum(1.0 / bw for bw, _ in links), sum(lat for _, lat in links)


ROW_INDEX_BYTES = 8  # an int64 row index or count, as the runtime sends them (`hetplan.runtime.gradients`)
# The runtime joins a replica's gradients into one buffer for the all-reduce and copies the sum
# back: a read and a write of the bytes each way. Measured on this VM's one-thread worker:
# 3.2 ms for the perceptron's 15.9 MB and 0.54 ms for gpt2-tiny's 3.6 MB, copies
# streaming at about twice the per-thread bandwidth Adam's step gets (the catalog's
# `mem_bw_Bps`); so two passes of it. Those figures included a third copy the runtime has since
# dropped (one part is all-reduced where it was joined); `bench/exchange_host_work.py --model
# mlp`, gradients made afresh before each sum as after a backward pass, measures 2.5-3.0 ms
# since (3.7-4.8 ms before): the two passes' 3.2 ms are 7-28% over it on this VM.
GRADIENT_PACK_PASSES = 2


def gradient_pack_s(nbytes, mem_bw_Bps: float):
    """The host's copies of `nbytes` of gradients into the all-reduced buffer and back (numbers
    or arrays; 0 where the bandwidth is unknown)."""
    return GRADIENT_PACK_PASSES * nbytes / mem_bw_Bps if mem_bw_Bps > 0 else 0.0 * nbytes


def allreduce_s(nbytes: float, replicas: int, bandwidth_Bps: float, latency_s: float) -> float:
    """Ring all-reduce of `nbytes` over `replicas` devices, the ring's slowest link's bandwidth
    and largest latency given."""
    if replicas < 2 or nbytes <= 0:
        return 0.0
    return 2 * (replicas - 1) * (latency_s + nbytes / replicas / bandwidth_Bps)


def pipedream_allreduce_s(nbytes, replicas: int, bandwidth_Bps: float):
    """The all-reduce PipeDream's optimizer charges a stage of `replicas` (Narayanan et al., SOSP
    2019; `optimizer_graph_hierarchical.py`): 4 (r - 1) / r of the bytes at the bandwidth, twice
    the ring's 2 (r - 1) / r (it counts each byte sent and received); no latency (numbers or
    arrays). The `throughput` objective asks PipeDream's question, so it uses PipeDream's formula."""
    if replicas < 2:
        return 0.0 * np.asarray(nbytes, dtype=float) if np.ndim(nbytes) else 0.0
    return 4.0 * (replicas - 1) / replicas * np.maximum(nbytes, 0.0) / bandwidth_Bps


def allreduce_s_array(nbytes, replicas, bandwidth_Bps, latency_s) -> np.ndarray:
    """`allreduce_s` element by element."""
    nbytes = np.asarray(nbytes, dtype=float)
    r = np.asarray(replicas, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ring = 2 * (r - 1) * (latency_s + nbytes / r / bandwidth_Bps)
    return np.where((r >= 2) & (nbytes > 0), ring, 0.0)


# -- memory ----------------------------------------------------------------------------------
def weight_bytes(param_bytes, cast_bytes=0, shards=1, sharded_bytes=None, level=1, unit_bytes=0):
    """What a replica holds for its weights whatever the batch (numbers or arrays): the weights,
    gradients and optimizer state of `param_bytes` of fp32 parameters, of `sharded_bytes` of them
    (default: all) an r-th of what ZeRO's `level` shards where `shards` replicas shard them
    (`SHARDED_COPIES`), plus the node of `unit_bytes` held whole meanwhile (`UNIT_COPIES`), and in
    mixed precision the 16-bit copies of the weights its products use, kept for the step
    (`cast_bytes`, `hetplan.precision`)."""
    sharded = param_bytes if sharded_bytes is None else sharded_bytes
    return (WEIGHT_COPIES * param_bytes - SHARDED_COPIES[level] * sharded * (1 - 1 / shards)
            + UNIT_COPIES[level] * unit_bytes + cast_bytes)


def held_memory_bytes(weights_bytes: float, activation_bytes: float) -> int:
    """Peak memory of a device: what it holds for its weights (`weight_bytes`, summed over its
    stages) plus the activations it holds at its peak."""
    return int(weights_bytes + math.ceil(activation_bytes))


def stage_memory_bytes(param_bytes: float, act_bytes: float, in_flight_share: float, cast_bytes: float = 0,
                       shards: int = 1, sharded_bytes: float | None = None, level: int = 1,
                       unit_bytes: float = 0) -> int:
    """Peak memory of a stage replica: what it holds for its weights (`weight_bytes`) plus its
    activations for the whole batch times the share of the batch it holds in flight at its peak."""
    return held_memory_bytes(weight_bytes(param_bytes, cast_bytes, shards, sharded_bytes, level, unit_bytes),
                             act_bytes * in_flight_share)


def stage_memory_bytes_array(param_bytes, act_bytes, in_flight_share, cast_bytes=0, shards=1) -> np.ndarray:
    """`stage_memory_bytes` element by element (as floats)."""
    return weight_bytes(np.asarray(param_bytes, dtype=float), cast_bytes, shards) + np.ceil(
        np.asarray(act_bytes, dtype=float) * in_flight_share)


def recompute_memory_bytes(param_bytes: float, input_bytes: float, act_bytes: float, in_flight_share: float,
                           largest_share: float, cast_bytes: float = 0, shards: int = 1,
                           sharded_bytes: float | None = None, level: int = 1, unit_bytes: float = 0) -> int:
    """Peak memory of a stage replica that recomputes its forward in its backward: what it holds
    for its weights, its inputs for the share of the batch in flight, and the activations of one
    micro-batch (the largest share), rebuilt while its backward runs."""
    return int(weight_bytes(param_bytes, cast_bytes, shards, sharded_bytes, level, unit_bytes)
               + math.ceil(input_bytes * in_flight_share + act_bytes * largest_share))


def activation_room_bytes(mem_bytes, param_bytes, cast_bytes=0, shards=1):
    """What a device has left for activations once a stage's weights are in (numbers or arrays;
    negative when they do not fit)."""
    return mem_bytes - weight_bytes(param_bytes, cast_bytes, shards)


# -- compute and price -----------------------------------------------------------------------
def action_s(fixed_s, scaled_s, share):
    """One forward or backward action on a share of the batch: its fixed part (calling the
    operators, whatever the size) plus the part that scales with the samples, `scaled_s` being
    that part for the whole batch (numbers or arrays)."""
    return fixed_s + scaled_s * share


def replica_passes_s(fwd_s, bwd_s, fwd_fixed_s, bwd_fixed_s, corun, action_overhead_s):
    """A stage replica's forward and backward as the runtime runs them, from its stage's times on
    the device's type for the whole batch and their fixed parts: the parts that scale with the
    samples and the fixed parts per action, each slowed by the co-running factor, the runtime's
    own cost per action added to the fixed parts (numbers or arrays). Returns (forward scaled,
    backward scaled, forward fixed, backward fixed), for `action_s`."""
    return ((fwd_s - fwd_fixed_s) * corun, (bwd_s - bwd_fixed_s) * corun,
            fwd_fixed_s * corun + action_overhead_s, bwd_fixed_s * corun + action_overhead_s)


def split_backward_s(bwd_scaled_s, bwd_fixed_s, weight_share, action_overhead_s):
    """A replica's backward run as two actions (a zero-bubble schedule: its inputs' gradients,
    then its weights'), from its backward as `replica_passes_s` gives it (the part that scales,
    the fixed part with the runtime's cost per action): the weights' action takes `weight_share`
    of both parts and each action pays the runtime's cost. Returns (inputs' scaled, inputs'
    fixed, weights' scaled, weights' fixed), for `action_s`."""
    fixed = bwd_fixed_s - action_overhead_s
    return ((1.0 - weight_share) * bwd_scaled_s, (1.0 - weight_share) * fixed + action_overhead_s,
            weight_share * bwd_scaled_s, weight_share * fixed + action_overhead_s)


def weight_share(bwd_weighted_s, bwd_s, first):
    """The part of a stage's backward that is its weights' gradients (numbers or arrays):
    `WEIGHT_GRAD_SHARE` of the backward of its nodes with weights (`bwd_weighted_s`) over its
    whole backward; all of it on the first stage (`first`), whose inputs need no gradient."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.asarray(bwd_s) > 0, WEIGHT_GRAD_SHARE * np.asarray(bwd_weighted_s) / np.asarray(bwd_s), 0.0)
    out = np.where(first, 1.0, ratio)
    return float(out) if out.ndim == 0 else out


def recomputed_backward_s(bwd_scaled_s, bwd_fixed_s, fwd_scaled_s, fwd_fixed_s, action_overhead_s):
    """A backward (or its inputs' half, I) that first runs the stage's forward again, from the
    passes as `replica_passes_s` gives them: the forward's parts added, the runtime's cost per
    action paid once. Returns (scaled, fixed)."""
    return bwd_scaled_s + fwd_scaled_s, bwd_fixed_s + fwd_fixed_s - action_overhead_s


def rerun_passes_s(rerun_s, rerun_fixed_s, corun, action_overhead_s):
    """What a per-node recomputation adds to a backward (`CostModel.rebuilt_forward_s`: the time
    for the whole batch and its fixed part), as `replica_passes_s` gives a forward: (scaled,
    fixed), for `recomputed_backward_s`."""
    return replica_passes_s(rerun_s, 0.0, rerun_fixed_s, 0.0, corun, action_overhead_s)[::2]


def replica_tail_s(optimizer_step_s, corun, step_overhead_s):
    """A stage replica's optimizer step, slowed by co-running, and the runtime's cost per step."""
    return optimizer_step_s * corun + step_overhead_s


def optimizer_s(param_bytes, mem_bw_Bps: float):
    """The optimizer step over `param_bytes` of weights on a device of `mem_bw_Bps` (numbers or
    arrays; 0 where the bandwidth is unknown)."""
    return OPTIMIZER_PASSES * param_bytes / mem_bw_Bps if mem_bw_Bps > 0 else 0.0 * param_bytes


def measured_s(x, points):
    """Seconds for `x` (bytes; a number or an array) read off measured `(x_k, seconds_k)` points:
    linear between neighbouring points; beyond the largest, along the last segment's line (the
    marginal cost per byte goes on); below the smallest, the larger of the first segment's line
    (a fixed cost such as latency) and the smallest point scaled down in proportion (a cost that
    shrinks with the size); with one point, in proportion. Never negative; 0 for x <= 0."""
    pts = sorted(points)
    xs = np.array([p[0] for p in pts], dtype=float)
    ys = np.array([p[1] for p in pts], dtype=float)
    x_arr = np.asarray(x, dtype=float)
    prop = x_arr * ys[0] / xs[0]
    if len(pts) == 1:
        out = prop
    else:
        inside = np.interp(x_arr, xs, ys)
        last = ys[-1] + (x_arr - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        first = np.maximum(ys[0] + (x_arr - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0]), prop)
        out = np.where(x_arr > xs[-1], last, np.where(x_arr < xs[0], first, inside))
    out = np.where(x_arr > 0, np.maximum(out, 0.0), 0.0)
    return float(out) if np.ndim(x) == 0 else out


def ring_scale(replicas, measured_replicas: int):
    """How an all-reduce's bytes on the wire grow from a measured group size to another: a ring
    moves 2 (r - 1) / r of the buffer through each worker (numbers or arrays)."""
    r = np.asarray(replicas, dtype=float)
    g = float(measured_replicas)
    return (r - 1) / r * g / (g - 1)


def corun_factor(busy_workers: int, slowdown_points) -> float:
    """How much longer a CPU worker's compute takes with `busy_workers` CPU workers of the plan
    on its host (itself included), from measured `(workers, factor)` points: linear between them,
    the last factor's growth per worker beyond, 1 for one worker or no points."""
    if busy_workers <= 1 or not slowdown_points:
        return 1.0
    pts = sorted({(1, 1.0), *((int(k), float(v)) for k, v in slowdown_points)})
    return max(1.0, float(measured_s(busy_workers, pts)))


def usd_per_step(usd_per_hour, step_s):
    """Price of a step of `step_s` on devices costing `usd_per_hour` in all (numbers or arrays)."""
    return usd_per_hour * step_s / SECONDS_PER_HOUR


# -- steady state (PipeDream's optimizer objective) --------------------------------------------
def steady_stage_s(compute_s, allreduce_s, replicas):
    """A stage's time per batch in PipeDream's steady state (Narayanan et al., SOSP 2019, its
    optimizer): the batch's compute on the replicas together plus the all-reduce shared among
    the replicas, which take turns (numbers or arrays)."""
    return compute_s + allreduce_s / replicas


def steady_cut_s(nbytes, bandwidth_Bps, lanes=1):
    """A cut's time per batch in that steady state: activations forward and gradients back,
    at `bandwidth_Bps` (a cut's, `shared_Bps`), or over `lanes` parallel links of that bandwidth
    (numbers or arrays)."""
    return 2.0 * wire_s(nbytes, bandwidth_Bps * lanes)


def shared_Bps(link_Bps, lanes, cap_Bps=math.inf):
    """The bandwidth of a cut between two stages: as many transfers at once as the narrower side
    has replicas (each device sends and receives through one interface), each at the slowest
    link's bandwidth, and no more than the hosts' network interfaces it crosses carry together
    (`cap_Bps`) (numbers or arrays)."""
    return np.minimum(np.multiply(link_Bps, lanes, dtype=float), cap_Bps)
