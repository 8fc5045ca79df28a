"""Which torch.distributed backend a run's workers talk over, from the `backend` run setting
(`RunSettings.backend`) and where the workers run: gloo alone, or torch's per-device-type
backend "cpu:gloo,cuda:nccl" (NCCL for tensors on GPUs, gloo for host tensors) where workers sit
on GPUs, torch has NCCL and no two workers share a GPU (NCCL runs one worker per GPU). How
messages then travel is `runtime.transport`'s (`Transport.wire`). And where a run's ranks meet
to make their process group (`init_method`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from hetplan.errors import HetplanError
from hetplan.runtime.settings import BACKENDS
from hetplan.runtime.support import shared_gpu

MIXED = "cpu:gloo,cuda:nccl"

# A file the processes of one local launch meet at (torch's FileStore), set by the launcher:
# where a port is picked first and bound later, by rank 0's store once the step is traced, another
# program can take it in between.
RENDEZVOUS_ENV = "HETPLAN_RENDEZVOUS"


def init_method() -> str | None:
    """Where the ranks of a process group meet: the local launcher's file ($HETPLAN_RENDEZVOUS),
    else torchrun's MASTER_ADDR and MASTER_PORT (torch's env://)."""
    path = os.environ.get(RENDEZVOUS_ENV)
    return f"file://{path}" if path else None


def backend_of(setting: str, bindings: Sequence[str], nccl: Callable[[], bool] | None = None) -> str:
    """The torch.distributed backend of a run whose workers are bound to `bindings` ("cpu",
    "cuda:0", ...), for the `backend` run setting: gloo, or `MIXED` where NCCL can carry what
    passes between GPU workers (a CUDA build of torch, each GPU worker on a GPU of its own; auto
    takes gloo otherwise). `nccl` says whether torch has NCCL here (`nccl_available`, asked
    only where a worker is on a GPU). Refuses, in `hetplan run`'s words, a setting that cannot hold."""
    gpus = [b.startswith("cuda") for b in bindings]
    if setting not in BACKENDS:
        raise HetplanError(f"--backend {setting!r} is unknown: use one of {', '.join(BACKENDS)}")
    if setting == "gloo" or (setting == "auto" and not any(gpus)):
        return "gloo"
    if setting == "nccl" and not all(gpus):
        cpu = gpus.index(False)
        raise HetplanError(f"--backend nccl: worker {cpu} runs on the CPU ({bindings[cpu]}), and NCCL carries GPU "
                           "tensors only: use --backend auto (NCCL between GPUs, gloo where a CPU takes part)")
    shared = shared_gpu(bindings)
    if setting == "auto":
        return MIXED if shared is None and (nccl or nccl_available)() else "gloo"
    if shared is not None:
        i, j = shared
        raise HetplanError(f"--backend nccl: workers {i} and {j} are both on {bindings[i]}, and NCCL runs one worker "
                           "per GPU: bind them to different GPUs, or use --backend auto (gloo, through the host)")
    if not (nccl or nccl_available)():
        raise HetplanError("--backend nccl: this torch has no NCCL (a CPU build): use --backend auto or gloo")
    return MIXED


def nccl_available() -> bool:
    """Whether this torch can use NCCL (a CUDA build with it, and a GPU to run it on)."""
    import torch
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()
