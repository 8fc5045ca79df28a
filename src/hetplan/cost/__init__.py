"""Cost model: node times on device types, transfers, all-reduce, memory and price.

Node time on a device type is the measured time when the graph carries that type. Otherwise it
is projected from a measured type with the roofline model of `hetplan.cost.projection` (calibrated
per node by the time measured on the source type; see there how far off it can be). A measured
type of the same kind (GPU or CPU) as the target is preferred as the source.

Memory on a device under a schedule (DESIGN.md): parameters + gradients + Adam's two fp32
moments (4x the parameter bytes) + in mixed precision the 16-bit copies of the weights kept for
the step (`Node.cast_bytes`) + the activations stashed for the micro-batches in flight
(`hetplan.schedule`: GPipe keeps all m of them, 1F1B at most `stages - stage_index`).

Every formula (transfer, all-reduce, memory, optimizer step, price) is written once, in
`hetplan.cost.formulas`, in a scalar and an array form; this class applies them to a graph and
a cluster.

The simulators (`hetplan.sim`) put these costs together into the timeline of a training step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hetplan import catalog
from hetplan.catalog import DeviceType
from hetplan.cluster import Cluster
from hetplan.cost import formulas, network
from hetplan.cost.formulas import WEIGHT_COPIES, weight_bytes
from hetplan.cost.projection import project_s
from hetplan.cost.syncs import own_bytes
from hetplan.cost.tensor import node_tp_act_bytes, tp_bytes, tp_times_s
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.plan import Plan
from hetplan.rows import StepRows, microbatch_rows, stage_slices, step_rows
from hetplan.schedule import inflight_microbatches


def microbatch_fractions(batch_size: int, microbatches: int) -> tuple[float, ...]:
    """Each micro-batch's share of the batch, split as torch.tensor_split splits it: sizes
    differ by at most one, the larger ones first."""
    return tuple(n / batch_size for n in microbatch_rows(batch_size, microbatches))


def in_flight_share(schedule: str, stages: int, stage_index: int, batch_size: int, microbatches: int) -> float:
    """The share of the batch whose activations a stage on one device holds at its peak: its
    first micro-batches in flight, the largest ones."""
    held = inflight_microbatches(schedule, stages, stage_index, microbatches)
    return math.fsum(microbatch_fractions(batch_size, microbatches)[:held])


__all__ = ["WEIGHT_COPIES", "CostModel", "formulas", "in_flight_share", "inflight_microbatches",
           "microbatch_fractions", "usd_per_step", "weight_bytes"]


# `CostModel.kept` keeps this much: for the simulator's lists, ops (~0.5 kB each; an 8 x 64
# chain's step has 3,000, a 128-GPU plan of 16 replicas a stage and 128 micro-batches 100,000)
KEPT = 200_000


@dataclass(frozen=True)
class CostModel:
    """Costs of a graph's nodes on a cluster's devices."""

    graph: Graph
    cluster: Cluster

    def _type(self, name: str) -> DeviceType | None:
        return self.cluster.types.get(name) or catalog.find(name)

    @cached_property
    def _measured_types(self) -> tuple[tuple[str, DeviceType], ...]:
        """(the graph's name, the device type) of each type the graph has times for: a name may be
        an alias ('cpu' is the catalog's cpu-1t), and the node times are keyed by the graph's."""
        found = tuple((n, t) for n, t in ((n, self._type(n)) for n in self.graph.device_types) if t is not None)
        if not found:
            raise HetplanError(
                f"graph {self.graph.name!r} was profiled on {self.graph.profiled_on!r}, which is not "
                f"a known device type, so its times cannot be carried to other devices; profile on "
                f"the cluster's device types or add the type to the cluster file"
            )
        return found

    def _source_type(self, target: DeviceType) -> tuple[str, DeviceType]:
        same_kind = [(n, t) for n, t in self._measured_types if t.kind == target.kind]
        return (same_kind or list(self._measured_types))[0]

    def measured_name(self, device_type: str) -> str | None:
        """The graph's name for a device type it has times for: the type itself, or an alias of
        it (a graph timed as 'cpu' has cpu-1t's times), else None."""
        if device_type in self.graph.device_types:
            return device_type
        target = self._type(device_type)
        return next((n for n, t in self._measured_types if target is not None and t.name == target.name), None)

    def projected_types(self) -> dict[str, str]:
        """The cluster's device types the graph has no times for, each with the measured type
        its times are projected from (roofline model, `hetplan.cost.projection`)."""
        out = {}
        for dev in self.cluster.devices:
            target = self._type(dev.type)
            if target is not None and self.measured_name(dev.type) is None:
                out[dev.type] = self._source_type(target)[0]
        return out

    @cached_property
    def _traffic_bytes(self) -> dict[str, int]:
        """Bytes a node reads and writes once: its parameters, inputs and outputs."""
        traffic = {n.id: n.param_bytes + n.out_bytes for n in self.graph.nodes}
        for e in self.graph.edges:
            traffic[e.dst] += e.bytes
        return traffic

    @cached_property
    def _node_times(self) -> dict[str, dict[str, tuple[float, float]]]:
        return {}  # device type -> node id -> (fwd, bwd); filled on first use of each type

    def _node_times_s(self, device_type: str) -> dict[str, tuple[float, float]]:
        """Forward and backward time of every node on a device type (measured or projected)."""
        if device_type in self._node_times:
            return self._node_times[device_type]
        graph, own = self.graph, self.measured_name(device_type)
        if own is not None:
            times = {n.id: (n.fwd_s[own], n.bwd_s[own]) for n in graph.nodes}
        else:
            target = self._type(device_type)
            if target is None:
                raise HetplanError(f"unknown device type {device_type!r}")
            name, src = self._source_type(target)
            traffic = self._traffic_bytes
            # a node that runs on the host takes its measured time on any device type
            times = {
                n.id: (n.fwd_s[name], n.bwd_s[name]) if n.runs_on_host else
                      (project_s(n.fwd_s[name], n.flops, traffic[n.id], src, target, graph.precision),
                       project_s(n.bwd_s[name], n.flops, traffic[n.id], src, target, graph.precision))
                for n in graph.nodes
            }
        self._node_times[device_type] = times
        return times

    @cached_property
    def _node_fixed(self) -> dict[str, dict[str, tuple[float, float]]]:
        return {}  # device type -> node id -> (fwd, bwd) fixed parts; filled on first use of each type

    def _node_fixed_s(self, device_type: str) -> dict[str, tuple[float, float]]:
        """The parts of every node's forward and backward passes that do not shrink with the
        micro-batch, on a device type: measured by the profiler there, 0 where it was not (a
        projected type has none: the roofline projection covers the whole time)."""
        if device_type not in self._node_fixed:
            own = self.measured_name(device_type)
            self._node_fixed[device_type] = {
                n.id: (n.fwd_fixed_s.get(own, 0.0) if own else 0.0,
                       n.bwd_fixed_s.get(own, 0.0) if own else 0.0) for n in self.graph.nodes}
        return self._node_fixed[device_type]

    @cached_property
    def _kept(self) -> dict[tuple, object]:
        """`kept`'s, oldest first."""
        return {}

    @cached_property
    def _stage_sums(self) -> dict[tuple, object]:
        return {}  # (what, nodes, ...) -> a sum over a stage's nodes; planners ask the same stages often

    def _summed(self, key: tuple, make):
        if key not in self._stage_sums:
            self._stage_sums[key] = make()
        return self._stage_sums[key]

    def _stage_fixed_s(self, nodes: Sequence[str], device_type: str) -> tuple[float, float]:
        """`node_fixed_s` summed over a stage's nodes."""
        fixed = self._node_fixed_s(device_type)
        return self._summed(("fixed", tuple(nodes), device_type), lambda: (
            math.fsum(fixed[n][0] for n in nodes), math.fsum(fixed[n][1] for n in nodes)))

    def _stage_times_s(self, nodes: Sequence[str], device_type: str) -> tuple[float, float]:
        """Forward and backward time of a set of nodes on a device type, for the whole batch."""
        times = self._node_times_s(device_type)
        return self._summed(("times", tuple(nodes), device_type), lambda: (
            math.fsum(times[n][0] for n in nodes), math.fsum(times[n][1] for n in nodes)))

    def rebuilt_forward_s(self, nodes: Sequence[str], device_type: str, unit: str) -> tuple[float, float]:
        """The time recomputing at `unit` adds to a backward, for the whole batch, and its fixed
        part: each node's forward times its `Node.rerun`."""
        times, fixed, by_id = self._node_times_s(device_type), self._node_fixed_s(device_type), self.graph.by_id
        return self._summed(("rebuilt", tuple(nodes), device_type, unit), lambda: (
            math.fsum(by_id[n].rerun(unit) * times[n][0] for n in nodes),
            math.fsum(by_id[n].rerun(unit) * fixed[n][0] for n in nodes)))

    def _stage_weight_share(self, nodes: Sequence[str], device_type: str, first: bool) -> float:
        """`formulas.weight_share` of a stage, when a schedule splits its backward."""
        times, by_id = self._node_times_s(device_type), self.graph.by_id
        return formulas.weight_share(math.fsum(times[n][1] for n in nodes if by_id[n].param_bytes > 0),
                                     math.fsum(times[n][1] for n in nodes), first)

    def whole_graph_s(self, device_type: str) -> float:
        """Forward + backward time of the whole graph on one device of a type, for the batch."""
        return math.fsum(self._stage_times_s(self.graph.topo_order, device_type))

    def fastest_type(self) -> str:
        """The cluster's device type that runs the whole graph fastest (ties: by name)."""
        return min(sorted({d.type for d in self.cluster.devices}), key=self.whole_graph_s)

    def _device_stage_s(self, nodes: Sequence[str], device_id: str) -> float:
        fwd, bwd = self._stage_times_s(nodes, self.cluster.device(device_id).type)
        return fwd + bwd

    def _measured_optimizer_s(self, device_type: str) -> dict[str, float] | None:
        """Per node, its optimizer step as the profiler measured it on this device type (0 for a
        node without parameters), or None if the graph has none measured there. Measured steps
        take precedence over `optimizer_s`: they include the cost per tensor (SparseAdam on a
        table's looked-up rows) that a formula of the bytes misses."""
        if device_type not in self._opt_measured:
            nodes, own = self.graph.nodes, self.measured_name(device_type) or device_type
            self._opt_measured[device_type] = ({n.id: n.opt_s.get(own, 0.0) for n in nodes}
                                               if any(own in n.opt_s for n in nodes) else None)
        return self._opt_measured[device_type]

    @cached_property
    def _opt_measured(self) -> dict[str, dict[str, float] | None]:
        return {}  # device type -> `measured_optimizer_s`; filled on first use of each type

    def _stage_optimizer_s(self, nodes: Sequence[str], device_id: str) -> float:
        """The optimizer step of these nodes' parameters on a device: measured by the profiler
        on its type, else `optimizer_s` of the bytes it updates."""
        measured = self._measured_optimizer_s(self.cluster.device(device_id).type)
        return self._optimizer_step_s(self._optimizer_bytes(nodes), device_id,
                                     None if measured is None else math.fsum(measured[n] for n in nodes))

    def _optimizer_step_s(self, updated_bytes, device_id: str, measured_s=None):
        """A stage's optimizer step (numbers or arrays): `measured_s`, the profiler's measured
        steps summed over its nodes on the device's type, where there are some; else
        `optimizer_s` of the bytes it updates. The one place that rule is written: the
        simulator, the fast path and dp's program all come here."""
        return self._optimizer_s(updated_bytes, device_id) if measured_s is None else measured_s

    def _optimizer_bytes(self, nodes: Sequence[str]) -> int:
        """The parameter bytes the optimizer step of these nodes updates (`Node.optimizer_bytes`:
        only the looked-up rows of a table with sparse gradients; a tied parameter once)."""
        by_id = self.graph.by_id
        return self._summed(("updated", tuple(nodes)), lambda: max(
            0, sum(by_id[n].optimizer_bytes for n in nodes) - self.graph.tied_excess_bytes(nodes)))

    def _index_bytes(self, nodes: Sequence[str]) -> int:
        """The bytes of the row indices the replicas of these nodes exchange per step: one int64 per
        row the batch looked up in their tables with sparse gradients (`Node.sparse_rows`)."""
        by_id = self.graph.by_id
        return self._summed(("indices", tuple(nodes)), lambda: formulas.ROW_INDEX_BYTES * sum(
            by_id[n].sparse_rows for n in nodes))

    def _gradient_sync_s(self, updated_bytes, index_bytes, devices: Sequence[str]):
        """The sum of a stage's replicas' gradients as the runtime makes it, for numbers or arrays
        (`hetplan.runtime.gradients`): an all-reduce of the bytes the optimizer updates
        (`optimizer_bytes`: the looked-up rows of a table with sparse gradients, not the table),
        and where there are such rows (`index_bytes` > 0) two before it, of each replica's row
        count and of the rows' indices; and the copies of the bytes into the all-reduced buffer
        and back on the slowest replica (`formulas.gradient_pack_s`)."""
        ar = self._allreduce_s(updated_bytes, devices)
        if len(devices) < 2:
            return ar
        ar = ar + formulas.gradient_pack_s(updated_bytes, self._slowest_mem_bw_Bps(tuple(devices)))
        rows = self._allreduce_s(index_bytes, devices) + self._allreduce_s(
            float(formulas.ROW_INDEX_BYTES * len(devices)), devices)
        if np.ndim(index_bytes) or np.ndim(updated_bytes):
            return ar + np.where(np.asarray(index_bytes) > 0, rows, 0.0)
        return ar + (rows if index_bytes > 0 else 0.0)

    def _slowest_mem_bw_Bps(self, devices: tuple[str, ...]) -> float:
        """The lowest memory bandwidth among `devices`' types; 0 if one is unknown."""
        if devices not in self._mem_bw:
            types = [self._type(self.cluster.device(d).type) for d in devices]
            self._mem_bw[devices] = min(t.mem_bw_Bps if t is not None else 0.0 for t in types)
        return self._mem_bw[devices]

    @cached_property
    def _mem_bw(self) -> dict[tuple[str, ...], float]:
        return {}

    def _stage_sync_s(self, nodes: Sequence[str], devices: Sequence[str]) -> float:
        """`gradient_sync_s` of a stage of these nodes over its replicas `devices`."""
        return self._gradient_sync_s(self._optimizer_bytes(nodes), self._index_bytes(nodes), devices)

    def _optimizer_s(self, param_bytes, device_id: str):
        """Time of the optimizer step over `param_bytes` of weights (a number or an array) on a
        device: read off what `hetplan calibrate` measured there, else Adam's memory-bound
        formula on its type. Pass `optimizer_bytes`, not the parameters' size: sparse
        gradients update fewer."""
        dev = self.cluster.device(device_id)
        if dev.optimizer_points:
            return formulas.measured_s(param_bytes, dev.optimizer_points)
        t = self._type(dev.type)
        return formulas.optimizer_s(param_bytes, t.mem_bw_Bps) if t is not None else 0.0 * param_bytes

    def _corun_factor(self, device_id: str, used: Sequence[str]) -> float:
        """How much longer a device's compute takes beside the other CPU devices of `used` on its
        host (a calibrated cluster's `corun_slowdown`; 1 for a GPU or an uncalibrated cluster)."""
        cal = self.cluster.calibration
        dev = self.cluster.device(device_id)
        if cal is None or not cal.corun_slowdown or not self._is_cpu(device_id):
            return 1.0
        busy = {d for d in used if self.cluster.device(d).host == dev.host and self._is_cpu(d)}
        return formulas.corun_factor(len(busy | {device_id}), cal.corun_slowdown)

    def _is_cpu(self, device_id: str) -> bool:
        t = self._type(self.cluster.device(device_id).type)
        return t is not None and t.kind == "cpu"

    def _transfer_s(self, nbytes: float, src: str, dst: str) -> float:
        link = self.cluster.link(src, dst)
        return formulas.transfer_s(nbytes, link.bandwidth_Bps, link.latency_s)

    def _ring_link(self, devices: Sequence[str]) -> tuple[float, float]:
        """(slowest bandwidth, largest latency) of the ring through `devices` in order."""
        r = len(devices)
        ring = [self.cluster.link(devices[i], devices[(i + 1) % r]) for i in range(r)]
        return min(link.bandwidth_Bps for link in ring), max(link.latency_s for link in ring)

    def _allreduce_s(self, nbytes, devices: Sequence[str]):
        """All-reduce of `nbytes` (a number or an array) over `devices`: read off the calibrated
        curve of the nearest group size (scaled by `formulas.ring_scale`) when all are on one
        host of a calibrated cluster, else the ring formula over the ring's links."""
        if len(devices) < 2:
            return 0.0 * nbytes
        curve = self._allreduce_curve(devices)
        if curve is not None:
            return formulas.measured_s(nbytes * formulas.ring_scale(len(devices), curve.replicas), curve.points)
        if np.ndim(nbytes):
            return formulas.allreduce_s_array(nbytes, len(devices), *self._ring_link(devices))
        return formulas.allreduce_s(nbytes, len(devices), *self._ring_link(devices))

    def _allreduce_curve(self, devices: Sequence[str]):
        """The calibrated all-reduce curve that applies to `devices` (nearest group size, fewer
        on a tie), or None: no calibration, or devices on several hosts."""
        cal = self.cluster.calibration
        if cal is None or not cal.allreduce or len({self.cluster.device(d).host for d in devices}) > 1:
            return None
        return min(cal.allreduce, key=lambda c: (abs(c.replicas - len(devices)), c.replicas))

    def _replica_shares(self, nodes: Sequence[str], devices: Sequence[str]) -> dict[str, float]:
        """Share of each micro-batch given to each replica: in proportion to its speed, so that
        all replicas finish together (the weights of `hetplan.rows.split_rows`)."""
        speed = {d: 1.0 / max(self._device_stage_s(nodes, d), 1e-30) for d in devices}
        total = math.fsum(speed.values())
        return {d: s / total for d, s in speed.items()}

    def _stage_weights(self, nodes: Sequence[str], devices: Sequence[str]) -> tuple[float, ...]:
        """A stage's replicas' weights in device order (1.0 for a stage on one device)."""
        if len(devices) < 2:
            return (1.0,)
        shares = self._replica_shares(nodes, devices)
        return tuple(shares[d] for d in devices)

    def _group_weights(self, nodes: Sequence[str], groups: Sequence[Sequence[str]]) -> tuple[float, ...]:
        """`stage_weights` of replicas that may be tensor-parallel groups (`hetplan.cost.tensor`):
        in proportion to each group's speed on the stage."""
        if all(len(g) == 1 for g in groups):
            return self._stage_weights(nodes, [g[0] for g in groups])
        speed = [1.0 / max(math.fsum(tp_times_s(self, nodes, self.cluster.device(g[0]).type, g)[:2]), 1e-30)
                 for g in groups]
        return tuple(s / math.fsum(speed) for s in speed)

    def replica_weights(self, plan: Plan) -> tuple[tuple[float, ...], ...]:
        """Per stage, its replicas' weights (`group_weights`)."""
        return tuple(self._group_weights(s.nodes, s.groups) for s in plan.stages)

    def sync_costs(self, plan: Plan):
        """The plan's gradient sums in the order every rank runs them (`hetplan.cost.syncs`)."""
        from hetplan.cost.syncs import plan_syncs

        return plan_syncs(self, plan)

    def kept(self, key: tuple, make: Callable[[], object], size: Callable[[object], int] = lambda _: 1) -> object:
        """`make()`, kept under `key` for the model's life with the last others whose `size`s add
        up to `KEPT` at most (one bigger than that is made each time, never kept): what planners
        ask of many plans of one shape (the simulator's lowered lists, `sim.step_lists`, sized by
        their ops)."""
        if key in self._kept:
            return self._kept[key][0]
        made = make()
        weight = size(made)
        if weight <= KEPT:
            while self._kept and sum(w for _, w in self._kept.values()) + weight > KEPT:
                del self._kept[next(iter(self._kept))]
            self._kept[key] = (made, weight)
        return made

    def plan_rows(self, plan: Plan) -> StepRows:
        """The rows of every stage replica and micro-batch of the plan (`hetplan.rows`)."""
        return step_rows(self.graph.batch_size, plan.microbatches, self.replica_weights(plan), self._slices)

    def _slices(self, micro: tuple[int, ...], weights: tuple[float, ...]):
        """`hetplan.rows.stage_slices`, kept: planners ask for the same stages' rows often."""
        return self._summed(("slices", micro, weights), lambda: stage_slices(micro, weights))

    def stage_memory_bytes(self, plan: Plan, stage_index: int, device_id: str) -> int:
        """Peak memory of one replica of a stage under the plan's schedule: at its peak a stage
        holds micro-batches 0 .. held-1, the largest ones."""
        return self.stage_replicas_memory_bytes(plan, stage_index)[device_id]

    def stage_replicas_memory_bytes(self, plan: Plan, stage_index: int) -> dict[str, int]:
        """`stage_memory_bytes` of every replica of a stage, by device id."""
        stage = plan.stages[stage_index]
        sharding = {"shards": len(stage.devices), "sharded_bytes": self.sharded_bytes(plan, stage_index),
                    "level": stage.shard or 1, "unit_bytes": self.shard_unit_bytes(plan, stage_index)}
        # each device of a tensor-parallel group holds its share of the weights (`cost.tensor`)
        held_w = {t: tp_bytes(self.graph, stage.nodes, t) for t in set(stage.degrees)}
        held_a = {t: self.held_bytes(plan, stage_index, t) for t in set(stage.degrees)}
        # this stage's split only: planners ask this per stage and device, in loops
        rows = step_rows(self.graph.batch_size, plan.microbatches, [self._group_weights(stage.nodes, stage.groups)],
                         self._slices)
        held = inflight_microbatches(plan.schedule, len(plan.stages), stage_index, plan.microbatches, plan.ranks)

        def share(p: int, micro: range) -> float:
            return sum(rows.rows(0, j, p) for j in micro) / self.graph.batch_size

        def need(p: int, group: Sequence[str]) -> int:
            params, casts = held_w[len(group)]
            kept, rebuilt = held_a[len(group)]
            if stage.recomputes:
                return formulas.recompute_memory_bytes(params, kept, rebuilt, share(p, range(held)), share(p, range(1)),
                                                       cast_bytes=casts, **sharding)
            return formulas.stage_memory_bytes(params, kept, share(p, range(held)), cast_bytes=casts, **sharding)

        return {dev: need(p, group) for p, group in enumerate(stage.groups) for dev in group}

    def sharded_bytes(self, plan: Plan, k: int) -> int:
        """The parameter bytes whose optimizer state stage k's replicas shard (`Stage.shard`):
        those its own gradient sum covers (not a tied parameter other stages also use, which is
        summed with them); 0 for a stage that does not shard."""
        stage = plan.stages[k]
        if not stage.shard or len(set(stage.devices)) < 2:
            return 0
        return own_bytes(self, plan, k)[0]

    def shard_unit_bytes(self, plan: Plan, k: int) -> int:
        """The parameters of stage k's largest node, which its replicas hold whole while they gather
        or reduce them where they shard gradients (`Stage.shard` 2 or 3); else 0."""
        stage = plan.stages[k]
        if stage.shard < 2 or not self.sharded_bytes(plan, k):
            return 0
        return max(self.graph.param_bytes_of((n,)) for n in stage.nodes)

    def shard_passes_s(self, plan: Plan, k: int) -> tuple[float, float]:
        """What each forward and each backward of a replica of stage k adds for its replicas'
        collectives where they shard gradients or parameters (`formulas.SHARD_RINGS`: all-gathers
        and reduce-scatters of each node's parameters, rings as the step's gradient sum)."""
        stage = plan.stages[k]
        if stage.shard < 2 or not self.sharded_bytes(plan, k):
            return 0.0, 0.0
        # a ring per node (`runtime.zero`'s units): each pays the ring's latency
        workers = tuple(dict.fromkeys(stage.devices))
        ring = sum(float(self._gradient_sync_s(self.graph.param_bytes_of((n,)), 0, workers)) for n in stage.nodes)
        fwd, bwd, _ = formulas.SHARD_RINGS[stage.shard]
        return fwd * ring, bwd * ring

    def replica_optimizer_s(self, plan: Plan, k: int, device_id: str) -> float:
        """The optimizer step of one replica of stage k: `stage_optimizer_s`, of an r-th of the
        sharded parameters where its replicas shard them (Adam's time is its bytes')."""
        nodes = plan.stages[k].nodes
        whole = self._stage_optimizer_s(nodes, device_id)
        sharded = self.sharded_bytes(plan, k)
        if not sharded:
            return whole
        updated = self._optimizer_bytes(nodes)
        return whole * (1.0 - (1.0 - 1.0 / len(plan.stages[k].devices)) * sharded / updated) if updated else whole

    def held_bytes(self, plan: Plan, k: int, degree: int = 1) -> tuple[float, float]:
        """What a device of a replica of stage k (a tensor-parallel group of `degree`: its share of
        the activations, `cost.tensor.node_tp_act_bytes`) holds per batch between its forward and
        its backward, and what (more) its backward holds per batch while it runs, by its
        `Stage.recompute`: "none", its activations
        and nothing more; "stage", the tensors it received (the cut before it, relayed ones
        included) and those it made for the next stage (the cut after it), then all its
        activations rebuilt; "block", the cut before it and every node's output that is read
        (`Graph.read_bytes`: each checkpointed node's input), then the largest node's activations
        rebuilt; "selective", as "block" and what each node keeps of its products, then the most
        a node builds again (`Node.selective_bytes`)."""
        stage = plan.stages[k]
        acts = [node_tp_act_bytes(self.graph, n, degree, stage.sequence_parallel) for n in stage.nodes]
        before = self.cut_bytes(plan, k - 1) if k > 0 else 0.0
        read = math.fsum(self.graph.read_bytes[n] for n in stage.nodes)
        if stage.recompute == "block":
            return before + read, float(max(acts))
        if stage.recompute == "selective":
            kept, again = zip(*(self.graph.by_id[n].selective_bytes() for n in stage.nodes), strict=True)
            return before + read + math.fsum(kept), max(again)
        if stage.recompute == "stage":
            return before + (self.cut_bytes(plan, k) if k < len(plan.stages) - 1 else 0.0), float(sum(acts))
        return float(sum(acts)), 0.0

    def _stage_compute_s(self, nodes: Sequence[str], devices: Sequence[str]) -> float:
        """Forward + backward of the batch on a stage's replicas together (each its share)."""
        return 1.0 / math.fsum(1.0 / max(self._device_stage_s(nodes, d), 1e-30) for d in devices)

    def cut_bytes(self, plan: Plan, k: int) -> int:
        """Bytes crossing the cut after stage k, forward: the edges from before it to after it
        (relayed), each source's tensors once (`Graph.crossing_bytes`), as the simulator's `relay`
        routing, dp and the fast path count them."""
        where = plan.stage_of()
        return self.graph.crossing_bytes(e for e in self.graph.edges if where[e.src] <= k < where[e.dst])

    def _slowest_Bps(self, senders: Sequence[str], receivers: Sequence[str]) -> float:
        """`network.slowest_Bps`: the slowest link from any of `senders` to any of `receivers`."""
        return network.slowest_Bps(self.cluster, senders, receivers)

    def _nic_cap_Bps(self, senders: Sequence[str], receivers: Sequence[str]) -> float:
        """`network.nic_cap_Bps`: what the hosts' network interfaces carry at once between them."""
        return network.nic_cap_Bps(self.cluster, senders, receivers)

    def _cut_Bps(self, senders: Sequence[str], receivers: Sequence[str]) -> float:
        """`network.cut_Bps`: min(k, k') transfers at once at the slowest link, within the NICs."""
        return network.cut_Bps(self.cluster, senders, receivers)

    def _routed_cut_s(self, senders: Sequence[str], receivers: Sequence[str],
                     sender_weights: Sequence[float] | None = None,
                     receiver_weights: Sequence[float] | None = None) -> float:
        """`network.routed_cut_s`: seconds a byte of a micro-batch takes across the cut, routed
        as the runtime routes rows."""
        return network.routed_cut_s(self.cluster, senders, receivers, sender_weights, receiver_weights)

    def _busiest_interface_s(self, pair_bytes: Mapping[tuple[str, str], float]) -> float:
        """`network.busiest_interface_s`: how long the busiest interface carries `pair_bytes`."""
        return network.busiest_interface_s(self.cluster, pair_bytes)

    def _steady_sync_s(self, updated_bytes, devices: Sequence[str]):
        """A stage's gradient sum as PipeDream's optimizer charges it, for the `throughput`
        objective (`formulas.pipedream_allreduce_s` over the ring's slowest link; numbers or
        arrays), or as `hetplan calibrate` measured it where a calibrated curve applies (a
        measurement is what it is). The step (`time`, the simulator, the runtime) charges
        `gradient_sync_s`."""
        if len(devices) < 2:
            return 0.0 * updated_bytes
        if self._allreduce_curve(devices) is not None:
            return self._allreduce_s(updated_bytes, devices)
        return formulas.pipedream_allreduce_s(updated_bytes, len(devices), self._ring_link(devices)[0])

    def bottleneck_s(self, plan: Plan) -> float:
        """PipeDream's steady-state time per batch (the `throughput` objective): the slowest of
        every stage (`formulas.steady_stage_s`, its gradient sum as PipeDream charges it:
        `steady_sync_s`) and every cut (`formulas.steady_cut_s` at `cut_Bps`: the slowest link
        between the two stages' devices, whatever their order, over the narrower side's
        interfaces, within the hosts' network interfaces)."""
        worst = 0.0
        for st in plan.stages:
            sync = self._steady_sync_s(self._optimizer_bytes(st.nodes), st.devices)
            worst = max(worst, formulas.steady_stage_s(self._stage_compute_s(st.nodes, st.devices), sync,
                                                       len(st.devices)))
        for k, (a, b) in enumerate(zip(plan.stages, plan.stages[1:], strict=False)):
            worst = max(worst, formulas.steady_cut_s(self.cut_bytes(plan, k), self._cut_Bps(a.devices, b.devices)))
        return worst

    def usd_per_step(self, devices: Sequence[str], step_s: float) -> float:
        return usd_per_step(self.cluster, devices, step_s)


def calibrated_figures(report: Mapping, allreduce_bytes: float, optimizer_bytes: float) -> tuple[dict, dict]:
    """What a calibration's measured curves (`hetplan calibrate`'s report) charge: an all-reduce
    of `allreduce_bytes` by group size, and an optimizer step over `optimizer_bytes` by device
    (`formulas.measured_s`, as the cost model reads them)."""
    allreduce = {r: float(formulas.measured_s(allreduce_bytes, list(points.items())))
                 for r, points in report["allreduce"].items()}
    optimizer = {d: float(formulas.measured_s(optimizer_bytes, points))
                 for d, points in report["optimizer_points"].items()}
    return allreduce, optimizer


def usd_per_step(cluster: Cluster, devices: Sequence[str], step_s: float) -> float:
    """The price of a step of `step_s` on `devices` (a measured step needs no graph)."""
    return formulas.usd_per_step(math.fsum(cluster.device(d).usd_per_hour for d in devices), step_s)
