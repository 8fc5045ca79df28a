"""A worker: one process per device of the plan, one pipeline stage each (several where the
schedule interleaves: stages k, k + n, ...).

Run by the local launcher (`hetplan run`), which sets RANK, WORLD_SIZE and a file for the ranks
to meet at ($HETPLAN_RENDEZVOUS), or by `torchrun`, which sets RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (`backend.init_method`):

    python -m hetplan.runtime.worker RUN.json

RUN.json (`hetplan.runtime.spec.RunSpec`, made by `hetplan.runtime.launch.run_spec`) names the
plan, the model and the run's settings, the replicas' weights (their speed, from the cost model)
and for each rank its stage, replica and device binding. Every rank builds the same model from
the same seed, cuts the step into the profiler's pieces and keeps its own stage
(`hetplan.runtime.rank`; the local launcher's workers are forked with those made once for all,
`hetplan.runtime.group`), then runs its rank's list of the step over the run's backend
(`hetplan.runtime.executor`, `hetplan.runtime.backend`), sums gradients over replicas and over stages that share a
parameter, and takes an optimizer step. Workers write a heartbeat file
(the launcher's watchdog reads it: each step, and within a step the action a worker is at) and
rank 0 writes the result: per-step wall times (between two barriers), the last stage's share of
the losses, each worker's peak memory, the actions it ran and, per step, its compute and
communication time (`step_busy_comm`). HETPLAN_FAULT=hang:RANK:STEP makes a worker hang inside a
step (after its first barrier, so that the others wait for its messages), die:RANK:STEP exit
before it, to test the launcher's handling of faults.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from hetplan.lowering import BARRIER, CHECKPOINT, SUMS, check_lowered, lower
from hetplan.precision import scales_loss
from hetplan.runtime.heartbeat import Heartbeat, write_json
from hetplan.runtime.saving import resume, save_when_due
from hetplan.runtime.supervise import LAUNCHER_PID, LOST_PEER, end_with_launcher

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from hetplan.runtime.spec import RunSpec


def _batches(spec: RunSpec, zoo_model, step: int):
    """The batch of a step: the model's own data when it has some (ctr-dnn's click log), else
    synthetic (shaped like the profiled batch, following a hidden rule a model can learn) or a
    window of the text corpus (language models); `hetplan.runtime.data`."""
    from hetplan.runtime.data import input_vocab, synthetic_batch, text_batch

    if zoo_model.batches is not None:
        return zoo_model.batches(step, spec.settings.seed)
    if spec.settings.data == "text":
        return text_batch(zoo_model.batch, step, seed=spec.settings.seed, vocab=input_vocab(zoo_model.step))
    return synthetic_batch(zoo_model.batch, step, seed=spec.settings.seed)


def _optimizer(spec: RunSpec, params: list, sparse_ids=None):
    """Adam or SGD over the stage's parameters, SparseAdam beside Adam for embedding tables with
    sparse gradients (`hetplan.pieces.optim`)."""
    from hetplan.pieces.optim import StageOptimizer

    if not params:  # a stage without parameters (a lone GELU, a reshape) has nothing to update
        return None
    return StageOptimizer(params, spec.settings.optimizer, spec.settings.lr, sparse_ids)


# gloo gives up on a silent peer this long after the launcher's watchdog would have stopped the
# run (`--timeout-s`), so that the watchdog, which says where every worker is, speaks first
GLOO_AFTER_S = 5.0


def rank_model(spec: RunSpec, shared=None):
    """The run's zoo model as a rank trains it: built from the run's seed (or taken from `shared`,
    `traces.SharedTraces`), its dropout off under --no-dropout."""
    from hetplan.zoo import load_model
    from hetplan.zoo.faithful import switch_off_dropout

    s = spec.settings
    if shared is None:
        zoo_model = load_model(spec.model, batch_size=s.batch_size, seq_len=s.seq_len, seed=s.seed)
    else:
        zoo_model = shared.model(spec.model, s.batch_size, s.seq_len, s.seed)
    if s.no_dropout:
        switch_off_dropout(zoo_model.step)
    return zoo_model


def build_rank(spec: RunSpec, rank: int, heartbeat=None, shared=None):
    """The rank's model, traces, stage and optimizer (`hetplan.runtime.rank`); `shared`: the
    model and traces of the ranks built before it in this process (`traces.SharedTraces`)."""
    import torch

    from hetplan.runtime.rank import prepare

    me = spec.ranks[rank]
    zoo_model = rank_model(spec, shared)
    device = torch.device(me.binding if me.on_cuda else "cpu")
    on_trace = (lambda rows: heartbeat(f"tracing {rows} rows", -1)) if heartbeat is not None else None
    prepared = prepare(spec, rank, zoo_model, spec.plan, device, on_trace, shared)
    return zoo_model, prepared, _optimizer(spec, prepared.optimized(), prepared.sparse)


class _StageMemory:
    """A worker's tensors at their peak, on a CPU: the rise of the process's memory in use
    (`hostmem.malloc_in_use_bytes`) over its level before the first step, read after each action,
    when a recomputation has rebuilt its activations (inside a backward) and after the
    optimizer's step, plus the parameters' bytes (there before); the most of the steps after the
    warm-up. A peak inside an action otherwise (the backward's temporaries) is not seen.

    What the worker holds between steps besides its tensors is left out: at each step's start
    (gradients dropped) the rise over the first level less the optimizer's state (its tensors'
    bytes) is what the libraries keep (oneDNN caches its kernels and their scratch space for each
    shape of a 16-bit product: 1.6-2.9 MB each on this VM's CPU, 8 MB for gpt2-tiny in bf16),
    reported apart (`library_bytes`)."""

    def __init__(self, read: Callable[[], int | None], params: Sequence[torch.Tensor],
                 state_bytes: Callable[[], int]) -> None:
        self.read, self.base, self.state_bytes = read, read(), state_bytes
        self.params = sum(p.numel() * p.element_size() for p in params)
        self.steps: list[int] = []
        self.library: list[int] = []

    def start(self) -> None:
        """At a step's start, its gradients dropped."""
        now = self.read()
        if now is not None and self.base is not None:
            self.library.append(max(0, now - self.base - self.state_bytes()))

    def step(self, runner_peak: int) -> None:
        self.steps.append(max(runner_peak, self.read() or 0) - (self.library[-1] if self.library else 0))

    def peak_bytes(self, warmup: int) -> int | None:
        if self.base is None or not self.steps:
            return None
        return max(self.steps[warmup:] or self.steps) - self.base + self.params

    def library_bytes(self, warmup: int) -> int | None:
        return max(self.library[warmup:] or self.library) if self.library else None


class _NoMemory(_StageMemory):
    """Where the worker cannot read its memory (a GPU's is CUDA's; threads share a process)."""

    def __init__(self) -> None:
        super().__init__(lambda: None, (), lambda: 0)

    def step(self, runner_peak: int) -> None:
        return None


def train(spec: RunSpec, rank: int, zoo_model, prepared, opt, transport, heartbeat: Heartbeat | None = None,
          memory=None) -> dict:
    """The rank's steps: each between two barriers, its actions, the gradient sums, the optimizer.
    `memory`: the process's memory in use, where the worker has the process to itself."""
    from functools import partial

    from hetplan.runtime.executor import RankRunner, StageRunner
    from hetplan.runtime.precision import LossScaler
    from hetplan.runtime.tensor_parallel import surround

    role = prepared.role
    runner = RankRunner([StageRunner(r, partial(prepared.module_for, stage=r.stage), lay_in, lay_out, transport,
                                     prepared.device) for r, (lay_in, lay_out) in zip(prepared.roles, prepared.layouts,
                                                                                      strict=True)], prepared.ops,
                        memory, heartbeat.where if heartbeat is not None else None)
    surround(runner, prepared)
    scaler = LossScaler() if scales_loss(spec.plan.precision) else None
    resume(spec, runner, prepared, opt, transport, zoo_model, scaler)
    times, losses, trace, busy_s, comm_s = [], [], [], [], []
    fault = os.environ.get("HETPLAN_FAULT", "").split(":")  # fault injection, to test the watchdog
    params = prepared.parameters()
    held = _StageMemory(memory, _resident(prepared), opt.state_bytes if opt is not None else lambda: 0) \
        if memory is not None else _NoMemory()
    for step in range(spec.settings.resume_step, spec.settings.steps):
        if heartbeat is not None:
            heartbeat.beat("step", step)
        faulty = len(fault) == 3 and int(fault[1]) == rank and int(fault[2]) == step
        if faulty and fault[0] == "die":
            os._exit(3)
        batch = _batches(spec, zoo_model, step) if prepared.first else {}
        values = tuple(batch[k] for k in prepared.traces.input_keys) if prepared.first else ()
        runner.where.at = BARRIER
        transport.barrier()
        runner.where.at = ""
        if faulty and fault[0] == "hang":  # inside the step: the others wait for its messages
            time.sleep(10**6)
        t0 = time.perf_counter()
        for prm in params + [group.shard for group in prepared.shards] + [s for u in prepared.units for s in u.shards]:
            prm.grad = None
        held.start()
        loss = runner.step(values, scaler.scale if scaler is not None else 1.0)
        tail = _reduce_and_update(prepared, opt, transport, scaler, spec.world, runner.where)
        held.step(runner.peak_bytes)
        runner.where.at = BARRIER
        transport.barrier()
        runner.where.at = ""
        times.append(time.perf_counter() - t0)
        busy, comm = step_busy_comm(runner.spans, tail)
        busy_s.append(busy)
        comm_s.append(comm)
        if spec.settings.trace:
            trace = step_trace(runner.spans, tail, role.stage, t0)
        if prepared.last:
            losses.append(loss)
        runner.where.at = CHECKPOINT
        if save_when_due(spec, prepared, opt, step, zoo_model, transport, scaler):
            break  # the launcher's stop (`supervise.stop_step`)
    for units in prepared.units:  # the weights whole again for whoever reads them next
        units.gather_all()
    out = {"times_s": times, "losses": losses, "actions": runner.executed, "busy_s": busy_s, "comm_s": comm_s,
           "tensor_peak_bytes": held.peak_bytes(spec.settings.warmup),
           "library_bytes": held.library_bytes(spec.settings.warmup),
           **({"loss_scale": scaler.scale, "skipped_steps": scaler.skipped} if scaler is not None else {})}
    if spec.settings.trace:
        out["trace"] = trace  # the last step's
    return out


def _shard_collectives(prepared, transport) -> bool | None:
    """Whether its sharded stages reduce-scatter and all-gather by the backend's collectives (NCCL
    among GPU workers) rather than rings on the host; None where it shards nothing."""
    sharded = [group.ranks for group in (*prepared.shards, *prepared.units)]
    return transport.collectives(tuple(sharded[0])) if sharded else None


def _resident(prepared) -> list:
    """The parameters a worker holds between steps: where its replicas shard the weights
    (`Stage.shard` 3), its shares in their stead."""
    freed = {id(p) for units in prepared.units if units.level == 3 for p in units.params}
    return [p for p in prepared.parameters() if id(p) not in freed] + [
        s for units in prepared.units if units.level == 3 for s in units.shards]


def _reduce_and_update(prepared, opt, transport, scaler=None, world: int = 1, where=None) -> tuple[float, float, float]:
    """The step's gradient sums (`runtime.sums`) and optimizer step (fp16: unscaled, and skipped by every worker
    when one found an inf or nan: `hetplan.runtime.precision`); returns when each began and when
    the step's work ended (a GPU's queue drained)."""
    import torch

    from hetplan.runtime.precision import agreed_step
    from hetplan.runtime.sums import run_sums

    t_ar = time.perf_counter()
    run_sums(prepared, transport, where)  # as its list says: all-reduces, sharded stages' reduce-scatters
    if where is not None:
        where.at = SUMS
    t_opt = time.perf_counter()
    steps = scaler is None or agreed_step(scaler, prepared.optimized(),
                                          lambda t: transport.all_reduce(t, tuple(range(world))) if world > 1 else None)
    if opt is not None and steps:
        opt.step()
    for group in prepared.shards if steps else ():  # every worker skips or steps alike
        group.gather(transport)
    for units in prepared.units if steps else ():
        units.gather_updates()
    if prepared.device.type == "cuda":
        torch.cuda.synchronize(prepared.device)
    return t_ar, t_opt, time.perf_counter()


def step_busy_comm(spans, tail: tuple[float, float, float]) -> tuple[float, float]:
    """A step's compute and communication time, from the executor's spans and `_reduce_and_update`'s
    times: busy = the forward and backward actions less the receives inside them, plus the optimizer
    step; communication = the receives (waiting for the sender included) plus the gradient all-reduce
    (waiting for the other replicas included). Sends are posted without waiting: in neither."""
    t_ar, t_opt, t_end = tail
    actions = sum(end - start for _, _, _, start, end, src in spans if src < 0)
    received = sum(end - start for _, _, _, start, end, src in spans if src >= 0)
    return actions - received + (t_end - t_opt), received + (t_opt - t_ar)


def step_trace(spans, tail: tuple[float, float, float], stage: int, t0: float) -> list[list]:
    """A step's spans from its start (`t0`, when the workers left the barrier): every action
    and message of the executor, then the gradient all-reduce and the optimizer step (spans of
    no length are left out). Rows: [kind, stage, micro-batch, start_s, end_s, from rank or -1]."""
    t_ar, t_opt, t_end = tail
    rows = [[kind, st, mb, a - t0, b - t0, src] for kind, st, mb, a, b, src in spans]
    rows += [[kind, stage, -1, a - t0, b - t0, -1] for kind, a, b in (("AR", t_ar, t_opt), ("OPT", t_opt, t_end))
             if b > a]
    return rows


def run_worker(spec: RunSpec, rank: int, world: int, shared=None) -> None:
    """`shared`: the model and traces made for this launch's workers before this one was forked
    (`runtime.group`), or None: it builds and traces its own."""
    import torch

    from hetplan.pieces.hostmem import keep_freed_memory, malloc_in_use_bytes
    from hetplan.runtime.backend import backend_of
    from hetplan.runtime.rank import group_table, spec_rows
    from hetplan.runtime.tensor_parallel import attach_meshes
    from hetplan.runtime.transport import GlooTransport

    out_dir = spec.settings.out_dir
    me = spec.ranks[rank]

    beats = Heartbeat(spec, rank)
    heartbeat = beats.beat
    heartbeat("starting", -1)
    if os.environ.get("HETPLAN_CPUS"):  # the launcher's cores for this worker (see launch.pin_cores)
        os.sched_setaffinity(0, [int(c) for c in os.environ["HETPLAN_CPUS"].split(",")])
    torch.set_num_threads(me.threads)
    keep_freed_memory()  # as the profiler measured (hostmem)
    zoo_model, prepared, opt = build_rank(spec, rank, heartbeat, shared)  # each trace moves the heartbeat
    groups = [ranks for ranks, _, _ in prepared.groups if len(ranks) > 1]
    groups += [leads for leads, _, _ in prepared.mixed] + list(prepared.tp_groups)
    # the workers agree on fp16's steps (`runtime.precision`) and on an elastic run's stop (`saving.agreed_stop`)
    if (scales_loss(spec.plan.precision) or spec.settings.elastic) and world > 1:
        groups.append(tuple(range(world)))
    check_lowered(lower(spec.plan.schedule, group_table(spec), spec.plan.stage_ranks, spec_rows(spec, spec.plan),
                        [ranks for _, ranks in prepared.sums]))  # its messages pair and its sums meet
    bindings = [r.binding for r in spec.ranks]
    transport = GlooTransport(rank, world, list(dict.fromkeys(groups)), spec.settings.timeout_s + GLOO_AFTER_S,
                              bindings, backend_of(spec.settings.backend, bindings))
    device = prepared.device
    attach_meshes(prepared, transport)
    try:
        mine = train(spec, rank, zoo_model, prepared, opt, transport, beats,
                     memory=malloc_in_use_bytes if device.type == "cpu" else None)
    finally:
        beats.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # the worker's tensors: CUDA's allocator, or on a CPU the rise of malloc's memory in use; the
    # process's resident size where neither can say
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else mine.pop("tensor_peak_bytes") or rss
    mine.update(rank=rank, stage=me.stage, replica=me.replica, tp=me.tp, device=me.device, peak_mem_bytes=peak,
                rss_peak_bytes=rss, backend=transport.backend,
                shard_collectives=_shard_collectives(prepared, transport))
    gathered = transport.gather_objects(mine, world)
    if spec.settings.return_weights:
        torch.save({name: p.detach().cpu() for name, p in prepared.named_parameters().items()},
                   out_dir / f"weights.{rank}.pt")
    if rank == 0:
        write_json(out_dir / "result.json", {"ranks": gathered})
    heartbeat("done", spec.settings.steps)
    transport.close()


def main(argv: list[str] | None = None, shared=None) -> int:
    """`shared`: see `run_worker`."""
    argv = sys.argv[1:] if argv is None else argv
    end_with_launcher()
    from hetplan.runtime.spec import RunSpec

    if len(argv) != 1:
        print("usage: python -m hetplan.runtime.worker RUN.json (under hetplan run or torchrun)", file=sys.stderr)
        return 2
    spec = RunSpec.from_json(Path(argv[0]).read_text())
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        print("hetplan worker: RANK and WORLD_SIZE are not set; start workers with hetplan run or torchrun",
              file=sys.stderr)
        return 2
    try:
        run_worker(spec, rank, world, shared)
    except Exception as exc:  # noqa: BLE001 - the launcher reports it, naming the worker
        me = spec.ranks[rank] if rank < spec.world else None
        stage, device = (me.stage, me.device) if me is not None else (None, None)
        said = (f"worker {rank} (stage {stage}, device {device}): {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n{traceback.format_exc()}")
        error = spec.settings.out_dir / f"error.{rank}"
        try:
            error.write_text(said)
        except OSError:  # the folder cannot take it (a full disk): the launcher says so instead
            error.unlink(missing_ok=True)
        from hetplan.runtime.transport import lost_peer

        return LOST_PEER if lost_peer(exc) else 1
    if rank == 0 and LAUNCHER_PID not in os.environ:  # started by torchrun: nobody else sums it up
        print(_summed_up(spec), flush=True)
    return 0


def _summed_up(spec) -> str:
    """The run's summary line; the training went well, so a failure here is a note, not an error."""
    from hetplan.runtime.run import finish_elsewhere

    try:
        return finish_elsewhere(spec)
    except Exception as exc:  # noqa: BLE001 - the results are in result.json whatever happens here
        return (f"hetplan: run finished, results in {spec.settings.out_dir}/result.json; no summary for hetplan report "
                f"({type(exc).__name__}: {str(exc).strip()[:200]})")


if __name__ == "__main__":
    sys.exit(main())
