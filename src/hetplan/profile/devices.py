"""Devices to profile on: `cpu` (the current thread count), `cpu:N` (N threads), `cuda`, `cuda:K`.

A CPU worker's device type is `cpu-Nt`; a GPU's is the catalog type that matches its name and
memory (`h100-80gb`, `a100-40gb`, ...), or `gpu-<name>` for a GPU the catalog does not know.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hetplan.catalog import by_driver_name
from hetplan.errors import HetplanError
from hetplan.machine import usable_cores

_SPEC = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class ProfileDevice:
    spec: str
    torch_device: str
    device_type: str
    threads: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.startswith("cuda")


def cuda_type_name(name: str, mem_bytes: int) -> str:
    """The catalog type of a GPU from the name the driver reports and its memory
    (`catalog.by_driver_name`), else `gpu-<name>`."""
    known = by_driver_name(name, mem_bytes)
    return known.name if known else "gpu-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cores_short_of(threads: int) -> int | None:
    """The cores this process may use when they are fewer than `threads` (threads sharing cores
    would time a slower type than its name says, and a worker of them run slower), else None."""
    cores = usable_cores()
    return cores if threads > cores else None


def parse_device(spec: str) -> ProfileDevice:
    match = _SPEC.match(spec.strip())
    if not match:
        raise HetplanError(f"--device {spec!r}: write cpu, cpu:N (N threads), cuda or cuda:K")
    kind, num = match[1], match[2]
    if kind == "cpu":
        threads = int(num) if num else torch.get_num_threads()
        if threads < 1:
            raise HetplanError(f"--device {spec!r}: a CPU needs at least 1 thread")
        if cores_short_of(threads):
            raise HetplanError(f"--device {spec}: {threads} threads, but this process may use {usable_cores()} "
                               f"cores; profile with at most cpu:{usable_cores()}, or on a machine with more cores")
        return ProfileDevice(spec, "cpu", f"cpu-{threads}t", threads)
    if not torch.cuda.is_available():
        raise HetplanError(
            f"--device {spec}: no CUDA device is available here (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False); profile with --device cpu:N, or on a machine with a GPU"
        )
    index = int(num) if num else 0
    if index >= torch.cuda.device_count():
        raise HetplanError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    props = torch.cuda.get_device_properties(index)
    return ProfileDevice(spec, f"cuda:{index}", cuda_type_name(props.name, props.total_memory))
