"""Cost model: node times on device types, transfers, all-reduce, memory, price, and the
closed-form (analytic) estimate of a plan's training step.

Node time on a device type is the measured time when the graph carries that type. Otherwise it
is projected from a measured type with the roofline model of `hetplan.projection` (calibrated
per node by the time measured on the source type; see there how far off it can be). A measured
type of the same kind (GPU or CPU) as the target is preferred as the source.

Memory on a device under a schedule (DESIGN.md): parameters + gradients + Adam's two fp32
moments (4x the parameter bytes) + the activations stashed for the micro-batches in flight:
GPipe keeps all m of them, 1F1B at most `stages - stage_index` (and never more than m).

`analytic_estimate` scores a plan with the flushed-pipeline formula: with per-micro-batch stage
times u_i (forward + backward) and link times c_k between consecutive stages,

    step = sum_i u_i + 2 * sum_k c_k + (m - 1) * max(max_i u_i, max_k c_k) + max_i allreduce_i

Stages are taken as a chain: a tensor that skips stages is charged on every boundary it crosses
(the runtime passes it through). It assumes communication overlaps computation in the steady
state and that the forward and backward transfers use opposite directions of a link. The
event-driven simulator replaces it for exact timelines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from hetplan import catalog
from hetplan.catalog import DeviceType
from hetplan.cluster import Cluster
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.plan import Estimate, Plan
from hetplan.projection import project_s
from hetplan.units import fmt_bytes

OPTIMIZER_STATE_COPIES = 2  # Adam: first and second moments, fp32, each the size of the weights
WEIGHT_COPIES = 1 + 1 + OPTIMIZER_STATE_COPIES  # weights + gradients + optimizer state


def inflight_microbatches(schedule: str, stages: int, stage_index: int, microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, stages - stage_index)
    raise HetplanError(f"unknown schedule {schedule!r}")


@dataclass(frozen=True)
class CostModel:
    """Costs of a graph's nodes on a cluster's devices."""

    graph: Graph
    cluster: Cluster

    def _type(self, name: str) -> DeviceType | None:
        return self.cluster.types.get(name) or catalog.find(name)

    @cached_property
    def _measured_types(self) -> tuple[DeviceType, ...]:
        found = tuple(t for t in (self._type(n) for n in self.graph.device_types) if t is not None)
        if not found:
            raise HetplanError(
                f"graph {self.graph.name!r} was profiled on {self.graph.profiled_on!r}, which is not "
                f"a known device type, so its times cannot be carried to other devices; profile on "
                f"the cluster's device types or add the type to the cluster file"
            )
        return found

    def _source_type(self, target: DeviceType) -> DeviceType:
        same_kind = [t for t in self._measured_types if t.kind == target.kind]
        return (same_kind or list(self._measured_types))[0]

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

    def node_times_s(self, device_type: str) -> dict[str, tuple[float, float]]:
        """Forward and backward time of every node on a device type (measured or projected)."""
        if device_type in self._node_times:
            return self._node_times[device_type]
        graph = self.graph
        if device_type in graph.device_types:
            times = {n.id: (n.fwd_s[device_type], n.bwd_s[device_type]) for n in graph.nodes}
        else:
            target = self._type(device_type)
            if target is None:
                raise HetplanError(f"unknown device type {device_type!r}")
            src = self._source_type(target)
            traffic = self._traffic_bytes
            times = {
                n.id: (project_s(n.fwd_s[src.name], n.flops, traffic[n.id], src, target),
                       project_s(n.bwd_s[src.name], n.flops, traffic[n.id], src, target))
                for n in graph.nodes
            }
        self._node_times[device_type] = times
        return times

    def stage_times_s(self, nodes: Sequence[str], device_type: str) -> tuple[float, float]:
        """Forward and backward time of a set of nodes on a device type, for the whole batch."""
        times = self.node_times_s(device_type)
        return math.fsum(times[n][0] for n in nodes), math.fsum(times[n][1] for n in nodes)

    def device_stage_s(self, nodes: Sequence[str], device_id: str) -> float:
        fwd, bwd = self.stage_times_s(nodes, self.cluster.device(device_id).type)
        return fwd + bwd

    def transfer_s(self, nbytes: float, src: str, dst: str) -> float:
        return self.cluster.link(src, dst).transfer_s(nbytes)

    def allreduce_s(self, nbytes: float, devices: Sequence[str]) -> float:
        """Ring all-reduce: 2(r-1) steps of nbytes/r each over the ring's slowest link."""
        r = len(devices)
        if r < 2 or nbytes <= 0:
            return 0.0
        ring = [self.cluster.link(devices[i], devices[(i + 1) % r]) for i in range(r)]
        slowest = min(link.bandwidth_Bps for link in ring)
        latency = max(link.latency_s for link in ring)
        return 2 * (r - 1) * (latency + nbytes / r / slowest)

    def replica_shares(self, nodes: Sequence[str], devices: Sequence[str]) -> dict[str, float]:
        """Share of each micro-batch given to each replica: in proportion to its speed, so that
        all replicas finish together."""
        speed = {d: 1.0 / max(self.device_stage_s(nodes, d), 1e-30) for d in devices}
        total = math.fsum(speed.values())
        return {d: s / total for d, s in speed.items()}

    def stage_memory_bytes(self, plan: Plan, stage_index: int, device_id: str) -> int:
        """Peak memory of one replica of a stage under the plan's schedule."""
        stage = plan.stages[stage_index]
        params = sum(self.graph.by_id[n].param_bytes for n in stage.nodes)
        acts = sum(self.graph.by_id[n].act_bytes for n in stage.nodes)
        share = self.replica_shares(stage.nodes, stage.devices)[device_id]
        held = inflight_microbatches(plan.schedule, len(plan.stages), stage_index, plan.microbatches)
        return int(WEIGHT_COPIES * params + acts * share / plan.microbatches * held)

    def boundary_bytes(self, plan: Plan) -> list[int]:
        """Bytes per batch crossing each boundary between stage k and k+1 (skips pass through)."""
        where = plan.stage_of()
        crossing = [0] * (len(plan.stages) - 1)
        for e in self.graph.edges:
            for k in range(where[e.src], where[e.dst]):
                crossing[k] += e.bytes
        return crossing

    def usd_per_step(self, devices: Sequence[str], step_s: float) -> float:
        return math.fsum(self.cluster.device(d).usd_per_hour for d in devices) * step_s / 3600.0


