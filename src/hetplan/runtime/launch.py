"""Launching a plan's workers on this machine, watching them, and measuring the step.

`launch` writes RUN.json, starts one worker process per stage replica of the plan (forked from a
process that has imported torch, `hetplan.forked`; the same as `python -m
hetplan.runtime.worker RUN.json`) (RANK and WORLD_SIZE in their environment, as torchrun would
set them, and a file to meet at in place of torchrun's MASTER_ADDR and MASTER_PORT:
`backend.init_method`) and watches them: when a worker exits with an error,
or no worker's heartbeat moves for `timeout_s`, every worker is stopped (SIGTERM, then SIGKILL)
and the error names the worker and its stage. Gloo's own timeout is the same, so a worker waiting
for a dead peer fails by itself too. The measured step is the median wall time of the steps after
the warm-up, each timed between two barriers on every worker (the slowest worker's time).

Several machines: run the same worker under torchrun on each, with RUN.json copied to all of them
(docs/guide.md: "Several machines", under "Running a plan").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hetplan import forked
from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.io.serde import atomic_write_text
from hetplan.lowering import check_lowered, describe, lower, rank_groups
from hetplan.machine import core_ids
from hetplan.plan import Plan
from hetplan.rows import StepRows, idle_replicas, step_rows
from hetplan.runtime.backend import MIXED, RENDEZVOUS_ENV, backend_of
from hetplan.runtime.settings import RunSettings
from hetplan.runtime.spec import RankSpec, RunSpec
from hetplan.runtime.supervise import (
    LAUNCHER_PID,
    LOST_PEER,
    STOP_FILE,
    clear_failed_run,
    run_folder_lock,
    space_left,
    stop_on_terminate,
)
from hetplan.runtime.support import gpu_tp_groups, runtime_refusal

CAUSE_GRACE_S = 2.0  # how long a lost peer waits for the failure that caused it to be seen
TRACING_LOG = "tracing.log"  # the output of the process that traces for the workers (`runtime.group`)


class WorkerFailure(HetplanError):
    """A worker died or hung; the message names it and its stage. `devices`: those of the workers
    that died (none for a hang: no device is known lost), `step`: the furthest step any worker began."""

    def __init__(self, message: str, devices: tuple[str, ...] = (), step: int = 0) -> None:
        super().__init__(message)
        self.devices, self.step = devices, step


@dataclass(frozen=True)
class RunResult:
    steps: int
    warmup: int
    step_times_s: tuple[float, ...]  # per step, the slowest worker's
    losses: tuple[float, ...]
    peak_mem_bytes: dict[str, int]  # per device
    out_dir: str
    ranks: tuple[dict, ...] = field(default=())

    @property
    def measured_step_s(self) -> float:
        timed = self.step_times_s[self.warmup:] or self.step_times_s
        return statistics.median(timed)


def _check_cuda(device_id: str, binding: str) -> None:
    """A local CUDA binding must name a GPU this machine has (remote hosts check their own)."""
    import torch

    index = int(binding.split(":", 1)[1]) if ":" in binding else 0
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        gpus = f"{count or 'no'} CUDA GPU{'s' if count != 1 else ''}"
        raise HetplanError(f"device {device_id} is bound to {binding}, but this machine has {gpus}: "
                           "bind it to cpu or run on a GPU machine")


def replica_weights(plan: Plan, cluster: Cluster, graph: Graph | None) -> tuple[tuple[float, ...], ...]:
    """Per stage, its replicas' weights (speeds on the stage), from the cost model the simulator
    uses, so that the runtime gives each replica the rows the prediction gave it. Without a
    graph, replicas of one device type share equally."""
    if graph is not None:
        return CostModel(graph, cluster).replica_weights(plan)
    for stage in plan.stages:
        types = {cluster.device(d).type for d in stage.devices}
        if len(types) > 1:
            raise HetplanError(f"stage {plan.stages.index(stage)} has replicas of different types "
                               f"({', '.join(sorted(types))}); pass --graph G so that each gets the rows its speed "
                               "is worth")
    return tuple((1.0,) * len(s.devices) for s in plan.stages)


def _given_weights(plan: Plan, weights: Sequence[Sequence[float]]) -> Sequence[Sequence[float]]:
    shape = [len(s.devices) for s in plan.stages]
    if [len(w) for w in weights] != shape or any(x <= 0 for w in weights for x in w):
        raise HetplanError(f"replica weights {[list(w) for w in weights]}: give one weight > 0 per replica, "
                           f"stage by stage ({shape} replicas)")
    return weights


def run_spec(plan: Plan, cluster: Cluster, model: str, settings: RunSettings, *, graph: Graph | None = None,
             weights: Sequence[Sequence[float]] | None = None) -> RunSpec:
    """The RUN.json of a plan (`RunSpec`): the settings (complete: a batch size and a
    granularity; `hetplan.runtime.run.prepare_run` works them out from a graph), the replicas'
    weights and the workers, host by host, each with its (first) stage, replica and device. What the
    runtime can run is `hetplan.runtime.support`; the batch is split by `hetplan.rows`. `weights`
    (per stage, one per replica) replaces the cost model's speeds: for replicas whose speeds the
    caller knows."""
    why = runtime_refusal(plan, cluster)
    if why:
        raise HetplanError(why)
    if settings.batch_size is None or settings.granularity is None:
        raise HetplanError("run_spec needs the settings' batch_size and granularity; prepare_run takes them from a "
                           "graph")
    if plan.microbatches > settings.batch_size:
        raise HetplanError(f"the plan has {plan.microbatches} micro-batches but the batch only {settings.batch_size} "
                           f"samples: plan with --microbatches {settings.batch_size} or fewer")
    # torchrun numbers ranks host by host: so do we (`hetplan.lowering.rank_groups`, which the cost
    # model's gradient sums follow too), and a stage's replicas may sit on any hosts (`rank.rank_table`);
    # a tensor-parallel group's workers follow its first, on its host
    groups = rank_groups(plan, lambda d: cluster.device(d).host)
    ranks: dict[int, RankSpec] = {}
    for k in (held[0] for held in plan.rank_stages):  # a worker is known by its first stage
        for p, group in enumerate(plan.stages[k].groups):
            for i, d in enumerate(group):
                device = cluster.device(d)
                binding = device.binding or "cpu"
                threads = 1 if binding.startswith("cuda") else device.threads or 1
                ranks[groups[k][p][i]] = RankSpec(stage=k, replica=p, device=device.id, host=device.host,
                                                  binding=binding, threads=threads, tp=i)
    weights = tuple(tuple(float(x) for x in w)
                    for w in (_given_weights(plan, weights) if weights else replica_weights(plan, cluster, graph)))
    rows = step_rows(settings.batch_size, plan.microbatches, weights)
    _check_every_replica_has_rows(plan, rows)
    check_lowered(lower(plan.schedule, groups, plan.stage_ranks, rows))  # its messages pair, nothing deadlocks
    backend = backend_of(settings.backend, [ranks[r].binding for r in sorted(ranks)])  # or refuse it now
    on_gpus = gpu_tp_groups(plan, cluster)
    if on_gpus and backend != MIXED:
        raise HetplanError(f"the tensor-parallel group {', '.join(on_gpus[0])} is on GPUs, whose collectives need "
                           f"NCCL, and this run talks over {backend} (--backend {settings.backend}"
                           f"{'' if settings.backend == 'gloo' else ' on a torch without NCCL'}): run with --backend "
                           "auto on a CUDA build of torch, or plan with --max-tp 1")
    return RunSpec(plan=plan, model=model, settings=settings, replica_weights=weights,
                   ranks=tuple(ranks[r] for r in sorted(ranks)))


def _check_every_replica_has_rows(plan: Plan, rows: StepRows) -> None:
    """A stage whose replicas shard gradients runs collectives in every micro-batch's actions
    (`hetplan.runtime.zero`), so each of its replicas needs rows of every micro-batch."""
    for k, p in idle_replicas(rows, [s.shard >= 2 for s in plan.stages]):
        if plan.stages[k].shard >= 2:
            j = next(j for j, mb in enumerate(rows.slices[k]) if mb[p][1] == mb[p][0])
            raise HetplanError(f"stage {k} shards its gradients (shard {plan.stages[k].shard}) but its replica {p} "
                               f"has no row of micro-batch {j}: use fewer micro-batches or a larger batch, or "
                               "shard 1")


def write_spec(spec: RunSpec) -> Path:
    """Write RUN.json into the run folder (made if missing)."""
    path = spec.settings.out_dir / "run.json"
    atomic_write_text(path, spec.to_json())
    return path


def torchrun_commands(path: Path, spec: RunSpec, master_addr: str = "127.0.0.1",
                      master_port: int = 29500) -> list[str]:
    """One torchrun command per host of the plan's devices. torchrun numbers ranks host by host,
    and `run_spec` lists the ranks of RUN.json so, whatever hosts a stage's replicas are on."""
    hosts = list(dict.fromkeys(r.host for r in spec.ranks))
    if [r.host for r in spec.ranks] != sorted((r.host for r in spec.ranks), key=hosts.index):
        raise HetplanError(f"{path}: its ranks are not listed host by host, as torchrun numbers them; write it "
                           "again with hetplan run --dry-run")
    return [f"torchrun --nnodes {len(hosts)} --node-rank {i} --nproc-per-node "
            f"{sum(r.host == h for r in spec.ranks)} --master-addr {master_addr} --master-port {master_port} "
            f"-m hetplan.runtime.worker {path}" for i, h in enumerate(hosts)]


