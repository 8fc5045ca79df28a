"""Batched scoring of pipeline plans with numpy, for planners that compare thousands of them.

In a chain of stages where every device holds one stage, every resource's order of work is
fixed in advance: a stage runs its schedule's action order, and the link from stage r to r + 1
carries activations in the order stage r produces them (gradients likewise the other way). So
the event simulator's timeline is the longest-path recurrence

    F(r, i) = max(previous action of stage r, activations of i from stage r - 1) + fwd_r * f_i
    B(r, i) = max(previous action of stage r, gradients of i from stage r + 1) + bwd_r * f_i
    send = max(the action that made it, the sender's previous send, the receiver's previous
               receipt) + latency + bytes_r * f_i / bandwidth

evaluated in a topological order of the actions that depends only on the shape (stages,
micro-batch sizes, schedule). `ChainProgram` compiles that order once and evaluates it for a
whole batch of plans at once, one numpy operation per action over the batch. Interfaces
(`hetplan.sim.engine`): a device sends in the order its actions make tensors and receives in the
order its actions use them, so each transfer also waits for the one before it on the sender's
interface and on the receiver's; the hosts' network interfaces only cap a transfer's bandwidth
(`Cluster.link`). For chains of single-device stages under `relay` routing, where no host's
network interface carries the tensors of two pairs of devices (a chain on one host, or crossing
each host once), this is exactly the event simulator (a test checks it). Otherwise the event
simulator also makes transfers of two pairs take turns on a host's interface; replicated stages
are folded into one stage (the slowest replica's share, a cut's transfers as long as its busiest
interface is busy), and tensors that skip stages are relayed. So the fast path ranks such plans rather than timing
them, and a planner's final choice is re-scored by `hetplan.sim.simulate`.

`ChainScorer` builds the inputs for plans written as cut points in a topological order plus one
device per stage, from prefix sums, so a batch of such plans is scored without a Python loop
over plans.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel, formulas, in_flight_share, microbatch_fractions
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.plan import Plan
from hetplan.schedule import FORWARD, schedule_order
from hetplan.sim.model import build_step_model


def chain_crossing_bytes(graph: Graph, pos: Mapping[str, int]) -> np.ndarray:
    """crossing[c]: the bytes cut when a stage boundary falls before position c of the order
    `pos`: per source node, its edges that reach position c or later, at most its output
    (`Graph.crossing_bytes`)."""
    n = len(pos)
    crossing = np.zeros(n + 1)
    out: dict[str, list] = {}
    for e in graph.edges:
        out.setdefault(e.src, []).append(e)
    for src, edges in out.items():
        reach = np.zeros(n + 2)  # the source's edge bytes still crossing at each position
        for e in edges:
            reach[pos[e.src] + 1] += e.bytes
            reach[pos[e.dst] + 1] -= e.bytes
        crossing += np.minimum(np.cumsum(reach)[: n + 1], graph.sent_cap_bytes[src])
    return crossing


@dataclass(frozen=True)
class ChainProgram:
    """The compiled recurrence for chains of `stages` stages with the given micro-batch shares."""

    stages: int
    fractions: tuple[float, ...]
    schedule: str
    ops: tuple[tuple[int, tuple[int, ...]], ...] = field(init=False, repr=False)  # (event, what it waits for)
    sides: dict[int, tuple[int, int, int]] = field(init=False, repr=False)  # `_dependencies`' second result
    last: tuple[int, ...] = field(init=False, repr=False)  # each stage's last action

    def __post_init__(self) -> None:
        n, m = self.stages, len(self.fractions)
        orders = schedule_order(self.schedule, n, m)
        deps, sides = self._dependencies(orders)
        object.__setattr__(self, "ops", tuple(_topological(deps)))
        object.__setattr__(self, "sides", sides)
        object.__setattr__(self, "last", tuple(self._event(orders[r][-1].kind, r, orders[r][-1].microbatch)
                                               for r in range(n)))

    def _dependencies(self, orders) -> tuple[list[list[int]], dict[int, tuple[int, int, int]]]:
        """What each event waits for: an action, the action before it on its stage and its
        input's transfer; a transfer, the action that made it and the transfers before it on the
        sender's interface (in the order the sender makes them) and on the receiver's (in the
        order the receiver uses them). The second result names, per transfer, (the action, the
        previous transfer on the sender's interface, the previous one on the receiver's), -1
        where there is none."""
        n, m = self.stages, len(self.fractions)
        deps: list[list[int]] = [[] for _ in range(2 * n * m + 2 * (n - 1) * m)]
        sides: dict[int, list[int]] = {}
        for r, order in enumerate(orders):
            prev = sent = received = -1
            for action in order:
                i = action.microbatch
                e = self._event(action.kind, r, i)
                if prev >= 0:
                    deps[e].append(prev)
                prev = e
                fwd = action.kind == FORWARD
                if (r > 0) if fwd else (r < n - 1):  # its input, in the order stage r uses them
                    x = self._send_f(r - 1, i) if fwd else self._send_b(r + 1, i)
                    deps[e].append(x)
                    sides.setdefault(x, [-1, -1, -1])[2] = received
                    received = x
                if (r < n - 1) if fwd else (r > 0):  # its output, in the order stage r makes them
                    x = self._send_f(r, i) if fwd else self._send_b(r, i)
                    sides.setdefault(x, [-1, -1, -1])[:2] = [e, sent]
                    sent = x
        for x, side in sides.items():
            deps[x].extend(d for d in side if d >= 0)
        return deps, {x: tuple(side) for x, side in sides.items()}

    def _event(self, kind: str, r: int, i: int) -> int:
        m = len(self.fractions)
        return (0 if kind == FORWARD else self.stages * m) + r * m + i

    def _send_f(self, r: int, i: int) -> int:  # activations of i from stage r to r + 1
        m = len(self.fractions)
        return 2 * self.stages * m + r * m + i

    def _send_b(self, r: int, i: int) -> int:  # gradients of i from stage r to r - 1
        m = len(self.fractions)
        return 2 * self.stages * m + (self.stages - 1) * m + (r - 1) * m + i

    def step_s(self, fwd_s: np.ndarray, bwd_s: np.ndarray, send_s: np.ndarray, latency_s: np.ndarray,
               allreduce_s: np.ndarray | None = None, fwd_fixed_s: np.ndarray | None = None,
               bwd_fixed_s: np.ndarray | None = None, optimizer_s: np.ndarray | None = None) -> np.ndarray:
        """Step time of P plans.

        fwd_s, bwd_s: (P, stages) forward and backward time of each stage for the whole batch
        (without the fixed parts, if those are given). fwd_fixed_s, bwd_fixed_s: (P, stages) the
        time of every action whatever its size, or None for 0.
        send_s: (P, stages - 1) bytes / bandwidth across each boundary for the whole batch (both
        directions use it). latency_s: (P, stages - 1), 0 where nothing is sent.
        allreduce_s: (P, stages) gradient all-reduce after each stage's last action, or None."""
        n = self.stages
        f = np.asarray(self.fractions)
        fwd = np.atleast_2d(np.asarray(fwd_s, dtype=float))
        p = fwd.shape[0]
        parts = []
        for scaled, fixed in ((fwd, fwd_fixed_s), (bwd_s, bwd_fixed_s)):
            fixed = 0.0 if fixed is None else np.asarray(fixed, dtype=float).reshape(p, n).T[:, None, :]
            scaled = np.atleast_2d(np.asarray(scaled, dtype=float)).T[:, None, :]
            parts.append(np.broadcast_to(formulas.action_s(fixed, scaled, f[None, :, None]), (n, len(f), p)))
        if n > 1:
            send = np.asarray(send_s, dtype=float).reshape(p, n - 1).T
            lat = np.broadcast_to(np.asarray(latency_s, dtype=float), (p, n - 1)).T
            comm = formulas.action_s(lat[:, None, :], send[:, None, :], f[None, :, None])  # latency + share of bytes
            parts += [comm, comm]
        dur = np.concatenate([x.reshape(-1, p) for x in parts])
        t = self._times(dur, None if n == 1 else np.tile(np.repeat(send > 0, len(f), axis=0), (2, 1)))
        ends = t[list(self.last)]
        if allreduce_s is not None:
            ends = ends + np.asarray(allreduce_s, dtype=float).reshape(p, n).T
        if optimizer_s is not None:
            ends = ends + np.asarray(optimizer_s, dtype=float).reshape(p, n).T
        return ends.max(axis=0)

    def _times(self, dur: np.ndarray, sent: np.ndarray | None) -> np.ndarray:
        """Each event's end, (events, P). sent: (transfers, P), False where a boundary carries
        nothing: then the stage after it still waits for the stage before it (`relay`), but
        nothing takes a turn on an interface (as in the event simulator), so the transfers
        around it on either interface wait for each other as if it were not there."""
        t = np.empty_like(dur)
        careful = sent is not None and not sent.all()
        # when each interface is free after a transfer; where every transfer holds both, its end
        free_s, free_r = (np.zeros_like(dur), np.zeros_like(dur)) if careful else (t, t)
        first = 2 * self.stages * len(self.fractions)  # transfers come after the actions
        for e, ds in self.ops:
            if careful and e >= first:
                made, ps, pr = self.sides[e]
                start = np.maximum(free_s[ps] if ps >= 0 else 0.0, free_r[pr] if pr >= 0 else 0.0)
                on = sent[e - first]
                t[e] = np.where(on, np.maximum(start, t[made]) + dur[e], t[made])
                free_s[e] = np.where(on, t[e], free_s[ps] if ps >= 0 else 0.0)
                free_r[e] = np.where(on, t[e], free_r[pr] if pr >= 0 else 0.0)
            elif not ds:
                t[e] = dur[e]
            elif len(ds) == 1:
                np.add(t[ds[0]], dur[e], out=t[e])
            else:
                np.maximum(t[ds[0]], t[ds[1]], out=t[e])
                for d in ds[2:]:
                    np.maximum(t[e], t[d], out=t[e])
                t[e] += dur[e]
        return t


