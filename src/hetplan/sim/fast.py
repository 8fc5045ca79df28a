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
micro-batch sizes, schedule). What waits for what is read off each stage's list of the step
(`hetplan.lowering`: its passes, sends and receives, in the order the runtime runs them), never
derived here from the schedule. `ChainProgram` compiles that order once and evaluates it for a
whole batch of plans at once, one numpy operation per action over the batch. Interfaces
(`hetplan.sim.engine`): a device sends in the order its actions make tensors and receives in the
order its actions use them, so each transfer also waits for the one before it on the sender's
interface and on the receiver's; the hosts' network interfaces only cap a transfer's bandwidth
(`Cluster.link`). For chains of single-device stages under `relay` routing, where no host's
network interface carries the tensors of two pairs of devices (a chain on one host, or crossing
each host once), this is exactly the event simulator (a test checks it). Otherwise the event
simulator also makes transfers of two pairs take turns on a host's interface; replicated stages
are folded into one stage (the slowest replica's share, a cut's transfers as long as its busiest
interface is busy), and tensors that skip stages are relayed. So the fast path ranks such
plans rather than timing them, and a planner's final choice is re-scored by
`hetplan.sim.simulate`.

The durations come from the lowered table's array form (`hetplan.cost.table.ChainCosts`, made
by `lower_chain`); this module computes no cost of its own (`tests/test_cost_formulas.py`). After
the passes it adds the table's gradient sums and optimizer steps per stage (a folded stage's own
sum, then the tied parameters' sums in the lists' order), not the lists' `REDUCE_GRAD` ops as the
event simulator does: the plans of one shape it scores together differ in their sums.
`hetplan.sim.chains.ChainScorer` lowers plans written as cut points in a topological order plus
one device per stage, from prefix sums, so a batch of such plans is scored without a Python loop
over plans.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel, microbatch_fractions
from hetplan.cost.table import ChainCosts, fold_plan, lower_chain
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.lowering import RECEIVES, RECV_B, RECV_F, SEND_F, SENDS, Lowered, Op, lower
from hetplan.plan import Plan
from hetplan.rows import step_rows
from hetplan.schedule import FORWARD, KINDS, get_schedule


