"""Event-driven simulation of one training step, after Trinity's simulator (Zeng et al.,
"Trinity: Neural Network Adaptive Distributed Parallel Training Method Based on Reinforcement
Learning", 2022): every device has a run queue of compute work, a device runs one action at a
time, and communication overlaps computation.

Transfers go through interfaces (`Cluster.interfaces`): the sending device's, the receiving
device's and, between hosts, the two hosts' network interfaces. Transfers that do not fit on an
interface together take turns on it, and a device receives in the order its actions use the
tensors, as hetplan's runtime does (`hetplan.sim.interfaces`).

The work of each stage replica is the schedule's action order (`hetplan.schedule`), run in
that order as hetplan's runtime runs it (`hetplan.runtime.executor`): an action starts when the
one before it on the same stage is done and its inputs (activations for a forward pass,
gradients for a backward pass) have arrived. Under an interleaved schedule a device runs its
rank's one list of actions over all its stages (`hetplan.schedule.rank_orders`), as the runtime's
worker does. A device that holds several stages otherwise (plans with `shared_devices`: a worker
per stage) runs, of the actions at the heads of its stages' orders, the one whose inputs arrived
first (ties: the lower stage). After its last backward pass, each replica takes part
in its gradient sums (`hetplan.cost.syncs`: a replicated stage's own parameters, and a tied
parameter over all the stages that use it; each an all-reduce by the ring formula or the curve
measured on a calibrated cluster; of a table with sparse gradients only its looked-up rows), as
its list orders them (`REDUCE_GRAD`, the order the runtime's ranks run them), each once all its
members are there; they use the network, not the device's compute. Then
every replica takes its optimizer step (`CostModel._stage_optimizer_s`: as the profiler measured
it on the device's type, else Adam's memory-bound formula of the bytes it updates, or as
`hetplan calibrate` measured it on the device).

The loop is a priority queue of finish events ordered by (time, sequence number), so the
result is deterministic; the code is written with flat lists because planners call it often.
Phases: the compute tasks of every replica (`_Tasks`), the transfers of every message
(`_add_transfers`; their durations from the table, `hetplan.cost.table`), the event loop
(`_EventLoop`), the lists' sums and optimizer steps after it (`_tail`), and the timeline.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from hetplan.cluster import Cluster
from hetplan.cost.table import StepCosts
from hetplan.errors import HetplanError
from hetplan.lowering import RECEIVES, RECV_F, REDUCE_GRAD, SENDS, STEP, Lowered, Op, sum_ranks
from hetplan.schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FREES,
    SENDS_GRADIENTS,
    get_schedule,
    rank_orders,
    schedule_order,
)
from hetplan.sim.interfaces import Interfaces
from hetplan.timeline import ALLREDUCE, OPTIMIZER, Span, Timeline


@dataclass(frozen=True)
class EventResult:
    step_s: float
    busy_s: dict[str, float]
    peak_act_bytes: dict[str, float]  # per device: the most stashed activation bytes at once
    link_bytes: dict[str, float]
    link_busy_s: dict[str, float]
    timeline: Timeline | None


def run_events(model: StepCosts, cluster: Cluster, lowered: Lowered, record: bool = True) -> EventResult:
    """Simulate the step whose workers run `lowered`'s lists (`hetplan.lowering`, of the same plan
    and routing as `model`); with `record`, keep the timeline of every action."""
    tasks = _Tasks(model)
    transfers = _Transfers(cluster)
    _add_transfers(lowered, model, tasks, transfers)
    loop = _EventLoop(tasks, transfers, record)
    now = loop.run()
    if loop.done != tasks.count:
        raise tasks.deadlock(loop.c_end, loop.done)
    step, tail_spans = _tail(model, lowered, tasks, loop.c_end, now, record)
    timeline = None
    if record:
        spans = [_span(item, start, end, tasks, transfers) for item, start, end in loop.started]
        timeline = Timeline(tuple(spans + tail_spans), tuple(tasks.devices), tuple(transfers.links), step)
    return EventResult(
        step_s=step,
        busy_s=dict(zip(tasks.devices, loop.dev_busy_s, strict=True)),
        peak_act_bytes=dict(zip(tasks.devices, loop.dev_peak, strict=True)),
        link_bytes=dict(zip(transfers.links, loop.link_bytes, strict=True)),
        link_busy_s=dict(zip(transfers.links, loop.link_busy_s, strict=True)),
        timeline=timeline,
    )


class _Tasks:
    """The compute tasks of every stage replica, as parallel lists indexed by task id, in the
    schedule's order for each replica (`programs`: per device, per stage it holds, its task ids)."""

    def __init__(self, model: StepCosts) -> None:
        m = model.microbatches
        orders = schedule_order(model.schedule, len(model.stages), m, model.ranks)
        self.devices: list[str] = list(dict.fromkeys(rep.device for st in model.stages for rep in st.replicas))
        self.dev_index = {d: k for k, d in enumerate(self.devices)}
        self.programs: list[list[list[int]]] = [[] for _ in self.devices]
        self.dev: list[int] = []
        self.dur: list[float] = []
        self.hold: list[float] = []  # activation bytes a forward stashes (+), its B or W frees (-), else 0
        # activation bytes a recomputing stage's B or I holds while it runs, by task (only those)
        self.rebuilt: dict[int, float] = {}
        self.kind: list[str] = []
        self.stage: list[int] = []
        self.mb: list[int] = []
        self.base: dict[tuple[int, str], int] = {}  # (stage, device) -> id of its first task
        self.position: list[dict[str, list[int]]] = []  # per stage, kind -> micro-batch -> place in its order
        self.last: list[tuple[int, list[int]]] = []  # (stage, last task of each replica)
        # the action after which a stage's input gradients exist (I where the backward is split)
        self.grad_kind = BACKWARD_INPUT if get_schedule(model.schedule).split_backward else BACKWARD
        for st in model.stages:
            self._add_stage(st, orders[st.index], m)
        self.interleaved = get_schedule(model.schedule).interleaved
        if self.interleaved:
            self._one_list_per_device(model)
        self.count = len(self.dev)
        self.wait = [0] * self.count  # inputs not yet arrived
        self.ready = [0.0] * self.count  # when the last input arrived
        self.succ_x: list[list[int]] = [[] for _ in range(self.count)]  # transfers a task's end starts
        self.succ_c: list[list[int]] = [[] for _ in range(self.count)]  # tasks it feeds without a transfer

    def _add_stage(self, st, order, m: int) -> None:
        kinds = [a.kind for a in order]
        mbs = [a.microbatch for a in order]
        place: dict[str, list[int]] = {kind: [0] * m for kind in set(kinds)}
        for k, a in enumerate(order):
            place[a.kind][a.microbatch] = k
        self.position.append(place)
        lasts = []
        for rep in st.replicas:
            dev = self.dev_index[rep.device]
            base = len(self.dev)
            self.base[(st.index, rep.device)] = base
            size = len(order)
            self.dev.extend([dev] * size)
            durations = {FORWARD: rep.fwd_mb_s, BACKWARD: rep.bwd_mb_s, BACKWARD_INPUT: rep.bwd_input_mb_s,
                         BACKWARD_WEIGHT: rep.bwd_weight_mb_s}
            self.dur.extend([durations[k][i] for k, i in zip(kinds, mbs, strict=True)])
            self.hold.extend([rep.act_mb_bytes[i] if k == FORWARD else -rep.act_mb_bytes[i] if k in FREES else 0.0
                              for k, i in zip(kinds, mbs, strict=True)])
            if rep.rebuilt_mb_bytes:
                self.rebuilt.update({base + p: rep.rebuilt_mb_bytes[i]
                                     for p, (k, i) in enumerate(zip(kinds, mbs, strict=True)) if k in SENDS_GRADIENTS})
            self.kind.extend(kinds)
            self.stage.extend([st.index] * size)
            self.mb.extend(mbs)
            self.programs[dev].append(list(range(base, base + size)))
            lasts.append(base + size - 1)
        self.last.append((st.index, lasts))

    def _one_list_per_device(self, model: StepCosts) -> None:
        """Each device's stages in one program: its rank's actions, in the rank's order."""
        per_rank = rank_orders(model.schedule, len(model.stages), model.microbatches, model.ranks)
        for dev, device in enumerate(self.devices):
            stage = next(st.index for st in model.stages if any(rep.device == device for rep in st.replicas))
            self.programs[dev] = [[self.task(a.stage, device, a.kind, a.microbatch)
                                   for a in per_rank[model.stage_ranks[stage]]]]

    def task(self, stage: int, device: str, kind: str, microbatch: int) -> int:
        return self.base[(stage, device)] + self.position[stage][kind][microbatch]

    def deadlock(self, c_end: list[float], done: int) -> HetplanError:
        stuck = [f"{self.stage[t]}{self.kind[t]}{self.mb[t]} on {self.devices[self.dev[t]]}"
                 for t in range(self.count) if c_end[t] < 0][:3]
        return HetplanError(f"the simulated step deadlocked with {self.count - done} actions left (first: "
                            f"{', '.join(stuck)}); the plan's stages cannot run in this order")