def _why(out_dir: Path, rank: int, spec: RunSpec, code: int | None = None) -> str:
    """The first line of what the worker said about its failure (its error file, else its log's
    last line); a worker that could write neither (a full disk) is said with its disk's space."""
    for name, line in ((f"error.{rank}", 0), (f"worker.{rank}.log", -1)):
        with contextlib.suppress(OSError):
            said = (out_dir / name).read_text(errors="replace").strip().splitlines()
            if said:
                return said[line] if line == 0 else f"{_who(spec, rank)} exited: {said[line]}"
    return (f"{_who(spec, rank)} exited{f' with status {code}' if code is not None else ''} and could not say why "
            f"in {out_dir}: {space_left(out_dir)}")


def _tracing_died(out_dir: Path, code: int) -> str:
    """The process that traces for the workers (`runtime.group`) ended before it started them."""
    said = ""
    with contextlib.suppress(OSError, IndexError):
        said = (out_dir / TRACING_LOG).read_text(errors="replace").strip().splitlines()[-1]
    killed = " (killed, as the kernel does when memory runs out)" if code == -9 else ""
    return (f"the process that builds the model and traces it for the workers ended with status {code}{killed} "
            f"before it started them{': ' + said if said else ', and could not say why: ' + space_left(out_dir)}; "
            "no worker ran")