@dataclass(frozen=True)
class ChainProgram:
    """The compiled recurrence for chains of `stages` stages with the given micro-batch shares."""

    stages: int
    fractions: tuple[float, ...]
    schedule: str
    ops: tuple[tuple[int, tuple[int, ...]], ...] = field(init=False, repr=False)  # (event, what it waits for)
    sides: dict[int, tuple[int, int, int]] = field(init=False, repr=False)  # `_dependencies`' second result
    last: tuple[int, ...] = field(init=False, repr=False)  # each stage's last action
    kinds: tuple[str, ...] = field(init=False, repr=False)  # F, then B (or I and W): a block of events each

    def __post_init__(self) -> None:
        n, m = self.stages, len(self.fractions)
        if get_schedule(self.schedule).interleaved:
            raise HetplanError(f"the fast path scores chains of one stage per device, not {self.schedule} plans; "
                               "simulate them with hetplan.sim.simulate")
        object.__setattr__(self, "kinds", (FORWARD, *get_schedule(self.schedule).backward_kinds))
        lowered = lower(self.schedule, [[(r,)] for r in range(n)], range(n), step_rows(m, m, [[1.0]] * n))
        deps, sides = self._dependencies(lowered)
        object.__setattr__(self, "ops", tuple(_topological(deps)))
        object.__setattr__(self, "sides", sides)
        object.__setattr__(self, "last", tuple(next(self._event(op.kind, r, op.microbatch) for op in reversed(ops)
                                                    if op.kind in KINDS) for r, ops in enumerate(lowered.ops)))

    def _dependencies(self, lowered: Lowered) -> tuple[list[list[int]], dict[int, tuple[int, int, int]]]:
        """What each event waits for, read off each stage's list of the step (`hetplan.lowering`):
        an action, the action before it on its stage and the transfers its receives wait for; a
        transfer, the action that made it (the one before its send) and the transfers before it
        on the sender's interface (the sends before it in the sender's list) and on the
        receiver's (the receives before it in the receiver's list). The second result names, per
        transfer, (the action, the previous transfer on the sender's interface, the previous one
        on the receiver's), -1 where there is none."""
        n, m = self.stages, len(self.fractions)
        deps: list[list[int]] = [[] for _ in range(len(self.kinds) * n * m + 2 * (n - 1) * m)]
        sides: dict[int, list[int]] = {}
        for r, ops in enumerate(lowered.ops):
            prev = sent = received = -1
            inputs: list[int] = []
            for op in ops:
                if op.kind in KINDS:
                    e = self._event(op.kind, r, op.microbatch)
                    deps[e] += ([prev] if prev >= 0 else []) + inputs
                    prev, inputs = e, []
                elif op.kind in RECEIVES:
                    x = self._transfer(op)
                    inputs.append(x)
                    sides.setdefault(x, [-1, -1, -1])[2] = received
                    received = x
                elif op.kind in SENDS:
                    x = self._transfer(op)
                    sides.setdefault(x, [-1, -1, -1])[:2] = [prev, sent]
                    sent = x
        for x, side in sides.items():
            deps[x].extend(d for d in side if d >= 0)
        return deps, {x: tuple(side) for x, side in sides.items()}

    def _transfer(self, op: Op) -> int:
        """The transfer a send or a receive of the chain's lists is an end of."""
        if op.kind in (SEND_F, RECV_F):
            return self._send_f(op.stage - (op.kind == RECV_F), op.microbatch)
        return self._send_b(op.stage + (op.kind == RECV_B), op.microbatch)

    def _event(self, kind: str, r: int, i: int) -> int:
        m = len(self.fractions)
        return self.kinds.index(kind) * self.stages * m + r * m + i

    @property
    def _actions(self) -> int:  # events before the first transfer
        return len(self.kinds) * self.stages * len(self.fractions)

    def _send_f(self, r: int, i: int) -> int:  # activations of i from stage r to r + 1
        m = len(self.fractions)
        return self._actions + r * m + i

    def _send_b(self, r: int, i: int) -> int:  # gradients of i from stage r to r - 1
        m = len(self.fractions)
        return self._actions + (self.stages - 1) * m + (r - 1) * m + i

    def step_s(self, costs: ChainCosts) -> np.ndarray:
        """Step time of the P plans whose actions and transfers `costs` gives (`hetplan.cost.table`)."""
        n, m = self.stages, len(self.fractions)
        if len(costs.actions_s) != len(self.kinds) or costs.actions_s[0].shape[:2] != (n, m):
            raise HetplanError(f"the costs are lowered for {costs.actions_s[0].shape[:2]} (stages, micro-batches) "
                               f"and {len(costs.actions_s)} kinds of action, the program is for {(n, m)} and "
                               f"{self.schedule}; lower them with its schedule and micro-batches")
        p = costs.actions_s[0].shape[2]
        back = costs.transfer_s if costs.back_s is None else costs.back_s
        parts = [*costs.actions_s, costs.transfer_s, back] if n > 1 else list(costs.actions_s)
        dur = np.concatenate([x.reshape(-1, p) for x in parts])
        t = self._times(dur, None if n == 1 else np.tile(np.repeat(costs.sent, m, axis=0), (2, 1)))
        ends = t[list(self.last)]
        if costs.allreduce_s is not None:
            ends = ends + costs.allreduce_s
        if costs.tied_members is not None and costs.tied_s is not None:
            ends = _tied_sums(ends, costs.tied_members, costs.tied_s)
        if costs.optimizer_s is not None:
            ends = ends + costs.optimizer_s
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
        first = self._actions  # transfers come after the actions
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


def _tied_sums(ends: np.ndarray, members: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """ends (stages, P) after each sum g over the stages members[g] (stages, P) marks: they wait
    for the last of them, then for the sum."""
    for g in range(members.shape[0]):
        begin = np.where(members[g], ends, -np.inf).max(axis=0)
        ends = np.where(members[g], begin + seconds[g], ends)
    return ends


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


def chain_inputs(graph: Graph, cluster: Cluster, plan: Plan, cost: CostModel | None = None) -> dict[str, np.ndarray]:
    """`lower_chain`'s inputs for any plan (`hetplan.cost.table.fold_plan`: replicated stages
    folded, skipping tensors relayed)."""
    return fold_plan(cost or CostModel(graph, cluster), plan)


def fast_step_s(graph: Graph, cluster: Cluster, plans: Sequence[Plan], cost: CostModel | None = None,
                programs: dict | None = None) -> np.ndarray:
    """Fast-path step time of any plans (grouped by shape; one numpy pass per group). `programs`
    keeps the compiled programs by shape for later calls (a planner's, for its problem)."""
    cm = cost or CostModel(graph, cluster)
    programs = {} if programs is None else programs
    out = np.empty(len(plans))
    inputs = [chain_inputs(graph, cluster, plan, cm) for plan in plans]
    groups: dict[tuple[int, int, str, int], list[int]] = {}
    for k, plan in enumerate(plans):
        groups.setdefault((len(plan.stages), plan.microbatches, plan.schedule, len(inputs[k]["tied_s"])), []).append(k)
    for (n, m, schedule, _), members in groups.items():
        if (n, m, schedule) not in programs:
            programs[(n, m, schedule)] = ChainProgram(n, microbatch_fractions(graph.batch_size, m), schedule)
        program = programs[(n, m, schedule)]
        stacked = {key: np.stack([inputs[k][key] for k in members]) for key in inputs[members[0]]}
        out[members] = program.step_s(lower_chain(schedule, program.fractions, **stacked))
    return out