class _Transfers:
    """The transfers of every message, as parallel lists indexed by transfer id; `links` are the
    pairs of devices that talk (a timeline row each) and `ports` each pair's interfaces, numbered."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.links: list[str] = []
        self.link_index: dict[tuple[str, str], int] = {}
        self.ports: list[tuple[int, ...]] = []  # per link: its interfaces' numbers
        self.needs: list[tuple[float, ...]] = []  # per link: the bandwidth it takes of each
        self.port_index: dict[tuple[str, str], int] = {}
        self.capacity: list[float] = []  # per interface: its bandwidth
        self.link: list[int] = []
        self.dur: list[float] = []
        self.bytes: list[float] = []
        self.dst: list[int] = []  # the task that waits for it
        self.fwd: list[bool] = []
        self.stage: list[int] = []
        self.to: list[int] = []
        self.mb: list[int] = []

    def turns(self, tasks: _Tasks) -> list[list[list[int]] | None]:
        """Per interface, the groups of transfers it carries one group after the other when that
        order is fixed (the receiving side of a device holding one stage replica: the inputs of
        each of its actions, in the order of its actions), else None (served as issued). A stage's
        tasks are numbered in its order, so only a device's list over several stages (interleaved)
        needs its places looked up."""
        single = [len(progs) == 1 for progs in tasks.programs]
        by_port: dict[int, dict[int, list[int]]] = {}
        for x, lk in enumerate(self.link):
            task = self.dst[x]
            if single[tasks.dev[task]]:  # the receiving side is second on a path (`Cluster.interfaces`)
                by_port.setdefault(self.ports[lk][1], {}).setdefault(task, []).append(x)
        place = ({t: k for progs in tasks.programs if len(progs) == 1 for k, t in enumerate(progs[0])}
                 if tasks.interleaved else None)
        out: list[list[list[int]] | None] = [None] * len(self.port_index)
        for p, groups in by_port.items():
            out[p] = [groups[t] for t in sorted(groups, key=place.__getitem__ if place else None)]
        return out

    def link_id(self, src: str, dst: str) -> int:
        if (src, dst) not in self.link_index:
            self.link_index[(src, dst)] = len(self.links)
            self.links.append(f"{src}->{dst}")
            ports = self.cluster.interfaces(src, dst)
            for p in ports:
                if p not in self.port_index:
                    self.port_index[p] = len(self.port_index)
                    self.capacity.append(self.cluster.interface_Bps(p))
            self.ports.append(tuple(self.port_index[p] for p in ports))
            rate = self.cluster.link(src, dst).bandwidth_Bps
            self.needs.append(tuple(min(rate, self.capacity[self.port_index[p]]) for p in ports))
        return self.link_index[(src, dst)]


def _add_transfers(lowered: Lowered, model: StepCosts, tasks: _Tasks, xs: _Transfers) -> None:
    """Every message of the lists, activations forward and gradients back: a dependency between
    the action that made the tensor and the one that uses it, through a transfer on the link
    unless it stays on one device or the pair of stages exchanges nothing. Transfers are
    numbered in the order their receivers take them (an action's inputs take their turn in that
    order, `_Transfers.turns`) and an action issues its sends in its list's order. A
    tensor-parallel group is one replica here, its first rank's: the table's message times count
    the copies sent to every rank of a group (`hetplan.cost.table.step_costs`)."""
    table = {(msg.src_stage, msg.dst_stage, msg.src, msg.dst): (msg, msg.src != msg.dst and msg.bytes_per_batch > 0)
             for msg in model.messages}
    for msg, moves in table.values():  # the links in the table's order: a timeline's rows stay put
        if moves:
            xs.link_id(msg.src, msg.dst)
            xs.link_id(msg.dst, msg.src)
    device = [[rep.device for rep in st.replicas] for st in model.stages]
    place = lowered.places
    received: dict[int, tuple[int, Op]] = {}  # transfer -> its receive
    for rank, ops in enumerate(lowered.ops):
        for op in ops:
            if op.kind not in RECEIVES or place[(op.stage, rank)][1]:  # a group's first rank stands for it
                continue
            forward = op.kind == RECV_F
            src = device[op.peer_stage][place[(op.peer_stage, op.peer)][0]]
            dst = device[op.stage][place[(op.stage, rank)][0]]
            key = (op.peer_stage, op.stage, src, dst) if forward else (op.stage, op.peer_stage, dst, src)
            msg, moves = table.get(key, (None, False))
            if msg is None or msg.bytes_mb[op.microbatch] is None:
                raise HetplanError(f"the simulator has no costs for the lowered step's {op} on rank {rank}; "
                                   "the cost table and the lowering disagree")
            kind = FORWARD if forward else tasks.grad_kind
            x = _add_transfer(tasks, xs, (op.peer_stage, src), (op.stage, dst), kind, op.microbatch,
                              msg.seconds_mb if forward else msg.back_seconds_mb, msg.bytes_mb, moves)
            if x >= 0:
                received[x] = (rank, op)
    if any(len(succ) > 1 for succ in tasks.succ_x):
        _in_sending_order(lowered, tasks, received)


def _in_sending_order(lowered: Lowered, tasks: _Tasks, received: dict[int, tuple[int, Op]]) -> None:
    """Each action's transfers in the order its list sends them."""
    sent_at = {(r, op.peer, op.stage, op.peer_stage, op.microbatch, op.rows): (r, n)
               for r, ops in enumerate(lowered.ops) for n, op in enumerate(ops) if op.kind in SENDS}
    issued = {x: sent_at[(op.peer, rank, op.peer_stage, op.stage, op.microbatch, op.rows)]
              for x, (rank, op) in received.items()}
    for succ in tasks.succ_x:
        if len(succ) > 1:
            succ.sort(key=issued.__getitem__)


