"""Probes that measure, on the machine the workers run on, what the simulator charges besides
the model's operators (`hetplan calibrate`, `hetplan.runtime.calibrate`):

- point-to-point: gloo send and receive between two local worker processes (a ping-pong, half
  the round trip per message), at two sizes: the link's bandwidth and latency;
- all-reduce: gloo all-reduces among 2, 3, ... local processes (as many as the cluster has
  workers on the host), at four sizes: the measured curve by group size;
- optimizer: torch's Adam step over weights of three sizes, on each worker's thread count or GPU;
- co-running: the same compute-heavy step run alone and then by 2, 3, ... CPU workers side by
  side, each on its own cores as the launcher pins them: the slowdown of each worker's compute.

Each probe runs in processes of its own, forked as the workers are (`spawn_probe`,
`hetplan.forked`), so that what one
measures does not depend on the calibrating process's threads or caches. Probe functions take
`(rank, world, params)` and return what they measured; rank 0's result comes back.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hetplan import forked
from hetplan.errors import HetplanError
from hetplan.pieces.hostmem import keep_freed_memory
from hetplan.runtime.backend import RENDEZVOUS_ENV, init_method

MiB = 1 << 20
P2P_BYTES = (1 * MiB, 16 * MiB)
# 4 KiB: the latency floor (0.47 ms among two local gloo processes here, what the row counts and
# indices of sparse tables cost); without it the curve went down to nothing below 1 MiB
# a tensor-parallel group's all-reduces are of a micro-batch's activations: tens to hundreds of kB
ALLREDUCE_BYTES = (4 * 1024, 64 * 1024, 256 * 1024, 1 * MiB, 8 * MiB, 32 * MiB)
OPTIMIZER_PARAMS = (1 * MiB, 4 * MiB, 16 * MiB)  # parameters (fp32), in the range of stages' sizes
PROBE_TIMEOUT_S = 300.0


def spawn_probe(function: str, world: int, params: dict, threads: Sequence[int] = (), cores: Sequence = (),
                timeout_s: float = PROBE_TIMEOUT_S) -> list:
    """Run `hetplan.runtime.probes.<function>(rank, world, params)` in `world` local processes
    (forked as the workers are) joined by gloo; every rank's result, in rank order. `threads[r]`
    and `cores[r]`: rank r's thread count and the cores it is pinned to (none: 1 thread, unpinned)."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            t = threads[rank] if rank < len(threads) else 1
            env = {**os.environ, RENDEZVOUS_ENV: str(Path(tmp) / "rendezvous"), "OMP_NUM_THREADS": str(t),
                   "HETPLAN_PROBE_THREADS": str(t),
                   "HETPLAN_CPUS": ",".join(map(str, cores[rank])) if rank < len(cores) and cores[rank] else ""}
            out = str(Path(tmp) / f"{rank}.json")
            procs.append(forked.start("hetplan.runtime.probes:probe_main", (function, rank, world, params, out), env,
                                      Path(tmp) / f"{rank}.log"))
        errors = _wait_all(procs, [Path(tmp) / f"{rank}.log" for rank in range(world)], timeout_s)
        if errors:
            raise HetplanError(f"the calibration probe {function} on {world} local process"
                               f"{'es' if world > 1 else ''} failed: {errors[0]}")
        return [json.loads((Path(tmp) / f"{rank}.json").read_text()) for rank in range(world)]


def probe_main(function: str, rank: int, world: int, params: dict, out: str) -> int:
    Path(out).write_text(json.dumps(_entry(function, rank, world, params)))
    return 0


def _wait_all(procs: list, logs: list[Path], timeout_s: float) -> list[str]:
    """Wait for every process; the last line of each failure's output."""
    errors = []
    deadline = time.monotonic() + timeout_s
    for p, log in zip(procs, logs, strict=True):
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.exitcode is None:
            forked.stop(procs, grace_s=0.0)
            return [f"timed out after {timeout_s:.0f} s"]
        if p.exitcode:
            lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
            errors.append(lines[-1] if lines else f"exit status {p.exitcode}")
    return errors


