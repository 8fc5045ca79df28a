"""Each node's forward and backward measured on a tensor-parallel group of t CPU workers (Megatron-LM's
split, Shoeybi et al. 2019, as `hetplan.pieces.tensor_stage` runs it), for `Node.tp_s`.

t processes on this host join a gloo group, forked from one process that cut the step into its
pieces for them all (`forked.start_group`); each makes every piece tensor-parallel as a stage's
worker does (its shards, DTensor's dispatch, Megatron's two all-reduces per block and pass, the
vocabulary-parallel loss) and times the pieces in sequence
(`hetplan.profile.timing.time_in_sequence`, at the batch and at the small batch for the fixed
parts). The first worker's times are the group's: the collectives keep the workers in step.
What the cost model projects for a group (`hetplan.cost.tensor`: the compute split t ways,
DTensor's overhead per operator, the all-reduces off the measured curve) is then checked by, and
replaced with, what the group took.

Only CPU workers: a group of GPUs needs t of them on one host, which this profiler does not
look for yet.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hetplan import forked
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.pieces.split import SplitStep, split_step
from hetplan.profile.devices import ProfileDevice, cores_short_of
from hetplan.profile.timing import Timing, fixed_parts, small_part, time_in_sequence
from hetplan.tp import splits_in


def with_group_times(graph: Graph, step: torch.nn.Module, batch: Mapping[str, Any], devices: Sequence[ProfileDevice],
                     degrees: Sequence[int], granularity: str, block_classes: Sequence[str] | None, repeats: int,
                     precision: str, fixed: bool) -> Graph:
    """`graph` with each node's times on groups of each of `degrees` workers of each CPU device
    type profiled (`Node.tp_s`; fixed parts with `fixed`)."""
    cpus = [d for d in devices if not d.is_cuda]
    if not cpus:
        raise HetplanError("--tp-degrees times groups of CPU workers; add --device cpu:N (GPU groups are not "
                           "timed yet)")
    nodes = [n.id for n in graph.nodes if not n.is_input]
    tp: dict[str, dict[str, dict[int, tuple]]] = {n: {} for n in nodes}
    for device in cpus:
        threads = device.threads or torch.get_num_threads()
        for degree in degrees:
            _check_group(graph, nodes, degree, threads, device.spec)
            small = small_part(batch, device.torch_device, graph.batch_size) if fixed else None
            full, part = group_times(step, batch, small, degree, threads, granularity, block_classes, repeats,
                                     precision)
            parts = fixed_parts(full, part, graph.batch_size, small[0]) if small and part else {}
            for n in nodes:
                f, b = parts.get(n, (0.0, 0.0))
                tp[n].setdefault(device.device_type, {})[degree] = (full[n].fwd_s, full[n].bwd_s, f, b)
    return replace(graph, nodes=tuple(replace(n, tp_s=tp[n.id]) if n.id in tp else n for n in graph.nodes))


def _check_group(graph: Graph, nodes: Sequence[str], degree: int, threads: int, spec: str) -> None:
    problem = splits_in(graph, nodes, degree) if degree >= 2 else "a group has 2 devices or more"
    if problem:
        raise HetplanError(f"--tp-degrees {degree}: {problem}")
    short = cores_short_of(degree * threads)
    if short is not None:
        raise HetplanError(f"--tp-degrees {degree} on {spec}: a group of {degree} workers of {threads} threads needs "
                           f"{degree * threads} cores and this process may use {short}; use fewer threads or a "
                           "smaller degree")


def group_times(step: torch.nn.Module, batch: Mapping[str, Any], small: tuple[int, Mapping[str, Any]] | None,
                degree: int, threads: int, granularity: str, block_classes: Sequence[str] | None, repeats: int,
                precision: str) -> tuple[dict[str, Timing], dict[str, Timing] | None]:
    """Per piece, its times on a group of `degree` CPU workers of `threads` threads each, at the
    batch and (with `small`: its size and batch) at the small batch."""
    try:
        pickle.dumps(step)
    except Exception as exc:  # the user's model: say what to do
        raise HetplanError(f"--tp-degrees needs a model the worker processes can be given (pickled), and pickling "
                           f"it failed: {type(exc).__name__}: {exc}; profile without --tp-degrees") from None
    with tempfile.TemporaryDirectory(prefix="hetplan-tp-") as tmp:
        out = os.path.join(tmp, "times.pt")
        job = _Job(step, dict(batch), small, degree, threads, granularity, tuple(block_classes or ()), repeats,
                   precision, os.path.join(tmp, "store"), out)
        logs = [Path(tmp) / f"worker.{r}.log" for r in range(degree)]
        # the workers forked from one process that traced the step for them all
        here = "hetplan.profile.tensor_times"
        group = forked.start_group(f"{here}:_traced", (job,), f"{here}:_worker",
                                   [forked.Member((r, job), dict(os.environ), str(logs[r])) for r in range(degree)],
                                   dict(os.environ), Path(tmp) / "tracing.log", (*forked.PRELOAD, forked.TRANSFORMERS))
        try:
            codes = group.exitcodes()
            while None in codes and not any(codes):  # one that fails leaves the others waiting on it
                time.sleep(0.05)
                codes = group.exitcodes()
        finally:
            group.stop()
        if any(codes):
            raise HetplanError(_failure(degree, codes, logs, Path(tmp) / "tracing.log"))
        full, small_times = torch.load(out)
    return ({n: Timing(*t) for n, t in full.items()},
            None if small_times is None else {n: Timing(*t) for n, t in small_times.items()})


def _failure(degree: int, codes: Sequence[int | None], logs: Sequence[Path], tracing: Path) -> str:
    """What a failed group says: the error of the first worker that failed by itself (a status
    above 0), else of any that said one, else why none started."""
    order = [r for r, c in enumerate(codes) if c and c > 0] + [r for r, c in enumerate(codes) if not c or c < 0]
    for r in order:
        said = logs[r].read_text(errors="replace").strip().splitlines() if logs[r].exists() else []
        if said:
            return f"timing a group of {degree} workers failed in a worker: {said[-1]}"
    said = tracing.read_text(errors="replace").strip() if tracing.exists() else ""
    if not said and not any(log.exists() for log in logs):  # it failed before running any of hetplan's code
        return (f"the group of {degree} workers did not start; a script that profiles with tp_degrees must call it "
                "under `if __name__ == '__main__':` (the workers import it again)")
    return f"the group of {degree} workers did not start: {said.splitlines()[-1] if said else 'nothing said why'}"


@dataclass(frozen=True)
class _Job:
    """What each worker of the group is given (pickled to the forked workers)."""

    step: torch.nn.Module
    batch: dict[str, Any]
    small: tuple[int, Mapping[str, Any]] | None
    degree: int
    threads: int
    granularity: str
    block_classes: tuple[str, ...]
    repeats: int
    precision: str
    store: str
    out: str


def _traced(job: _Job) -> tuple[tuple[torch.nn.Module, SplitStep], tuple[torch.nn.Module, SplitStep] | None]:
    """The step cut into pieces at the batch, and on a copy of the whole model at the small batch
    (parallelizing one puts shards in it): made once, in the process the workers are forked
    from, on one thread (no OpenMP team, which a forked child could not use)."""
    import copy

    torch.set_num_threads(1)
    small = None
    if job.small is not None:
        twin = copy.deepcopy(job.step).train()
        small = (twin, split_step(twin, job.small[1], job.granularity, job.block_classes or None))
    step = job.step.train()
    return (step, split_step(step, job.batch, job.granularity, job.block_classes or None)), small


def _worker(rank: int, job: _Job, made: tuple | None) -> None:
    """Worker `rank` of the group: `made` as `_traced` makes it, or None where that failed (it
    traces its own)."""
    import torch.distributed as dist

    made = _traced(job) if made is None else made
    torch.set_num_threads(job.threads)
    dist.init_process_group("gloo", init_method=f"file://{job.store}", rank=rank, world_size=job.degree)
    try:
        times = _timed(job, rank, *made)
        if rank == 0:
            torch.save(times, job.out)
    finally:
        dist.destroy_process_group()


def _timed(job: _Job, rank: int, full: tuple[torch.nn.Module, SplitStep],
           small: tuple[torch.nn.Module, SplitStep] | None) -> tuple[dict[str, tuple], dict[str, tuple] | None]:
    from hetplan.pieces.tensor_stage import running

    also = []
    if small is not None:
        small_split, _ = _parallel(*small, job, rank)
        also.append((small_split, job.small[1]))
    split, vocab = _parallel(*full, job, rank)
    with running("cpu", vocab):
        timed = time_in_sequence(split, job.batch, "cpu", job.repeats, also=also, precision=job.precision)

    def plain(times):  # what torch.load reads back without unpickling classes
        return {n: (t.fwd_s, t.bwd_s, t.fwd_min_s, t.bwd_min_s) for n, t in times.items()}

    return plain(timed.times), (plain(timed.also[0]) if also else None)


def _parallel(step: torch.nn.Module, split: SplitStep, job: _Job, rank: int) -> tuple[SplitStep, bool]:
    """The step's pieces (`split`, cut from `step`), each made worker `rank`'s part of a
    tensor-parallel piece; and whether the loss is vocabulary-parallel."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hetplan.pieces.tensor_stage import parallelize

    stages, _ = parallelize([p.module for p in split.pieces], step, job.degree, rank)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for stage in stages:
        stage.attach(mesh)
    pieces = tuple(replace(p, module=s) for p, s in zip(split.pieces, stages, strict=True))
    return replace(split, pieces=pieces), any(s.vocab_parallel for s in stages)