def _add_transfer(tasks: _Tasks, xs: _Transfers, sender: tuple[int, str], receiver: tuple[int, str], kind: str,
                  i: int, secs: tuple[float, ...], sizes: tuple[float | None, ...], moves: bool) -> int:
    """One message of micro-batch i from (stage, device) `sender` to `receiver`; its transfer,
    or -1 where it needs none (`moves` False: on one device, or nothing between the stages)."""
    producer, consumer = tasks.task(*sender, kind, i), tasks.task(*receiver, kind, i)
    tasks.wait[consumer] += 1
    if not moves:
        tasks.succ_c[producer].append(consumer)
        return -1
    tasks.succ_x[producer].append(len(xs.link))
    xs.link.append(xs.link_id(sender[1], receiver[1]))
    xs.dur.append(secs[i])
    xs.bytes.append(sizes[i])
    xs.dst.append(consumer)
    xs.fwd.append(kind == FORWARD)
    xs.stage.append(sender[0])
    xs.to.append(receiver[0])
    xs.mb.append(i)
    return len(xs.link) - 1


class _EventLoop:
    """Devices run their tasks and interfaces carry transfers, in time order of finish events.
    The task and transfer lists are bound to attributes of the loop itself: this is the
    simulator's hot path."""

    def __init__(self, tasks: _Tasks, xs: _Transfers, record: bool) -> None:
        self.programs, self.wait, self.ready = tasks.programs, tasks.wait, tasks.ready
        self.dur, self.hold, self.rebuilt, self.dev = tasks.dur, tasks.hold, tasks.rebuilt, tasks.dev
        self.succ_x, self.succ_c = tasks.succ_x, tasks.succ_c
        self.x_link, self.x_dur, self.x_bytes, self.x_dst = xs.link, xs.dur, xs.bytes, xs.dst
        self.record = record
        nd, nl = len(tasks.devices), len(xs.links)
        self.dev_busy = [False] * nd
        self.dev_busy_s = [0.0] * nd
        self.dev_act = [0.0] * nd
        self.dev_peak = [0.0] * nd
        self.pointers = [[0] * len(tasks.programs[d]) for d in range(nd)]
        self.interfaces = Interfaces([xs.ports[lk] for lk in xs.link], [xs.needs[lk] for lk in xs.link],
                                     xs.capacity, xs.turns(tasks))
        self.link_busy_s = [0.0] * nl
        self.link_bytes = [0.0] * nl
        self.c_end = [-1.0] * tasks.count  # -1: not run
        self.started: list[tuple[int, float, float]] = []  # (task or ~transfer, start, end), when recording
        self.heap: list[tuple[float, int, int]] = []  # (time, sequence, task id or ~transfer id)
        self.seq = 0
        self.done = 0

    def _pick(self, progs: list[list[int]], ptrs: list[int]) -> int:
        """Of a device's several programs, the one whose next task may start (inputs arrived),
        earliest ready first; -1 if none."""
        best, best_ready, wait, ready = -1, 0.0, self.wait, self.ready
        for k, prog in enumerate(progs):
            p = ptrs[k]
            if p < len(prog):
                tid = prog[p]
                if wait[tid] == 0 and (best < 0 or ready[tid] < best_ready):
                    best, best_ready = k, ready[tid]
        return best

    def try_device(self, dev: int, now: float) -> None:
        if self.dev_busy[dev]:
            return
        progs, ptrs = self.programs[dev], self.pointers[dev]
        if len(progs) == 1:  # one stage on the device: its next task, once its inputs are in
            p = ptrs[0]
            if p >= len(progs[0]) or self.wait[progs[0][p]]:
                return
            best = 0
        else:
            best = self._pick(progs, ptrs)
            if best < 0:
                return
        tid = progs[best][ptrs[best]]
        ptrs[best] += 1
        self.dev_busy[dev] = True
        end = now + self.dur[tid]
        stash = self.hold[tid]
        if stash > 0:
            held = self.dev_act[dev] + stash
            self.dev_act[dev] = held
            if held > self.dev_peak[dev]:
                self.dev_peak[dev] = held
        elif self.rebuilt and self.dev_act[dev] + self.rebuilt.get(tid, 0.0) > self.dev_peak[dev]:
            self.dev_peak[dev] = self.dev_act[dev] + self.rebuilt[tid]
        self.seq += 1
        heapq.heappush(self.heap, (end, self.seq, tid))
        if self.record:
            self.started.append((tid, now, end))

    def send(self, x: int, now: float) -> None:
        """Transfer x is ready: it starts now if its interfaces let it, else when they do."""
        if self.interfaces.issue(x):
            self._start(x, now)

    def _start(self, x: int, now: float) -> None:
        link = self.x_link[x]
        dur = self.x_dur[x]
        end = now + dur
        self.link_busy_s[link] += dur
        self.link_bytes[link] += self.x_bytes[x]
        self.seq += 1
        heapq.heappush(self.heap, (end, self.seq, ~x))
        if self.record:
            self.started.append((~x, now, end))

    def _task_ended(self, tid: int, now: float) -> None:
        self.done += 1
        dev = self.dev[tid]
        self.dev_busy[dev] = False
        self.dev_busy_s[dev] += self.dur[tid]
        self.c_end[tid] = now
        if self.hold[tid] < 0:
            self.dev_act[dev] += self.hold[tid]
        for x in self.succ_x[tid]:
            self.send(x, now)
        wait, ready, fed = self.wait, self.ready, self.succ_c[tid]
        for c in fed:
            wait[c] -= 1
            if now > ready[c]:
                ready[c] = now
        self.try_device(dev, now)
        for c in fed:
            self.try_device(self.dev[c], now)

    def _transfer_ended(self, x: int, now: float) -> None:
        c = self.x_dst[x]
        self.wait[c] -= 1
        if now > self.ready[c]:
            self.ready[c] = now
        for y in self.interfaces.release(x):
            self._start(y, now)
        self.try_device(self.dev[c], now)

    def run(self) -> float:
        """Run to the last event; returns its time."""
        for dev in range(len(self.dev_busy)):
            self.try_device(dev, 0.0)
        now = 0.0
        heap, task_ended, transfer_ended = self.heap, self._task_ended, self._transfer_ended
        while heap:
            now, _, item = heapq.heappop(heap)
            if item >= 0:
                task_ended(item, now)
            else:
                transfer_ended(~item, now)
        return now