def _who(spec: RunSpec, rank: int) -> str:
    me = spec.ranks[rank]
    return f"worker {rank} (stage {me.stage}, device {me.device})"


def pin_cores(threads: list[int]) -> list[list[int]]:
    """Cores for each local CPU worker: consecutive, its thread count each, when the workers'
    threads fit in the cores this process may use; otherwise none (the OS schedules them).

    Why: workers that stand for devices of different speed must not take each other's cores,
    or a 1-thread worker runs at the speed the scheduler gives it, not at one core's."""
    available = core_ids() if hasattr(os, "sched_setaffinity") else []  # no pinning where the OS has none
    if not available or sum(threads) > len(available):
        return [[] for _ in threads]
    out, at = [], 0
    for t in threads:
        out.append(available[at:at + t])
        at += t
    return out


def group_make(spec: RunSpec) -> str | None:
    """What the workers' group makes before it forks them (`forked.start_group`): the model and
    its traces (`runtime.group`), or nothing where a worker runs on a GPU (each then builds and
    traces its own): no GPU run has yet checked that the tracing process leaves CUDA fit for the
    workers it forks."""
    return None if any(me.on_cuda for me in spec.ranks) else "hetplan.runtime.group:traced_once"


def _start_workers(spec: RunSpec, spec_path: Path, rendezvous: Path) -> forked.Group:
    """The workers, forked from one process that built the model and traced the step for them
    all (`group_make`), meeting at the file `rendezvous` (`backend.init_method`)."""
    from hetplan.zoo import uses_transformers

    preload = (*forked.PRELOAD, forked.TRANSFORMERS) if uses_transformers(spec.model) else forked.PRELOAD
    world = spec.world
    # one set of cores per device: workers of stages that share a device share its cores
    devices = list(dict.fromkeys(me.device for me in spec.ranks))
    first = {d: next(me for me in spec.ranks if me.device == d) for d in devices}
    per_device = dict(zip(devices, pin_cores([first[d].threads if first[d].binding == "cpu" else 0
                                              for d in devices]), strict=True))
    members = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               RENDEZVOUS_ENV: str(rendezvous), LAUNCHER_PID: str(os.getpid()),
               "OMP_NUM_THREADS": str(spec.ranks[rank].threads)}
        cores = per_device[spec.ranks[rank].device]
        if cores:
            env["HETPLAN_CPUS"] = ",".join(map(str, cores))
        members.append(forked.Member(([str(spec_path)],), env, str(spec.settings.out_dir / f"worker.{rank}.log")))
    return forked.start_group(group_make(spec), (str(spec_path),), "hetplan.runtime.worker:main",
                              members, {**os.environ, LAUNCHER_PID: str(os.getpid()), "OMP_NUM_THREADS": "1"},
                              spec.settings.out_dir / TRACING_LOG, preload)