def _entry(function: str, rank: int, world: int, params: dict):
    """In a probe process: pin, set threads, join gloo when there are peers, run the probe."""
    import torch
    import torch.distributed as dist

    if os.environ.get("HETPLAN_CPUS") and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [int(c) for c in os.environ["HETPLAN_CPUS"].split(",")])
    torch.set_num_threads(int(os.environ.get("HETPLAN_PROBE_THREADS", "1")))
    keep_freed_memory()  # as the workers run (hostmem)
    devices = params.get("devices")  # one per rank: a probe of NCCL between GPUs (`calibrate`)
    if devices:
        torch.cuda.set_device(torch.device(devices[rank]))
    if world > 1:
        dist.init_process_group(params.get("backend", "gloo"), init_method=init_method(), rank=rank, world_size=world)
    try:
        return globals()[function](rank, world, params)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _median_s(run, repeats: int, barrier=None) -> float:
    """Median seconds of `run()` over `repeats`, after two untimed runs."""
    times = []
    for i in range(repeats + 2):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        run()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _drain(params: dict):
    """What ends a timed collective on the probe's device: the GPU's queue drained (NCCL returns
    before its kernels end), nothing on the host."""
    import torch

    devices = params.get("devices")
    return (lambda: torch.cuda.synchronize()) if devices else (lambda: None)


def p2p(rank: int, world: int, params: dict) -> dict:
    """Ping-pong between ranks 0 and 1: seconds per one-way message of each size (host tensors
    over gloo, or with `devices`, GPU tensors over the probe's backend)."""
    import torch
    import torch.distributed as dist

    out, drained = {}, _drain(params)
    where = params.get("devices", ["cpu"] * world)[rank]
    for size in params["sizes"]:
        buf = torch.ones(size // 4, device=where)

        def once(buf=buf):
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            drained()

        out[str(size)] = _median_s(once, params["repeats"], dist.barrier) / 2
    return out


def copies(rank: int, world: int, params: dict) -> dict:
    """One-way seconds of each size copied from the host to `params["device"]` and back, as the
    runtime copies a message that a GPU worker sends to or gets from the host (a pageable host
    tensor; the GPU's queue drained): {"h2d": {bytes: s}, "d2h": {bytes: s}}. On a CPU device it
    times a host copy (what the tests can run)."""
    import torch

    device = torch.device(params["device"])

    def drained() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out: dict[str, dict[str, float]] = {"h2d": {}, "d2h": {}}
    for size in params["sizes"]:
        host = torch.ones(size // 4)
        there = host.to(device, copy=True)
        out["h2d"][str(size)] = _median_s(lambda host=host: (host.to(device, copy=True), drained()), params["repeats"])
        out["d2h"][str(size)] = _median_s(lambda there=there: (there.to("cpu", copy=True), drained()),
                                          params["repeats"])
    return out


def allreduce(rank: int, world: int, params: dict) -> dict:
    """Seconds of an all-reduce of each size among all ranks (the slowest rank's view is rank
    0's: an all-reduce ends for everyone at once): host tensors over gloo, or with `devices`, GPU
    tensors over the probe's backend."""
    import torch
    import torch.distributed as dist

    out, drained = {}, _drain(params)
    where = params.get("devices", ["cpu"] * world)[rank]
    for size in params["sizes"]:
        buf = torch.ones(size // 4, device=where)
        out[str(size)] = _median_s(lambda buf=buf: (dist.all_reduce(buf), drained()), params["repeats"], dist.barrier)
    return out


def optimizer(rank: int, world: int, params: dict) -> dict:
    """Seconds of one `torch.optim.Adam` step (torch's default implementation) over 8 fp32
    tensors holding each number of parameters, on params["device"]."""
    import torch

    device = torch.device(params["device"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for n in params["sizes"]:
        weights = [torch.nn.Parameter(torch.randn(n // 8, device=device)) for _ in range(8)]
        for w in weights:
            w.grad = torch.randn_like(w)
        opt = torch.optim.Adam(weights, lr=1e-3)

        def step(opt=opt):
            opt.step()
            sync()

        out[str(n * 4)] = _median_s(step, params["repeats"])
    return out


def busy_step(rank: int, world: int, params: dict) -> float:
    """Median seconds of a compute-heavy training step (a 4-layer perceptron of width 1024,
    forward, backward and zeroing, batch 128) run on every rank at once (a barrier before each)."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(4)]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.GELU())])
    x = torch.randn(128, 1024)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    return _median_s(step, params["repeats"], dist.barrier if world > 1 else None)