def _tail(model: StepCosts, lowered: Lowered, tasks: _Tasks, c_end: list[float], now: float,
          record: bool) -> tuple[float, list[Span]]:
    """After its last action, each worker runs the rest of its list (`hetplan.lowering`): its
    gradient sums (`REDUCE_GRAD`: each starts when every rank of its group is at it, and lasts as
    the table's sum over those ranks, `StepCosts.syncs`), then its optimizer steps (`STEP`: the
    stage replica's). A worker is a stage replica, or under an interleaved schedule replica p of
    all the stages of one pipeline rank. Returns the step's end and, when recording, the spans."""
    ready = {g[0]: 0.0 for reps in lowered.groups for g in reps}
    for s, lasts in tasks.last:
        for p, t in enumerate(lasts):
            r = lowered.groups[s][p][0]
            ready[r] = max(ready[r], c_end[t])
    heads = [deque(op for op in ops if op.kind in (REDUCE_GRAD, STEP)) for ops in lowered.ops]
    sums = _priced_sums(model, lowered)
    spans: list[Span] = []
    moved = True
    while moved:
        moved = False
        for r, head in enumerate(heads):
            while head and (head[0].kind == STEP or _all_at(heads, head[0])):
                op, moved = head[0], True
                if op.kind == STEP:
                    head.popleft()
                    rep = model.stages[op.stage].replicas[lowered.places[(op.stage, r)][0]]
                    begin, ready[r] = ready[r], ready[r] + rep.optimizer_s
                    if record and rep.optimizer_s > 0:
                        spans.append(Span(rep.device, OPTIMIZER, op.stage, -1, begin, ready[r]))
                else:
                    spans += _sum(op, sums, heads, ready, lowered.groups, record)
    if any(heads):
        raise HetplanError("the lists' gradient sums wait for each other in a cycle: "
                           + "; ".join(f"rank {r} at {h[0]}" for r, h in enumerate(heads) if h)[:300])
    return max(now, *ready.values()), spans


