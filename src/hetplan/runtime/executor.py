"""One worker's part of a training step: the schedule's actions, run over point-to-point
messages, as PipeDream's and DeepSpeed's pipeline runtimes do (DeepSpeed's `PipeSchedule`
documents each instruction by the code it runs; so does this module). A worker is one stage
replica, or under an interleaved schedule replica p of stages k, k + n, k + 2n, ... (ZB-V: k and
2n - 1 - k; one `StageRunner` each), whose actions `RankRunner` runs in the rank's one order.

The action order is `hetplan.schedule.rank_orders`, the one the simulator simulates, and
the rows of every replica are `hetplan.rows`, the split the simulator charges; so a run does what
its prediction assumed, action by action. Every plan that `hetplan.plan.validate_plan` accepts
runs: any number of replicas per stage (3 + 1, 1 + 2 + 1, ...), stages without parameters, more
or fewer micro-batches than stages, every schedule of `hetplan.schedule` (GPipe, 1F1B, zero
bubble, interleaved 1F1B, ZB-V), stages that recompute their activations, every precision
(`hetplan.pieces.mixed`: each forward under autocast, the whole step inside one outer context so
that the weights' 16-bit copies are made once per step; fp16's loss scaled on the last stage).

For replica p of stage k, micro-batch j, with rows [lo, hi) of it (`StepRows.slices`):

    F j:  stage 0: x = rows [lo, hi) of micro-batch j of the batch
          else:    x = the rows each replica of stage k-1 shares with mine, joined in order
                   (a value without batch dimension: whole, from the replica holding my first row)
          y = stage(x); keep (x, y) for B j   (a stage that recomputes: y = checkpoint(stage, x),
                                               or per block each piece checkpointed in turn)
          last stage: loss_j = y;  else: send each replica of stage k+1 the rows of y we share
    B j:  last stage: backward(loss_j * (hi - lo) / batch)   # the batch's mean loss, by samples
          else:       g = the gradients of y from stage k+1's replicas, joined; backward(y, g)
          send each replica of stage k-1 the rows of x.grad we share (not from stage 0)

    I j, W j (zero bubble): B j in two actions (`hetplan.runtime.split_backward`): I computes the
          gradients of x, sends them as B does and keeps what W needs; W computes the weights.

A replica with no row of micro-batch j skips its actions for j, and nobody sends to it. Only
floating values that carry a gradient (`boundary.ValueLayout.grad`) travel back. Sends are asynchronous and
waited for at the end of the step; receives block, which the schedules allow (they are deadlock
free with asynchronous sends; the simulator checks the same order). Messages pair up by their
order on their channel, activations or gradients: the order of `hetplan.lowering`'s lists for the
step. Gradients of replicas and of parameters that several stages share are summed afterwards
(`gradients.reduce_gradients`): since each slice's loss is weighted by its share of the batch,
the sums are the whole batch's gradients.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetplan.errors import HetplanError
from hetplan.lowering import RECV_F, Op, Pass, by_pass, channel
from hetplan.pieces import selective
from hetplan.pieces.mixed import Mixed
from hetplan.precision import FP32
from hetplan.rows import StepRows
from hetplan.runtime.boundary import ValueLayout, pack, packed_bytes, unpack
from hetplan.runtime.split_backward import backward_inputs, backward_weights
from hetplan.runtime.transport import Transport
from hetplan.schedule import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD


@dataclass(frozen=True)
class Role:
    """Who a rank is: replica `replica` of stage `stage`; `ranks[k][p]` is the rank of replica p of stage k."""

    stage: int
    replica: int
    ranks: tuple[tuple[int, ...], ...]
    rows: StepRows
    # `Stage.recompute`: "stage", keep only the inputs and outputs and run the forward again in the
    # backward; "block", the same around each piece (node) of the stage; "selective", as "block"
    # keeping the outputs of the pieces' products (`hetplan.pieces.selective`)
    recompute: str = "none"
    precision: str = FP32  # the arithmetic of its passes (`hetplan.pieces.mixed`)
    # tensor parallelism: groups[k][p], the ranks of replica p of stage k (ranks[k][p] first), and
    # this rank's place in its own group; only a group's first rank sends, to every rank of a group
    groups: tuple[tuple[tuple[int, ...], ...], ...] = ()
    position: int = 0

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self.members(self.stage, self.replica)[self.position]

    def members(self, stage: int, replica: int) -> tuple[int, ...]:
        """The ranks of replica `replica` of `stage`, which all receive what is sent to it."""
        return self.groups[stage][replica] if self.groups else (self.ranks[stage][replica],)

    def replica_of(self, stage: int, rank: int) -> int:
        """The replica of `stage` that `rank` belongs to."""
        return next(q for q in range(len(self.ranks[stage])) if rank in self.members(stage, q))

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == len(self.ranks) - 1


class Where:
    """Where a worker is in its step, for its heartbeat (`heartbeat.Heartbeat`): the op it runs or
    waits at, as `hetplan.lowering` prints it ("" between steps), and how many actions it has
    finished, which the launcher's watchdog counts as progress."""

    def __init__(self) -> None:
        self.at = ""
        self.done = 0


