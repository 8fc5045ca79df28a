"""Event-driven simulation of one training step, after Trinity's simulator (Zeng et al.,
"Trinity: Neural Network Adaptive Distributed Parallel Training Method Based on Reinforcement
Learning", 2022): every device has a run queue of compute work and every directed link a
first-in-first-out queue of tensors to send; a device runs one action at a time, a link carries
one transfer at a time in each direction, and communication overlaps computation.

The work of each stage replica is the schedule's action order (`hetplan.schedule`), run in
that order as hetplan's runtime runs it (`hetplan.runtime.executor`): an action starts when the
one before it on the same stage is done and its inputs (activations for a forward pass,
gradients for a backward pass) have arrived. A device that holds several stages (plans with `shared_devices`) runs, of
the actions at the heads of its stages' orders, the one whose inputs arrived first (ties: the
lower stage). After its last backward pass, a replicated stage all-reduces its gradients (ring
all-reduce, `CostModel.allreduce_s`), which uses the network, not the device's compute; then every
replica takes its optimizer step (`CostModel.optimizer_s`: Adam, memory-bound).

The loop is a priority queue of finish events ordered by (time, sequence number), so the
result is deterministic; the code is written with flat lists because planners call it often.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError
from hetplan.schedule import FORWARD, schedule_order
from hetplan.sim.model import StepModel

ALLREDUCE = "AR"
OPTIMIZER = "OPT"


@dataclass(frozen=True)
class Span:
    """One piece of work on the timeline.

    `resource` is a device id, or `"a->b"` for the link from device a to device b. `kind` is F
    (a forward pass, or activations on a link), B (a backward pass, or gradients on a link) or AR
    (the stage's gradient all-reduce, drawn on each replica's row) or OPT (the optimizer step after
    the last backward pass and the all-reduce). `stage` is the stage doing the
    work (on links, the sending stage, and `to_stage` the receiving one); `microbatch` is -1 for AR."""

    resource: str
    kind: str
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    to_stage: int = -1

    @property
    def label(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}" if self.microbatch >= 0 else f"{self.stage}{self.kind}"


@dataclass(frozen=True)
class Timeline:
    """Every action of a simulated step, with the rows to draw them on (devices then links)."""

    spans: tuple[Span, ...]
    devices: tuple[str, ...]
    links: tuple[str, ...]
    step_s: float


@dataclass(frozen=True)
class EventResult:
    step_s: float
    busy_s: dict[str, float]
    peak_act_bytes: dict[str, float]  # per device: the most stashed activation bytes at once
    link_bytes: dict[str, float]
    link_busy_s: dict[str, float]
    timeline: Timeline | None


def run_events(model: StepModel, cluster: Cluster, record: bool = True) -> EventResult:
    """Simulate the step; with `record`, keep the timeline of every action."""
    fractions = model.fractions
    m = len(fractions)
    n = len(model.stages)
    orders = schedule_order(model.schedule, n, m)

    devices: list[str] = []
    dev_index: dict[str, int] = {}
    for st in model.stages:
        for rep in st.replicas:
            if rep.device not in dev_index:
                dev_index[rep.device] = len(devices)
                devices.append(rep.device)
    programs: list[list[list[int]]] = [[] for _ in devices]

    # compute tasks, as parallel lists indexed by task id
    c_dev: list[int] = []
    c_dur: list[float] = []
    c_act: list[float] = []  # activation bytes stashed by a forward (freed by its backward)
    c_fwd: list[bool] = []
    c_stage: list[int] = []
    c_mb: list[int] = []
    task_base: dict[tuple[int, str], int] = {}  # (stage, device) -> id of its first task
    position: list[dict[str, list[int]]] = []  # per stage, kind -> micro-batch -> place in its order
    last_task: list[tuple[int, list[int]]] = []  # (stage, last task of each replica)
    for st in model.stages:
        order = orders[st.index]
        is_fwd = [a.kind == FORWARD for a in order]
        mbs = [a.microbatch for a in order]
        place: dict[str, list[int]] = {FORWARD: [0] * m, "B": [0] * m}
        for k, a in enumerate(order):
            place[a.kind][a.microbatch] = k
        position.append(place)
        lasts = []
        for rep in st.replicas:
            dev = dev_index[rep.device]
            base = len(c_dev)
            task_base[(st.index, rep.device)] = base
            size = len(order)
            c_dev.extend([dev] * size)
            c_dur.extend([rep.fwd_mb_s[i] if f else rep.bwd_mb_s[i] for f, i in zip(is_fwd, mbs, strict=True)])
            c_act.extend([rep.act_mb_bytes[i] for i in mbs])
            c_fwd.extend(is_fwd)
            c_stage.extend([st.index] * size)
            c_mb.extend(mbs)
            programs[dev].append(list(range(base, base + size)))
            lasts.append(base + size - 1)
        last_task.append((st.index, lasts))
    nc = len(c_dev)
    c_wait = [0] * nc
    c_ready = [0.0] * nc
    c_succ_x: list[list[int]] = [[] for _ in range(nc)]  # transfers a task's end starts
    c_succ_c: list[list[int]] = [[] for _ in range(nc)]  # tasks it feeds without a transfer

    # transfers: activations forward along each message, gradients back
    links: list[str] = []
    link_index: dict[tuple[str, str], int] = {}
    x_link: list[int] = []
    x_dur: list[float] = []
    x_bytes: list[float] = []
    x_dst: list[int] = []
    x_fwd: list[bool] = []
    x_stage: list[int] = []
    x_to: list[int] = []
    x_mb: list[int] = []
    for msg in model.messages:
        for kind, src, dst, s_from, s_to in ((FORWARD, msg.src, msg.dst, msg.src_stage, msg.dst_stage),
                                             ("B", msg.dst, msg.src, msg.dst_stage, msg.src_stage)):
            # a tensor to the same device, or an empty one, is a dependency and nothing on a link
            link = cluster.link(src, dst) if src != dst and msg.bytes_per_batch > 0 else None
            p_base, p_place = task_base[(s_from, src)], position[s_from][kind]
            c_base, c_place = task_base[(s_to, dst)], position[s_to][kind]
            sent = [i for i in range(m) if msg.bytes_mb[i] is not None]  # slices that share rows
            if link is None:
                for i in sent:
                    consumer = c_base + c_place[i]
                    c_wait[consumer] += 1
                    c_succ_c[p_base + p_place[i]].append(consumer)
                continue
            if (src, dst) not in link_index:
                link_index[(src, dst)] = len(links)
                links.append(f"{src}->{dst}")
            lid = link_index[(src, dst)]
            latency, bandwidth = link.latency_s, link.bandwidth_Bps
            for i in sent:
                consumer = c_base + c_place[i]
                c_wait[consumer] += 1
                nbytes = msg.bytes_mb[i]
                c_succ_x[p_base + p_place[i]].append(len(x_link))
                x_link.append(lid)
                x_dur.append(latency + nbytes / bandwidth)  # Link.transfer_s, inlined: nbytes > 0 here
                x_bytes.append(nbytes)
                x_dst.append(consumer)
            x_fwd.extend([kind == FORWARD] * len(sent))
            x_stage.extend([s_from] * len(sent))
            x_to.extend([s_to] * len(sent))
            x_mb.extend(sent)

    # the event loop
    nd = len(devices)
    dev_busy = [False] * nd
    dev_busy_s = [0.0] * nd
    dev_act = [0.0] * nd
    dev_peak = [0.0] * nd
    pointers = [[0] * len(programs[d]) for d in range(nd)]
    link_busy = [False] * len(links)
    link_queue: list[deque[int]] = [deque() for _ in links]
    link_busy_s = [0.0] * len(links)
    link_bytes = [0.0] * len(links)
    c_end = [-1.0] * nc  # -1: not run
    started: list[tuple[int, float, float]] = []  # (task or ~transfer, start, end), when recording
    heap: list[tuple[float, int, int]] = []  # (time, sequence, task id or ~transfer id)
    seq = 0
    done = 0

    def try_device(dev: int, now: float) -> None:
        nonlocal seq
        if dev_busy[dev]:
            return
        progs = programs[dev]
        ptrs = pointers[dev]
        best = -1
        if len(progs) == 1:
            p = ptrs[0]
            if p < len(progs[0]) and c_wait[progs[0][p]] == 0:
                best = 0
        else:
            best_ready = 0.0
            for k, prog in enumerate(progs):
                p = ptrs[k]
                if p < len(prog):
                    tid = prog[p]
                    if c_wait[tid] == 0 and (best < 0 or c_ready[tid] < best_ready):
                        best, best_ready = k, c_ready[tid]
        if best < 0:
            return
        tid = progs[best][ptrs[best]]
        ptrs[best] += 1
        dev_busy[dev] = True
        end = now + c_dur[tid]
        if c_fwd[tid]:
            dev_act[dev] += c_act[tid]
            if dev_act[dev] > dev_peak[dev]:
                dev_peak[dev] = dev_act[dev]
        seq += 1
        heapq.heappush(heap, (end, seq, tid))
        if record:
            started.append((tid, now, end))

    def start_transfer(x: int, now: float) -> None:
        nonlocal seq
        link = x_link[x]
        link_busy[link] = True
        end = now + x_dur[x]
        link_busy_s[link] += x_dur[x]
        link_bytes[link] += x_bytes[x]
        seq += 1
        heapq.heappush(heap, (end, seq, ~x))
        if record:
            started.append((~x, now, end))

    for dev in range(nd):
        try_device(dev, 0.0)
    now = 0.0
    while heap:
        now, _, item = heapq.heappop(heap)
        if item >= 0:  # a compute task ended
            done += 1
            dev = c_dev[item]
            dev_busy[dev] = False
            dev_busy_s[dev] += c_dur[item]
            c_end[item] = now
            if not c_fwd[item]:
                dev_act[dev] -= c_act[item]
            for x in c_succ_x[item]:
                link = x_link[x]
                if link_busy[link]:
                    link_queue[link].append(x)
                else:
                    start_transfer(x, now)
            for c in c_succ_c[item]:
                c_wait[c] -= 1
                if now > c_ready[c]:
                    c_ready[c] = now
            try_device(dev, now)
            for c in c_succ_c[item]:
                try_device(c_dev[c], now)
        else:  # a transfer ended
            x = ~item
            link = x_link[x]
            link_busy[link] = False
            c = x_dst[x]
            c_wait[c] -= 1
            if now > c_ready[c]:
                c_ready[c] = now
            if link_queue[link]:
                start_transfer(link_queue[link].popleft(), now)
            try_device(c_dev[c], now)
    if done != nc:
        stuck = [f"{c_stage[t]}{'F' if c_fwd[t] else 'B'}{c_mb[t]} on {devices[c_dev[t]]}"
                 for t in range(nc) if c_end[t] < 0][:3]
        raise HetplanError(f"the simulated step deadlocked with {nc - done} actions left (first: {', '.join(stuck)}); "
                           "the plan's stages cannot run in this order")

    step = now
    allreduce_spans: list[Span] = []
    for s, lasts in last_task:
        ar = model.stages[s].allreduce_s
        begin = max(c_end[t] for t in lasts)
        if ar > 0:
            step = max(step, begin + ar)
            if record:
                allreduce_spans += [Span(rep.device, ALLREDUCE, s, -1, begin, begin + ar)
                                    for rep in model.stages[s].replicas]
        # then each replica's optimizer step (after the all-reduce, when there is one)
        for rep in model.stages[s].replicas:
            if rep.optimizer_s > 0:
                start = begin + ar
                step = max(step, start + rep.optimizer_s)
                if record:
                    allreduce_spans.append(Span(rep.device, OPTIMIZER, s, -1, start, start + rep.optimizer_s))

    timeline = None
    if record:
        spans = []
        for item, start, end in started:
            if item >= 0:
                spans.append(Span(devices[c_dev[item]], FORWARD if c_fwd[item] else "B", c_stage[item],
                                  c_mb[item], start, end))
            else:
                x = ~item
                spans.append(Span(links[x_link[x]], FORWARD if x_fwd[x] else "B", x_stage[x], x_mb[x], start, end,
                                  x_to[x]))
        timeline = Timeline(tuple(spans + allreduce_spans), tuple(devices), tuple(links), step)
    return EventResult(
        step_s=step,
        busy_s=dict(zip(devices, dev_busy_s, strict=True)),
        peak_act_bytes=dict(zip(devices, dev_peak, strict=True)),
        link_bytes=dict(zip(links, link_bytes, strict=True)),
        link_busy_s=dict(zip(links, link_busy_s, strict=True)),
        timeline=timeline,
    )