def _died(code: int | None) -> bool:
    """Whether a worker's exit status says it died (a signal, or ended without a word: its device
    or process is lost) rather than failed with an error it wrote (1, 2) or for a lost peer."""
    return code is not None and (code < 0 or code == 3)


def furthest_step(out_dir: Path, world: int) -> int:
    """The furthest step a worker has begun, by the heartbeats now (0 before any)."""
    return max([int((b or {}).get("step", 0)) for b in _heartbeats(out_dir, world)] + [0])


def _heartbeats(out_dir: Path, world: int) -> list[dict | None]:
    beats = []
    for rank in range(world):
        try:
            beats.append(json.loads((out_dir / f"heartbeat.{rank}").read_text()))
        except (OSError, ValueError):
            beats.append(None)
    return beats


def _wait(workers: forked.Group, spec: RunSpec, progress) -> None:
    """Until every worker has ended well; a failed or silent worker stops them all."""
    out_dir, world, timeout = spec.settings.out_dir, spec.world, float(spec.settings.timeout_s)
    last_move, last_seen, first_failure = time.time(), None, None
    while True:
        codes = workers.exitcodes()
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        causes = [r for r in failed if codes[r] != LOST_PEER]
        first_failure = first_failure or (time.time() if failed else None)
        # a worker that lost its peer is not the failure to name: the peer's crash reaches the
        # launcher through the worker server a moment later
        if causes or (failed and time.time() - first_failure > CAUSE_GRACE_S):
            said = (causes or failed)[0]
            if said in workers.never_forked():
                raise WorkerFailure(_tracing_died(out_dir, codes[said]))
            raise WorkerFailure(_why(out_dir, said, spec, codes[said]) + "; every worker was stopped",
                                tuple(dict.fromkeys(spec.ranks[r].device for r in causes if _died(codes[r]))),
                                furthest_step(out_dir, world))
        if all(c == 0 for c in codes):
            return
        beats = _heartbeats(out_dir, world)
        seen = tuple(((b or {}).get("step", -2), (b or {}).get("phase", ""), (b or {}).get("done", 0))
                     for b in beats)
        if seen != last_seen:
            last_seen, last_move = seen, time.time()
            if progress is not None:
                progress(min((b or {}).get("step", -1) for b in beats) + 1, spec.settings.steps)
        elif time.time() - last_move > timeout:
            # a hung worker and the ones waiting for it look alike from outside: name all that
            # have not finished (or gave up waiting for a peer), with where each is
            stuck = [f"worker {r} (stage {spec.ranks[r].stage}, device {spec.ranks[r].device}) "
                     f"at step {(beats[r] or {}).get('step', 'start')}"
                     + (f", {describe((beats[r] or {}).get('at', ''))}" if (beats[r] or {}).get("at") else "")
                     for r in range(world) if codes[r] in (None, LOST_PEER)]
            raise WorkerFailure(f"no worker made progress for {timeout:.0f} s: {'; '.join(stuck)}; "
                                "every worker was stopped")
        time.sleep(0.2)