class StageRunner:
    """Runs the actions of one stage replica (`act`), for `RankRunner`."""

    def __init__(self, role: Role, module_for: Callable[[int], nn.Module], layouts_in: Sequence[ValueLayout],
                 layouts_out: Sequence[ValueLayout], transport: Transport, device: torch.device) -> None:
        self.role, self.module_for = role, module_for
        self.layouts_in, self.layouts_out = tuple(layouts_in), tuple(layouts_out)
        self.transport, self.device = transport, device
        self.mixed = Mixed(role.precision, device.type)
        self.loss_scale = 1.0  # what the last stage multiplies its loss by (fp16's loss scaling)
        # the step's spans, perf_counter clock: (kind, stage, micro-batch, start, end, from rank or -1)
        # for every action (-1) and every message received in it (the rank it came from)
        self.spans: list[tuple[str, int, int, float, float, int]] = []
        # called once a recomputation has rebuilt a micro-batch's activations, the stage's peak
        # inside its backward (`RankRunner` reads the memory in use there)
        self.rebuilt: Callable[[], None] = _nothing
        # what its step runs inside, backward included (a tensor-parallel stage's `running`)
        self.around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        # called after each backward (a stage whose replicas shard gradients: `zero.ShardedUnits.finish`)
        self.backward_done: Callable[[], None] = _nothing
        self.where = Where()  # the worker's (`RankRunner` gives its runners one)

    # --- who shares rows with whom -------------------------------------------------------
    def mine(self, j: int) -> tuple[int, int]:
        return self.role.rows.slices[self.role.stage][j][self.role.replica]

    def _holds_first_row(self, j: int, stage: int, replica: int, of_stage: int, of_replica: int) -> bool:
        """Whether (stage, replica) holds the first row of (of_stage, of_replica)'s slice of j."""
        lo, hi = self.role.rows.slices[stage][j][replica]
        first = self.role.rows.slices[of_stage][j][of_replica][0]
        return lo <= first < hi

    def _carried(self, layouts: Sequence[ValueLayout], whole: bool, grads: bool) -> list[int]:
        """Indices of the values a message carries: every value with a batch dimension, and the
        others only when `whole` (the receiver takes them from this sender); gradients: only
        values that carry one."""
        return [i for i, lay in enumerate(layouts)
                if (not grads or lay.grad) and (lay.batch_dim is not None or whole)]

    def _sender_whole(self, op: Op) -> bool:
        """Whether a message carries the values without batch dimension: those come from the
        replica of the earlier stage that holds the first row of the later one's slice."""
        me, q = self.role, self.role.replica_of(op.peer_stage, op.peer)
        if op.peer_stage < me.stage:
            return self._holds_first_row(op.microbatch, op.peer_stage, q, me.stage, me.replica)
        return self._holds_first_row(op.microbatch, me.stage, me.replica, op.peer_stage, q)

    # --- messages: each the op of the lowered list that says what, to whom and which rows ---
    def _send(self, op: Op, values: list[torch.Tensor], pending: list) -> None:
        buf = pack(values, self.transport.wire((self.role.rank, op.peer)))
        pending.append((self.transport.isend(buf, op.peer, channel(op)), buf))

    def _recv(self, metas: list[tuple[torch.dtype, tuple[int, ...]]], op: Op) -> list[torch.Tensor]:
        """The message's values on this worker's device: received there where the transport
        carries it there (`Transport.wire`), else through the host."""
        buf = torch.empty(packed_bytes(metas), dtype=torch.uint8, device=self.transport.wire((self.role.rank, op.peer)))
        self.transport.recv(buf, op.peer, channel(op))
        return unpack(buf.to(self.device), metas)

    def _gather(self, receives: Sequence[Op], layouts: Sequence[ValueLayout], grads: bool) -> list[list[torch.Tensor]]:
        """Per value, the parts its receives bring (received in the list's order), in the order
        of their rows."""
        got: list[tuple[tuple[int, int], list[int], list[torch.Tensor]]] = []
        for op in receives:
            idx = self._carried(layouts, self._sender_whole(op), grads)
            metas = [(layouts[i].dtype, layouts[i].shape_for(op.rows[1] - op.rows[0])) for i in idx]
            began, was = time.perf_counter(), self.where.at
            self.where.at = str(op)
            got.append((op.rows, idx, self._recv(metas, op)))
            self.where.at = was
            self.spans.append((FORWARD if op.kind == RECV_F else BACKWARD, op.peer_stage, op.microbatch, began,
                               time.perf_counter(), op.peer))
        parts: list[list[torch.Tensor]] = [[] for _ in layouts]
        for _, idx, values in sorted(got, key=lambda g: g[0]):
            for i, value in zip(idx, values, strict=True):
                parts[i].append(value)
        return parts

    # --- actions ---------------------------------------------------------------------------
    def _forward(self, j: int, batch: Sequence[torch.Tensor], saved: dict, pending: list, step: Pass) -> None:
        lo, hi = self.mine(j)
        if self.role.first:
            start = self.role.rows.start[j]
            inputs = [v[start + lo:start + hi].to(self.device) for v in batch]
        else:
            parts = self._gather(step.receives, self.layouts_in, False)
            inputs = []
            for lay, got in zip(self.layouts_in, parts, strict=True):
                value = lay.join(got) if lay.batch_dim is not None else got[0]
                inputs.append(value.requires_grad_(True) if lay.grad else value)
        module = self.module_for(hi - lo)
        # torch's non-reentrant checkpoint keeps the inputs, restores the RNG state and autocast's
        # and runs the forward again when the backward first needs what it saved
        with self.mixed.forward():
            out = self._run(module, inputs)
        outs = out if isinstance(out, tuple) else (out,)
        saved[j] = (inputs, outs)
        packed: dict[tuple[int, int], list[torch.Tensor]] = {}  # a group's ranks get one message's values
        for op in step.sends:
            if op.rows not in packed:
                idx = self._carried(self.layouts_out, self._sender_whole(op), False)
                packed[op.rows] = [self._as_sent(self.layouts_out[i], self.layouts_out[i].take(
                    outs[i], op.rows[0] - lo, op.rows[1] - lo)) for i in idx]
                self._check(packed[op.rows], idx, op.rows[1] - op.rows[0])
            self._send(op, packed[op.rows], pending)

    def _run(self, module: nn.Module, inputs: list[torch.Tensor]):
        """The stage's forward, recomputed in its backward as `Role.recompute` says."""
        if self.role.recompute == "stage":
            return checkpoint(_once_per_step(module, self.rebuilt), *inputs, use_reentrant=False)
        if self.role.recompute in ("block", "selective"):
            more = {"context_fn": selective.contexts} if self.role.recompute == "selective" else {}
            return module.run(inputs, lambda piece, args: checkpoint(_once_per_step(piece, self.rebuilt), *args,
                                                                     use_reentrant=False, **more))
        return module(*inputs)

    def _as_sent(self, lay: ValueLayout, value: torch.Tensor) -> torch.Tensor:
        """In mixed precision, a floating value in the dtype its boundary carries: the layouts come
        from a probe under the CPU's autocast, and CUDA's runs some operators in another dtype
        (layer norm in fp32 where the CPU keeps bf16), so a GPU stage's value is cast to what its
        receiver expects (gradients come back cast to the value's own dtype: `_output_grads`)."""
        if self.mixed.on and value.dtype != lay.dtype and value.is_floating_point() and lay.dtype.is_floating_point:
            return value.to(lay.dtype)
        return value

    def _check(self, values: list[torch.Tensor], idx: list[int], rows: int) -> None:
        for v, i in zip(values, idx, strict=True):
            lay = self.layouts_out[i]
            if tuple(v.shape) != lay.shape_for(rows) or v.dtype != lay.dtype:
                raise HetplanError(f"stage {self.role.stage} made {lay.name!r} as {v.dtype} {tuple(v.shape)}, but "
                                   f"{lay.dtype} {lay.shape_for(rows)} was expected for "
                                   f"{rows} rows: the model's shapes change between micro-batches")

    def _backward(self, j: int, saved: dict, pending: list, step: Pass) -> float:
        """B, or I of a split backward (what W then needs is kept in `saved`, under (W, j));
        either sends the inputs' gradients to stage k - 1."""
        lo, hi = self.mine(j)
        inputs, outs = saved.pop(j)
        loss = 0.0
        if self.role.last:
            weight = (hi - lo) / self.role.rows.batch_size
            tensors = [outs[0] * (weight * self.loss_scale)]
            grads = [torch.ones((), dtype=outs[0].dtype, device=outs[0].device)]
            loss = float(outs[0].detach().float().item()) * weight
        else:
            tensors, grads = self._output_grads(outs, step.receives)
        if step.op.kind == BACKWARD_INPUT:
            params = [prm for prm in self.module_for(hi - lo).parameters() if prm.requires_grad]
            saved[(BACKWARD_WEIGHT, j)] = backward_inputs(tensors, grads, inputs, params)
        elif tensors:
            torch.autograd.backward(tensors, grads)
            self.backward_done()
        packed: dict[tuple[int, int], list[torch.Tensor]] = {}
        for op in step.sends:
            if op.rows not in packed:
                idx = self._carried(self.layouts_in, self._sender_whole(op), True)
                grads_in = [inputs[i].grad if inputs[i].grad is not None else torch.zeros_like(inputs[i]) for i in idx]
                packed[op.rows] = [self.layouts_in[i].take(g, op.rows[0] - lo, op.rows[1] - lo)
                                   for i, g in zip(idx, grads_in, strict=True)]
            self._send(op, packed[op.rows], pending)
        return loss

    def _output_grads(self, outs, receives: Sequence[Op]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs that carry a gradient and their gradients, received from stage k + 1."""
        parts = self._gather(receives, self.layouts_out, True)
        tensors, grads = [], []
        for lay, out, got in zip(self.layouts_out, outs, parts, strict=True):
            if lay.grad and got and out.requires_grad:
                tensors.append(out)
                grad = lay.join(got) if lay.batch_dim is not None else torch.stack(got).sum(0)
                grads.append(grad.to(out.dtype))  # a no-op unless the value was cast to be sent
        return tensors, grads

    def act(self, step: Pass, batch: Sequence[torch.Tensor], saved: dict, pending: list) -> float:
        """Run one pass of the lowered list with its receives and sends; returns its share of the
        batch's mean loss (B or I on the last stage)."""
        kind, j = step.op.kind, step.op.microbatch
        if kind == FORWARD:
            self._forward(j, batch, saved, pending, step)
        elif kind == BACKWARD_WEIGHT:
            backward_weights(saved.pop((BACKWARD_WEIGHT, j)))
        else:
            return self._backward(j, saved, pending, step)
        return 0.0


def _nothing() -> None:
    return None


def _once_per_step(module: nn.Module, rebuilt: Callable[[], None]) -> Callable[..., object]:
    """The module's forward, whose second run (the recomputation) leaves its buffers as it found
    them: batch norm's running statistics count each micro-batch once, as without it; `rebuilt`
    is called when that run ends, its activations all there. (torch stops a recomputation early,
    by an exception, once it has rebuilt what the backward needs: hence `finally`.)"""
    runs = 0

    def forward(*inputs: torch.Tensor) -> object:
        nonlocal runs
        runs += 1
        if runs == 1:
            return module(*inputs)
        kept = [b.detach().clone() for b in module.buffers()]
        try:
            return module(*inputs)
        finally:
            rebuilt()
            with torch.no_grad():
                for b, value in zip(module.buffers(), kept, strict=True):
                    b.copy_(value)

    return forward


class RankRunner:
    """Runs a worker's actions in its rank's order over the stages it holds; `step(batch)` runs
    one training step's actions."""

    def __init__(self, runners: Sequence[StageRunner], ops: Sequence[Op],
                 memory: Callable[[], int | None] | None = None, where: Where | None = None) -> None:
        self.runners = {r.role.stage: r for r in runners}
        self.where = where or Where()
        for runner in runners:
            runner.where = self.where
        self.passes = by_pass(ops)  # the rank's lowered list (`hetplan.lowering`), pass by pass
        self.executed: list[str] = []  # the actions of the last step, as run (tests compare it with the simulator)
        self.spans: list[tuple[str, int, int, float, float, int]] = []  # the last step's (`StageRunner.spans`)
        # the process's memory in use, read after each action and when a recomputation has
        # rebuilt its activations (`hostmem.malloc_in_use_bytes`), and the most the last step read
        self.memory, self.peak_bytes = memory, 0
        if memory is not None:
            for runner in runners:
                runner.rebuilt = self.read_memory

    def step(self, batch: Sequence[torch.Tensor] = (), loss_scale: float = 1.0) -> float:
        """Run the step's actions; returns this worker's share of the batch's mean loss (the last
        stage's; 0 elsewhere). `batch`: the whole batch's input values (stage 0 only);
        `loss_scale`: what the last stage multiplies the loss by before its backward (fp16)."""
        saved: dict[int, dict] = {k: {} for k in self.runners}
        pending: list = []
        self.executed, self.peak_bytes = [], 0
        for runner in self.runners.values():
            runner.spans, runner.loss_scale = [], loss_scale
        with next(iter(self.runners.values())).mixed.step(), contextlib.ExitStack() as stack:
            for runner in self.runners.values():
                stack.enter_context(runner.around())
            loss = self._actions(batch, saved, pending)
        for handle, _ in pending:
            handle.wait()
        self.spans = sorted((s for r in self.runners.values() for s in r.spans), key=lambda s: s[3])
        return loss

    def _actions(self, batch: Sequence[torch.Tensor], saved: dict, pending: list) -> float:
        loss = 0.0
        for step in self.passes:
            op = step.op
            runner = self.runners[op.stage]
            self.executed.append(str(op))
            self.where.at = str(op)
            began = time.perf_counter()
            loss += runner.act(step, batch, saved[op.stage], pending)
            self.where.done += 1
            runner.spans.append((op.kind, op.stage, op.microbatch, began, time.perf_counter(), -1))
            self.read_memory()
        return loss

    def read_memory(self) -> None:
        """The memory in use now, kept where it is the step's most so far."""
        now = self.memory() if self.memory is not None else None
        if now is not None and now > self.peak_bytes:
            self.peak_bytes = now
