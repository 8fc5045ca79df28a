"""A plan's step lowered to one list of instructions per worker: the schedule's passes with the
messages between them and the gradient sums after them, after torch.distributed.pipelining's
lowering of a schedule into per-rank actions with SEND_F/RECV_F/SEND_B/RECV_B (`_add_send_recv`)
and DeepSpeed's `PipeSchedule`, whose gradient sums and optimizer step are instructions like the
passes.

A worker runs its rank's actions (`hetplan.schedule.rank_orders`) for its replica's rows of each
micro-batch (`hetplan.rows`). The lists are what runs and what is predicted: hetplan's executor
runs its rank's list pass by pass, each with the receives before it and the sends after it
(`by_pass`, `hetplan.runtime.executor`), and the event simulator moves the lists' messages
(`hetplan.sim.engine`); the fast path builds its program from them (`hetplan.sim.fast`):

    RECV_F from each replica of stage k-1 that shares rows with mine (in replica order), F,
    SEND_F to each replica of stage k+1 that shares rows with mine (to every rank of its
           tensor-parallel group; only a group's first rank sends);
    RECV_B from each replica of stage k+1 that shares rows, B (or I), SEND_B to stage k-1's;
    W alone. A replica with no row of a micro-batch runs nothing for it and gets no message.
    Then the gradient sums it takes part in (`hetplan.sync.sync_groups`' order), then STEP.

(Neighbouring stages talk, as the runtime relays a tensor through the stages between its maker
and its user; the simulator's `direct` routing, which it scores but no run takes, gives `lower`
the pairs of stages a graph edge joins instead.)

Messages pair up by their order in the two lists, never by a tag naming the micro-batch: the
k-th activation a sends to b is the k-th that b receives from a, and the same for gradients. Two
ordered channels per pair of ranks, one each way down the pipeline, since one is not enough: under
ZB-V a rank holds a stage going down and one coming back, and the rank after it takes a gradient
from the second before an activation that the first made earlier (a process group per
direction carries them, `hetplan.runtime.transport`). `dry_run` plays the lists without costs
and says where they deadlock or where a pair disagrees (a receive that gets another
micro-batch's, stage's or rows' message, a send nobody receives, a sum whose members name
different groups) before anything runs.

Ops print as torch prints its actions ("1F0", "1SEND_F0", "2RECV_F0", "0REDUCE_GRAD"), with the
peer rank after an arrow and the rows where a stage's replicas split the micro-batch.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from hetplan.errors import HetplanError
from hetplan.plan import Plan
from hetplan.rows import StepRows
from hetplan.schedule import BACKWARD_WEIGHT, FORWARD, Action, rank_orders
from hetplan.sync import rank_numbers

SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
REDUCE_GRAD = "REDUCE_GRAD"  # a gradient sum over `group`
STEP = "STEP"  # the optimizer step of a stage's parameters
SENDS, RECEIVES = (SEND_F, SEND_B), (RECV_F, RECV_B)


@dataclass(frozen=True)
class Op:
    """One instruction of a worker's list. `stage`: the stage of the worker that runs it (a send's
    sender, a receive's receiver); `peer`: the rank at the other end of a message; `rows`: the
    rows [first, end) of the micro-batch a message carries; `group`: a sum's ranks, in order."""

    kind: str
    stage: int
    microbatch: int = -1
    peer: int = -1
    rows: tuple[int, int] = (0, 0)
    group: tuple[int, ...] = ()
    peer_stage: int = -1  # a message's stage at the other end (under relay routing, a neighbour)

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind}{self.microbatch if self.microbatch >= 0 else ''}"
        if self.kind in SENDS:
            text += f"->{self.peer}"
        elif self.kind in RECEIVES:
            text += f"<-{self.peer}"
        elif self.kind == REDUCE_GRAD:
            text += "(" + ",".join(map(str, self.group)) + ")"
        return text