def launch(spec: RunSpec, progress=None) -> RunResult:
    """Start the workers of a RUN.json spec, wait for them, and read the result. The run folder
    is locked while they run; however the wait ends, no worker outlives it."""
    out_dir = spec.settings.out_dir
    for me in spec.ranks:  # every worker runs here: its GPU must be here
        if me.on_cuda:
            _check_cuda(me.device, me.binding)
    folders = {out_dir: "--out"}  # each locked, like a run's folder, and cleared if the run fails
    if spec.settings.checkpoint_dir is not None:
        folders.setdefault(spec.settings.checkpoint_dir, "--checkpoint-dir")
    made = {folder: not folder.exists() for folder in folders}
    mine: list[Path] = []  # the folders this run holds: only those are its to clear
    try:
        with contextlib.ExitStack() as held:
            for folder, flag in folders.items():
                held.enter_context(run_folder_lock(folder, flag))
                mine.append(folder)
            held.enter_context(stop_on_terminate())
            return _launch_locked(spec, progress)
    except BaseException:
        if spec.settings.checkpoint_dir in mine:
            from hetplan.runtime.checkpoint import clear_partial

            clear_partial(spec.settings.checkpoint_dir)
        for folder in mine:  # after the locks are let go, so that a folder this run made may go
            clear_failed_run(folder, made[folder])
        raise


def _launch_locked(spec: RunSpec, progress) -> RunResult:
    out_dir = spec.settings.out_dir
    spec_path = write_spec(spec)
    # an earlier run's say is not this one's
    for old in [*out_dir.glob("heartbeat.*"), *out_dir.glob("error.*"), *out_dir.glob("result.json"),
                *out_dir.glob("worker.*.log"), *out_dir.glob(TRACING_LOG), *out_dir.glob(STOP_FILE)]:
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="hetplan-rendezvous-") as meet:
        workers = _start_workers(spec, spec_path, Path(meet) / "rendezvous")
        try:
            _wait(workers, spec, progress)
        finally:
            workers.stop()  # nothing to stop after a clean end; everything after a failure or a signal
    with contextlib.suppress(OSError):  # it says something only where tracing once failed
        if (out_dir / TRACING_LOG).stat().st_size == 0:
            (out_dir / TRACING_LOG).unlink()
    return read_result(out_dir, spec)


def read_result(out_dir: Path, spec: RunSpec) -> RunResult:
    """The run folder's result.json (rank 0 gathers every rank's into it) as a `RunResult`."""
    data = json.loads((out_dir / "result.json").read_text())
    ranks = sorted(data["ranks"], key=lambda r: r["rank"])
    steps = len(ranks[0]["times_s"])
    times = tuple(max(r["times_s"][i] for r in ranks) for i in range(steps))
    # the last stage's replicas each hold their rows' share of the batch's mean loss; a worker
    # is known by its first stage, and under a V-shaped map the first worker holds the last stage
    holder = spec.plan.stage_ranks
    # the last stage's replicas' shares (a tensor-parallel group's ranks each have its replica's)
    with_loss = [r["losses"] for r in ranks if holder[r["stage"]] == holder[-1] and not r.get("tp")]
    losses = tuple(math.fsum(values) for values in zip(*with_loss, strict=True)) if with_loss else ()
    warmup = min(spec.settings.warmup, max(0, steps - 1))
    return RunResult(steps=steps, warmup=warmup, step_times_s=times, losses=losses,
                     peak_mem_bytes={r["device"]: int(r["peak_mem_bytes"]) for r in ranks}, out_dir=str(out_dir),
                     ranks=tuple(ranks))