def _topological(deps: list[list[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """Kahn's algorithm: (event, what it waits for) in an order in which every event comes after
    what it waits for."""
    users: list[list[int]] = [[] for _ in deps]
    missing = [len(d) for d in deps]
    for e, ds in enumerate(deps):
        for d in ds:
            users[d].append(e)
    queue = deque(e for e in range(len(deps)) if missing[e] == 0)
    ops = []
    while queue:
        e = queue.popleft()
        ds = deps[e]
        ops.append((e, tuple(ds)))
        for u in users[e]:
            missing[u] -= 1
            if missing[u] == 0:
                queue.append(u)
    if len(ops) != len(deps):
        raise HetplanError("a schedule's actions wait for each other in a cycle")  # never for gpipe/1f1b
    return ops


@dataclass(frozen=True)
class FastScores:
    """Scores of a batch of P plans: step time, throughput, peak memory per stage, feasibility."""

    step_s: np.ndarray  # (P,)
    samples_per_s: np.ndarray  # (P,)
    peak_mem_bytes: np.ndarray  # (P, stages)
    feasible: np.ndarray  # (P,) bool
    usd_per_step: np.ndarray  # (P,)
    link_busy_s: np.ndarray | None = None  # (P,) the busiest directed link's time sending in a step
    bottleneck_s: np.ndarray | None = None  # (P,) `CostModel.bottleneck_s`: PipeDream's steady state


class ChainScorer:
    """Scores chains of single-device stages given as cut points in a fixed topological order.

    A plan is `cuts` (stages - 1 increasing positions in `order`: stage k holds
    order[cuts[k-1]:cuts[k]]) and `devices` (one device index of `cluster.ids` per stage)."""

    def __init__(self, graph: Graph, cluster: Cluster, order: Sequence[str] | None = None) -> None:
        self.graph, self.cluster = graph, cluster
        self.order = tuple(order or graph.topo_order)
        cm = CostModel(graph, cluster)
        pos = {nid: k for k, nid in enumerate(self.order)}
        types = [d.type for d in cluster.devices]
        self._type_of = np.array([sorted(set(types)).index(t) for t in types])
        zero = np.zeros(1)
        # per device type, prefix sums along the order of the nodes' times and fixed parts
        times = [cm.node_times_s(t) for t in sorted(set(types))]
        fixed = [cm.node_fixed_s(t) for t in sorted(set(types))]
        self._fwd, self._bwd = self._prefix(times, 0), self._prefix(times, 1)  # (types, len(order) + 1)
        self._ffix, self._bfix = self._prefix(fixed, 0), self._prefix(fixed, 1)
        by_id = graph.by_id
        self._params = np.concatenate([zero, np.cumsum([by_id[v].param_bytes for v in self.order], dtype=float)])
        self._updated = np.concatenate([zero, np.cumsum([by_id[v].optimizer_bytes for v in self.order], dtype=float)])
        # per device type, prefix sums of the optimizer steps the profiler measured there (None: not measured)
        self._opt = [None if m is None else np.concatenate([zero, np.cumsum([m[v] for v in self.order])])
                     for m in (cm.measured_optimizer_s(t) for t in sorted(set(types)))]
        self._acts = np.concatenate([zero, np.cumsum([by_id[v].act_bytes for v in self.order], dtype=float)])
        self._crossing = chain_crossing_bytes(graph, pos)
        ids = cluster.ids
        self._bw = np.array([[cluster.link(a, b).bandwidth_Bps for b in ids] for a in ids])
        self._lat = np.array([[cluster.link(a, b).latency_s for b in ids] for a in ids])
        self._mem = np.array([d.mem_bytes for d in cluster.devices], dtype=float)
        self._usd = np.array([d.usd_per_hour for d in cluster.devices])
        self._overhead = np.array([d.action_overhead_s for d in cluster.devices])
        self._step_overhead = np.array([d.step_overhead_s for d in cluster.devices])
        self._programs: dict[tuple[int, int, str], ChainProgram] = {}
        self._cm = cm
        # co-running (a calibrated cluster): host index and CPU-ness per device, and the factor
        # on a CPU device's compute by how many CPU devices of the plan share its host
        self._host = np.array([cluster.hosts.index(d.host) for d in cluster.devices])
        self._cpu = np.array([cm.is_cpu(d.id) for d in cluster.devices])
        slowdown = cluster.calibration.corun_slowdown if cluster.calibration is not None else ()
        self._corun = np.array([formulas.corun_factor(k, slowdown) for k in range(len(cluster.devices) + 2)])

    def _optimizer_s(self, lo: np.ndarray, hi: np.ndarray, devices: np.ndarray) -> np.ndarray:
        """(P, stages) optimizer step of each stage's weights on its device (as
        `CostModel.stage_optimizer_s`: measured on its type, else from the bytes it updates)."""
        out = np.zeros(devices.shape)
        for dev in np.unique(devices):
            where = devices == dev
            measured = self._opt[self._type_of[dev]]
            out[where] = self._cm.optimizer_step_s(
                self._updated[hi[where]] - self._updated[lo[where]], self.cluster.devices[dev].id,
                None if measured is None else measured[hi[where]] - measured[lo[where]])
        return out

    def _corun_factor(self, devices: np.ndarray) -> np.ndarray:
        """(P, stages) `CostModel.corun_factor` of each stage's device among the plan's devices."""
        if self.cluster.calibration is None or not self.cluster.calibration.corun_slowdown:
            return np.ones(devices.shape)
        same = (self._host[devices][:, :, None] == self._host[devices][:, None, :]) & self._cpu[devices][:, None, :]
        # distinct devices only: a device holding two stages is one worker
        first = devices[:, :, None] == devices[:, None, :]
        dup = np.triu(first, 1).any(axis=1)  # (P, n): this position repeats an earlier device
        busy = (same & ~dup[:, None, :]).sum(axis=2)
        return np.where(self._cpu[devices], self._corun[busy], 1.0)

    def _prefix(self, per_type: list[dict[str, tuple[float, float]]], k: int) -> np.ndarray:
        return np.array([np.concatenate([np.zeros(1), np.cumsum([x[v][k] for v in self.order])]) for x in per_type])

    def program(self, stages: int, microbatches: int, schedule: str) -> ChainProgram:
        key = (stages, microbatches, schedule)
        if key not in self._programs:
            self._programs[key] = ChainProgram(stages, microbatch_fractions(self.graph.batch_size, microbatches),
                                               schedule)
        return self._programs[key]

    def score(self, cuts: np.ndarray, devices: np.ndarray, microbatches: int, schedule: str) -> FastScores:
        devices = np.atleast_2d(np.asarray(devices, dtype=int))
        p, n = devices.shape
        cuts = np.asarray(cuts, dtype=int).reshape(p, n - 1)
        bounds = np.concatenate([np.zeros((p, 1), int), cuts, np.full((p, 1), len(self.order))], axis=1)
        lo, hi = bounds[:, :-1], bounds[:, 1:]
        types = self._type_of[devices]
        whole_f = self._fwd[types, hi] - self._fwd[types, lo]
        whole_b = self._bwd[types, hi] - self._bwd[types, lo]
        compute = whole_f + whole_b  # the stage's forward + backward of the batch, as CostModel's
        slow = self._corun_factor(devices)
        fwd, bwd, ffix, bfix = formulas.replica_passes_s(
            whole_f, whole_b, self._ffix[types, hi] - self._ffix[types, lo],
            self._bfix[types, hi] - self._bfix[types, lo], slow, self._overhead[devices])
        nbytes = self._crossing[cuts]
        src, dst = devices[:, :-1], devices[:, 1:]
        send = formulas.wire_s(nbytes, self._bw[src, dst])
        lat = np.where(nbytes > 0, self._lat[src, dst], 0.0)
        params = self._params[hi] - self._params[lo]
        opt = formulas.replica_tail_s(self._optimizer_s(lo, hi, devices), slow, self._step_overhead[devices])
        step = self.program(n, microbatches, schedule).step_s(fwd, bwd, send, lat, fwd_fixed_s=ffix,
                                                              bwd_fixed_s=bfix, optimizer_s=opt)
        share = np.array([in_flight_share(schedule, n, r, self.graph.batch_size, microbatches) for r in range(n)])
        peak = formulas.stage_memory_bytes_array(params, self._acts[hi] - self._acts[lo], share)
        feasible = (peak <= self._mem[devices]).all(axis=1)
        usd = formulas.usd_per_step(self._usd[devices].sum(axis=1), step)
        # each boundary's link carries the batch's activations one way and its gradients (as
        # many bytes) the other, one message per micro-batch
        busy = (send + microbatches * lat).max(axis=1) if n > 1 else np.zeros(p)
        # one device per stage: no all-reduce, one lane per cut
        steady = np.maximum(compute.max(axis=1), formulas.steady_cut_s(nbytes, self._bw[src, dst], 1).max(axis=1)
                            if n > 1 else 0.0)
        return FastScores(step, self.graph.batch_size / step, peak, feasible, usd, busy, steady)


def chain_inputs(graph: Graph, cluster: Cluster, plan: Plan, cost: CostModel | None = None) -> dict[str, np.ndarray]:
    """The `ChainProgram.step_s` inputs of any plan: replicated stages folded into one stage (the
    slowest replica; a cut's transfers as long as its busiest interface is busy,
    `CostModel.busiest_interface_s`) and skipping tensors relayed (an approximation where the
    plan has either; exact otherwise)."""
    cm = cost or CostModel(graph, cluster)
    model = build_step_model(graph, cluster, plan, "relay", cm)
    n = len(model.stages)
    pairs: list[dict[tuple[str, str], float]] = [{} for _ in range(n - 1)]
    lat = np.zeros(n - 1)
    for msg in model.messages:
        k = msg.src_stage
        if msg.src != msg.dst and msg.bytes_per_batch > 0:
            pairs[k][(msg.src, msg.dst)] = pairs[k].get((msg.src, msg.dst), 0.0) + msg.bytes_per_batch
            lat[k] = max(lat[k], cluster.link(msg.src, msg.dst).latency_s)
    send = np.array([cm.busiest_interface_s(p) for p in pairs])
    return {
        "fwd_s": np.array([max(r.fwd_s for r in st.replicas) for st in model.stages]),
        "bwd_s": np.array([max(r.bwd_s for r in st.replicas) for st in model.stages]),
        "fwd_fixed_s": np.array([max(r.fwd_fixed_s for r in st.replicas) for st in model.stages]),
        "bwd_fixed_s": np.array([max(r.bwd_fixed_s for r in st.replicas) for st in model.stages]),
        "send_s": send,
        "latency_s": lat,
        "allreduce_s": np.array([st.allreduce_s for st in model.stages]),
        "optimizer_s": np.array([max(r.optimizer_s for r in st.replicas) for st in model.stages]),
    }


def fast_step_s(graph: Graph, cluster: Cluster, plans: Sequence[Plan]) -> np.ndarray:
    """Fast-path step time of any plans (grouped by shape; one numpy pass per group)."""
    cm = CostModel(graph, cluster)
    out = np.empty(len(plans))
    groups: dict[tuple[int, int, str], list[int]] = {}
    for k, plan in enumerate(plans):
        groups.setdefault((len(plan.stages), plan.microbatches, plan.schedule), []).append(k)
    for (n, m, schedule), members in groups.items():
        inputs = [chain_inputs(graph, cluster, plans[k], cm) for k in members]
        stacked = {key: np.stack([x[key] for x in inputs]) for key in inputs[0]}
        program = ChainProgram(n, microbatch_fractions(graph.batch_size, m), schedule)
        out[members] = program.step_s(**stacked)
    return out