def analytic_estimate(graph: Graph, cluster: Cluster, plan: Plan) -> Estimate:
    """Score a (valid) plan with the closed-form pipeline formula of the module docstring."""
    cm = CostModel(graph, cluster)
    m = plan.microbatches
    stage_u: list[float] = []
    shares: list[dict[str, float]] = []
    busy: dict[str, float] = {}
    allreduce: list[float] = []
    for stage in plan.stages:
        share = cm.replica_shares(stage.nodes, stage.devices)
        shares.append(share)
        per_batch = max(share[d] * cm.device_stage_s(stage.nodes, d) for d in stage.devices)
        stage_u.append(per_batch / m)
        for d in stage.devices:
            busy[d] = busy.get(d, 0.0) + share[d] * cm.device_stage_s(stage.nodes, d)
        params = sum(graph.by_id[n].param_bytes for n in stage.nodes)
        allreduce.append(cm.allreduce_s(params, stage.devices))

    link_u: list[float] = []
    link_bytes: dict[str, int] = {}
    for k, nbytes in enumerate(cm.boundary_bytes(plan)):
        worst = 0.0
        for a, sa in shares[k].items():
            for b, sb in shares[k + 1].items():
                worst = max(worst, cm.transfer_s(nbytes * sa / m, a, b))
                if a != b and nbytes > 0:
                    for key in (f"{a}->{b}", f"{b}->{a}"):  # activations forward, gradients back
                        link_bytes[key] = link_bytes.get(key, 0) + round(nbytes * sa * sb)
        link_u.append(worst)

    bottleneck = max(stage_u + link_u)
    step = math.fsum(stage_u) + 2 * math.fsum(link_u) + (m - 1) * bottleneck + max(allreduce)
    used = plan.devices
    bubble = 1.0 - math.fsum(busy.values()) / (len(used) * step) if step > 0 else 0.0

    peak: dict[str, int] = {}
    violations: list[str] = []
    for i, stage in enumerate(plan.stages):
        for d in stage.devices:
            need = cm.stage_memory_bytes(plan, i, d)
            peak[d] = peak.get(d, 0) + need
    for d, need in peak.items():
        have = cluster.device(d).mem_bytes
        if need > have:
            stages = [str(i) for i, s in enumerate(plan.stages) if d in s.devices]
            violations.append(
                f"stage {', '.join(stages)} on {d} ({cluster.device(d).type}) needs {fmt_bytes(need)}, "
                f"has {fmt_bytes(have)}"
            )
    return Estimate(
        step_s=step,
        samples_per_s=graph.batch_size / step if step > 0 else 0.0,
        busy_s=busy,
        peak_mem_bytes=peak,
        bubble_fraction=max(0.0, bubble),
        link_bytes=link_bytes,
        usd_per_step=cm.usd_per_step(used, step),
        feasible=not violations,
        violations=tuple(violations),
        method="analytic",
    )