def _all_at(heads: list[deque], op: Op) -> bool:
    """Whether every rank of a sum's group is at that sum."""
    return all(heads[m] and heads[m][0].kind == REDUCE_GRAD and heads[m][0].group == op.group for m in op.group)


def _priced_sums(model: StepCosts, lowered: Lowered) -> dict[tuple[int, ...], deque]:
    """The table's sums (`StepCosts.syncs`) by the ranks that run them, in order."""
    out: dict[tuple[int, ...], deque] = {}
    for sync in model.syncs:
        for ranks in sum_ranks(lowered.groups, sync.members):
            out.setdefault(ranks, deque()).append(sync)
    return out


def _sum(op: Op, sums: dict[tuple[int, ...], deque], heads: list[deque], ready: dict[int, float], groups,
         record: bool) -> list[Span]:
    """Run a sum every rank of its group is at: they leave it together, its time after the last
    one came."""
    if not sums.get(op.group):
        raise HetplanError(f"the cost table and the lowering disagree: no sum over ranks {op.group} is priced")
    sync = sums[op.group].popleft()
    begin = max(ready[m] for m in op.group)
    for m in op.group:
        heads[m].popleft()
        ready[m] = begin + sync.seconds
    if not record or sync.seconds <= 0:
        return []
    firsts: dict[int, tuple[str, int]] = {}  # rank -> (device, the first of the sum's stages on it)
    for (k, p), d in zip(sync.members, sync.devices, strict=True):
        firsts.setdefault(groups[k][p][0], (d, k))
    return [Span(d, ALLREDUCE, k, -1, begin, begin + sync.seconds) for d, k in firsts.values()]


def _span(item: int, start: float, end: float, t: _Tasks, xs: _Transfers) -> Span:
    if item >= 0:
        return Span(t.devices[t.dev[item]], t.kind[item], t.stage[item], t.mb[item], start, end)
    x = ~item
    return Span(xs.links[xs.link[x]], FORWARD if xs.fwd[x] else BACKWARD, xs.stage[x], xs.mb[x], start, end, xs.to[x])