def _op(kind: str, stage: int, microbatch: int, peer: int = -1, rows: tuple[int, int] = (0, 0),
        peer_stage: int = -1) -> Op:
    """`Op(...)` made without the frozen dataclass's `object.__setattr__` per field, three times
    faster: planners lower every plan shape they simulate, tens of thousands of ops for a deep one.
    The same object, equal to one `Op` makes (`tests/test_lowering.py`)."""
    op = object.__new__(Op)
    op.__dict__.update(kind=kind, stage=stage, microbatch=microbatch, peer=peer, rows=rows, group=(),
                       peer_stage=peer_stage)
    return op


@dataclass(frozen=True)
class Lowered:
    """Per rank (runtime numbering: `groups[k][p]` are the ranks of replica p of stage k), its ops;
    `micro`: each micro-batch's rows."""

    ops: tuple[tuple[Op, ...], ...]
    micro: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], ...], ...] = ()  # `lower`'s: the ranks of each stage replica

    @cached_property
    def places(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(stage, rank) -> (p, i): the rank is the i-th of replica p of the stage."""
        return {(k, r): (p, i) for k, reps in enumerate(self.groups) for p, g in enumerate(reps)
                for i, r in enumerate(g)}

    def lines(self) -> list[str]:
        """One line per rank: `rank 3: 1RECV_F0<-0 1F0 1SEND_F0->5 ...`, a message's rows shown
        where it carries part of its micro-batch."""
        return [f"rank {r}: " + " ".join(self.shown(op) for op in ops) for r, ops in enumerate(self.ops)]

    def shown(self, op: Op) -> str:
        if op.kind in SENDS + RECEIVES and op.rows != (0, self.micro[op.microbatch]):
            return f"{op}[{op.rows[0]}:{op.rows[1]}]"
        return str(op)


def lower(schedule: str, groups: Sequence[Sequence[Sequence[int]]], stage_ranks: Sequence[int], rows: StepRows,
          sums: Sequence[Sequence[int]] = (), links: Sequence[tuple[int, int]] | None = None) -> Lowered:
    """Each worker's ops. `groups[k][p]`: the ranks of replica p of stage k (a tensor-parallel
    group's in order, else one); `stage_ranks[k]`: the pipeline rank that holds stage k
    (`Plan.stage_ranks`); `rows`: the step's split of every micro-batch (`hetplan.rows`); `sums`:
    the ranks of each gradient sum, in the order every rank runs them (`hetplan.sync.sync_groups`);
    `links`: the pairs of stages (a, b), a < b, whose activations a sends b and whose gradients b
    sends back: neighbours (the runtime's relay, the default), or, for the simulator's `direct`
    routing, the pairs a graph's edges join (`hetplan.cost.table.stage_pair_bytes`). A stage
    receives from its sources in stage order, and sends to its targets in stage order."""
    stages = len(groups)
    talks = sorted(set(links)) if links is not None else [(k, k + 1) for k in range(stages - 1)]
    pipeline = max(stage_ranks) + 1
    orders = rank_orders(schedule, stages, len(rows.micro), None if pipeline == stages else pipeline)
    workers = 1 + max(r for reps in groups for g in reps for r in g)
    ops: list[list[Op]] = [[] for _ in range(workers)]
    firsts = [next(k for k in range(stages) if stage_ranks[k] == r) for r in range(pipeline)]
    shares = _Shares(rows, groups)
    for k in firsts:
        for p, group in enumerate(groups[k]):
            for position, rank in enumerate(group):
                held = [s for s in range(stages) if stage_ranks[s] == stage_ranks[k]]
                ops[rank] = _passes(orders[stage_ranks[k]], groups, rows, p, position, held, talks, shares)
    for members in sums:
        for rank in members:
            ops[rank].append(Op(REDUCE_GRAD, _known_by(groups, rank), group=tuple(members)))
    for k in range(stages):
        for group in groups[k]:
            for rank in group:
                ops[rank].append(Op(STEP, k))
    frozen = tuple(tuple(tuple(g) for g in reps) for reps in groups)
    return Lowered(tuple(tuple(o) for o in ops), tuple(rows.micro), frozen)


@dataclass(frozen=True)
class Pass:
    """A pass of a worker's list with its messages: the receives before it and the sends after it."""

    op: Op
    receives: tuple[Op, ...]
    sends: tuple[Op, ...]


def by_pass(ops: Sequence[Op]) -> list[Pass]:
    """A worker's list as passes (F, B, I, W) with their messages, in order; its sums and steps
    left out (they follow the passes)."""
    out: list[Pass] = []
    waiting: list[Op] = []
    for op in ops:
        if op.kind in RECEIVES:
            waiting.append(op)
        elif op.kind in SENDS:
            out[-1] = Pass(out[-1].op, out[-1].receives, out[-1].sends + (op,))
        elif op.kind not in (REDUCE_GRAD, STEP):
            out.append(Pass(op, tuple(waiting), ()))
            waiting = []
    return out


def _known_by(groups: Sequence[Sequence[Sequence[int]]], rank: int) -> int:
    """The first stage a rank holds."""
    return next(k for k, reps in enumerate(groups) if any(rank in g for g in reps))


def _passes(order: Sequence[Action], groups, rows: StepRows, p: int, position: int, held: Sequence[int],
            talks: Sequence[tuple[int, int]], shares: _Shares) -> list[Op]:
    """A worker's passes and messages: replica p of the stages `held`, at `position` of its group.
    (Planners lower every plan they simulate: the rows each pass shares are looked up first.)"""
    out: list[Op] = []
    append = out.append
    below = {k: [(x, shares.of(k, x, p)) for x, y in talks if y == k] for k in held}
    above = {k: [(y, shares.of(k, y, p)) for x, y in talks if x == k] for k in held}
    busy = {k: [rows.rows(k, j, p) > 0 for j in range(len(rows.micro))] for k in held}
    for a in order:
        k, j, kind = a.stage, a.microbatch, a.kind
        if k not in busy or not busy[k][j]:
            continue
        if kind == BACKWARD_WEIGHT:
            append(_op(kind, k, j))
            continue
        if kind == FORWARD:
            sources, targets, receive, send = below[k], above[k], RECV_F, SEND_F
        else:
            sources, targets, receive, send = above[k], below[k], RECV_B, SEND_B
        for source, shared in sources:
            for group, span in shared[j]:
                append(_op(receive, k, j, group[0], span, source))
        append(_op(kind, k, j))
        if position == 0:  # a group's other ranks made the same values
            for target, shared in targets:
                for group, span in shared[j]:
                    for dst in group:
                        append(_op(send, k, j, dst, span, target))
    return out


class _Shares:
    """Per pair of stages (k, other), replica p of k and micro-batch j: (the ranks of replica q of
    `other`, (first, end)) for each replica q whose slice shares rows with p's, in replica order
    (`StepRows.overlaps`, one walk per pair and micro-batch for all the replicas at once)."""

    def __init__(self, rows: StepRows, groups) -> None:
        self.rows, self.groups = rows, groups
        self.known: dict[tuple[int, int], list[list[list]]] = {}

    def of(self, k: int, other: int, p: int) -> list[list[tuple[tuple[int, ...], tuple[int, int]]]]:
        if (k, other) not in self.known:
            per_j = []
            for j in range(len(self.rows.micro)):
                by_p: list[list] = [[] for _ in range(self.rows.replicas(k))]
                for mine, q, lo, hi in self.rows.overlaps(k, other, j):
                    by_p[mine].append((self.groups[other][q], (lo, hi)))
                per_j.append(by_p)
            self.known[(k, other)] = per_j
        return [by_p[p] for by_p in self.known[(k, other)]]


def dry_run(lowered: Lowered) -> list[str]:
    """Play every worker's list without costs: sends never wait, a receive takes the oldest
    message from its peer, a sum waits for its whole group. Returns what is wrong, one line each:
    a receive that gets a message it does not expect, a sum whose members disagree, ops left when
    nobody can go on (a deadlock: each stuck rank and what it waits for), messages never received."""
    lists = lowered.ops
    at = [0] * len(lists)
    boxes: dict[tuple[int, int], deque[tuple[int, Op]]] = {}
    problems: list[str] = []
    moved = True
    while moved and not problems:
        moved = False
        for r in range(len(lists)):
            while at[r] < len(lists[r]) and not problems:
                step = _try(r, lists, at, boxes, problems)
                if not step:
                    break
                moved = True
    if problems:
        return problems
    stuck = [f"rank {r} waits at {lists[r][at[r]]} (op {at[r]})" for r in range(len(lists)) if at[r] < len(lists[r])]
    if stuck:
        return ["the lists deadlock: " + "; ".join(stuck[:4]) + (f"; {len(stuck) - 4} more" if len(stuck) > 4 else "")]
    return [f"{op} from rank {src} is never received by rank {dst}" for (src, dst, _), box in boxes.items()
            for _, op in box]


def _try(r: int, lists, at: list[int], boxes: dict, problems: list[str]) -> bool:
    """Run rank r's next op if it can run now; whether it did."""
    op = lists[r][at[r]]
    if op.kind in SENDS:
        boxes.setdefault((r, op.peer, channel(op)), deque()).append((r, op))
    elif op.kind in RECEIVES:
        box = boxes.get((op.peer, r, channel(op)))
        if not box:
            return False
        _, sent = box.popleft()
        if not _pairs(sent, op):
            problems.append(f"rank {r}'s {op} (op {at[r]}) gets rank {op.peer}'s {sent}")
    elif op.kind == REDUCE_GRAD:
        return _meet(r, op, lists, at, problems)
    at[r] += 1
    return True


ACTIVATIONS, GRADIENTS = 0, 1  # the two channels between a pair of ranks (the runtime's message tags)


def channel(op: Op) -> int:
    """A message's channel between its two ranks."""
    return ACTIVATIONS if op.kind in (SEND_F, RECV_F) else GRADIENTS


def _pairs(sent: Op, got: Op) -> bool:
    """Whether a received message is the one the receive expects."""
    kinds = {SEND_F: RECV_F, SEND_B: RECV_B}
    return (kinds[sent.kind] == got.kind and got.stage == sent.peer_stage and sent.stage == got.peer_stage
            and got.microbatch == sent.microbatch and got.rows == sent.rows)


def _meet(r: int, op: Op, lists, at: list[int], problems: list[str]) -> bool:
    """A sum runs once every member is at it; the first member moves them all."""
    waiting = [m for m in op.group if at[m] < len(lists[m]) and lists[m][at[m]].kind == REDUCE_GRAD]
    if len(waiting) < len(op.group):
        return False
    for m in op.group:
        if lists[m][at[m]].group != op.group:
            problems.append(f"rank {r} sums over {op.group} while rank {m} sums over {lists[m][at[m]].group}")
            return False
    for m in op.group:
        if m != r:
            at[m] += 1
    at[r] += 1
    return True


def check_lowered(lowered: Lowered) -> None:
    """Refuse lists that would hang or mix up messages, in one line."""
    problems = dry_run(lowered)
    if problems:
        raise HetplanError(f"the plan's step cannot run as lowered: {problems[0]}"
                           + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def rank_groups(plan: Plan, host_of: Callable[[str], str]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`groups[k][p]`: the ranks of replica p of stage k, its tensor-parallel group's in order, as
    a run numbers its workers (`hetplan.sync.rank_numbers`: host by host, as torchrun does; a
    group's ranks after its first, on its host; a worker that holds several stages by its first)."""
    numbers = rank_numbers([st.devices for st in plan.stages], host_of, plan.stage_ranks)
    held = plan.rank_stages
    first = [held[r][0] for r in plan.stage_ranks]
    workers = sorted((numbers[(k, p)], i, k, p) for k in sorted(set(first))
                     for p, group in enumerate(plan.stages[k].groups) for i in range(len(group)))
    rank_of = {(k, p, i): r for r, (_, i, k, p) in enumerate(workers)}
    return tuple(tuple(tuple(rank_of[(first[k], p, i)] for i in range(len(group)))
                       for p, group in enumerate(plan.stages[first[k]].groups)) for k in range(len(plan.stages)))


def shape_groups(degrees: Sequence[Sequence[int]],
                 stage_ranks: Sequence[int]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`groups[k][p]` numbered by the plan's shape alone: pipeline rank by pipeline rank, replica
    by replica, each tensor-parallel group's ranks in order (`degrees[k][p]`: replica p of stage
    k's devices). What the simulator reads, where a run's numbering by host (`rank_groups`)
    changes nothing but the names, so that plans of one shape share their lists."""
    first = {r: k for k, r in reversed(list(enumerate(stage_ranks)))}
    numbers, next_rank = {}, 0
    for r in sorted(first):
        for p, t in enumerate(degrees[first[r]]):
            numbers[(r, p)] = tuple(range(next_rank, next_rank + t))
            next_rank += t
    return tuple(tuple(numbers[(stage_ranks[k], p)] for p in range(len(degrees[k]))) for k in range(len(degrees)))


def place_sums(replicas: Sequence[tuple[int, ...]], stages: int) -> list[tuple[int, ...]] | None:
    """The rule of which ranks sum together over replicas (each its tensor-parallel group's ranks,
    its first rank first) of `stages` stages: one sum over their ranks where each is one rank;
    where they are groups of t ranks of one stage, t sums, one at each place of the groups; None
    for groups of unlike sizes or of several stages (summed over all their ranks at once, as
    `runtime.tensor_parallel.mixed_sum` does). The runtime's sums follow it (`rank.tp_sums`)."""
    sizes = {len(g) for g in replicas}
    if sizes == {1}:
        return [tuple(g[0] for g in replicas)]
    if len(sizes) == 1 and stages == 1:
        return [tuple(g[i] for g in replicas) for i in range(sizes.pop())]
    return None


def sum_ranks(groups: Sequence[Sequence[Sequence[int]]], members: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
    """The ranks of each sum over stage replicas `members` ((stage, replica), in the order of
    `hetplan.sync.sync_groups`), a worker's stages once (`place_sums`; one over all their ranks
    where it gives None)."""
    replicas = list(dict.fromkeys(tuple(groups[k][p]) for k, p in members))
    return place_sums(replicas, len({k for k, _ in members})) or [tuple(dict.fromkeys(r for g in replicas
                                                                                        for r in g))]


BARRIER = "barrier"  # where a worker is while it waits for every worker, before and after a step
SUMS = "sums"  # in its optimizer step after its passes and sums (each sum: its REDUCE_GRAD op)
CHECKPOINT = "checkpoint"  # writing its checkpoint after a step
_WAIT = re.compile(r"(\d+)RECV_([FB])(\d+)<-(\d+)")
_SUM = re.compile(r"\d+REDUCE_GRAD\(([\d,]+)\)")


def describe(where: str) -> str:
    """What a worker's heartbeat says it is doing (an op as `Op.__str__` prints it, or BARRIER or
    SUMS), in words; "" for nothing."""
    wait = _WAIT.fullmatch(where)
    if wait:
        what = "activations" if wait[2] == "F" else "gradients"
        return f"waiting at {where} for micro-batch {wait[3]}'s {what} from worker {wait[4]}"
    total = _SUM.fullmatch(where)
    if total:
        return f"in {where}: a gradient sum that waits for workers {total[1].replace(',', ', ')}"
    if where == BARRIER:
        return "waiting for every worker at a step's start or end"
    if where == SUMS:
        return "in its optimizer step, after its gradient sums"
    if where == CHECKPOINT:
        return "writing its checkpoint"
    return f"running {where}" if where else ""
