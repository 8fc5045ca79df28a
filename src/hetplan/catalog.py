"""Catalog of device types: peak FLOP/s, memory, memory bandwidth and a typical price.

Figures are the vendors' datasheet numbers for dense math (no structured sparsity): fp32 on the
CUDA cores and fp16/bf16 on the tensor cores. Memory is the nominal capacity (the driver and
CUDA context take a few hundred MiB of it). Prices are typical on-demand cloud prices per GPU
in US dollars per hour (2025-2026 list prices, rounded); they differ by provider and region, so
a cluster file can override them per type or per device.

A CPU is a family rather than one type: `cpu` with `threads: N` resolves to the type `cpu-Nt`,
because a CPU worker with 1 thread and one with 4 threads run at different speeds and are
profiled separately (`hetplan profile --device cpu:1 --device cpu:4`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType

from hetplan._frozen import FILE_SCHEMA
from hetplan.errors import ClusterError
from hetplan.precision import BF16, FP32, checked


@dataclass(frozen=True)
class DeviceType:
    """A kind of device. `peak_flops` is fp32; `peak_flops_fp16` the fp16 tensor rate, which bf16
    reaches too where the device has bf16 tensor cores (`bf16_tensor`: from Ampere on; a V100 or
    a T4 runs bf16 products at about its fp32 rate). `threads` is set for CPU types only.
    `driver_names`: the model numbers, in lower case, by which the CUDA driver's name of a GPU
    (`torch.cuda.get_device_properties(i).name`) says it is of this type (`by_driver_name`)."""

    __pydantic_config__ = FILE_SCHEMA

    name: str
    kind: str
    peak_flops: float
    peak_flops_fp16: float
    mem_bytes: int
    mem_bw_Bps: float
    usd_per_hour: float
    threads: int | None = None
    description: str = ""
    bf16_tensor: bool = True
    driver_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        who = f"device type {self.name!r}"
        if not self.name:
            raise ClusterError("a device type needs a non-empty name")
        if self.kind not in ("gpu", "cpu"):
            raise ClusterError(f"{who}: kind is {self.kind!r}; allowed: gpu, cpu")
        for field in ("peak_flops", "peak_flops_fp16", "mem_bytes", "mem_bw_Bps"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ClusterError(f"{who}: {field} is {value!r}; it must be finite and > 0")
        if self.mem_bytes > MAX_MEM_BYTES:
            raise ClusterError(f"{who}: {memory_problem(self.mem_bytes)}")
        if not math.isfinite(self.usd_per_hour) or self.usd_per_hour < 0:
            raise ClusterError(f"{who}: usd_per_hour is {self.usd_per_hour!r}; it must be >= 0")
        if self.threads is not None and (self.kind != "cpu" or self.threads < 1):
            raise ClusterError(f"{who}: threads is only for cpu types and must be >= 1")
        object.__setattr__(self, "driver_names", tuple(self.driver_names))
        if any(not isinstance(n, str) or not n or n != n.lower() for n in self.driver_names):
            raise ClusterError(f"{who}: driver_names must be non-empty lower-case names, got {self.driver_names!r}")

    def peak_flops_in(self, precision: str) -> float:
        """The peak FLOP rate of products in `precision` (`hetplan.precision`)."""
        if checked(precision) == FP32 or (precision == BF16 and not self.bf16_tensor):
            return self.peak_flops
        return self.peak_flops_fp16

GiB = 2**30

# No one device holds a pebibyte (the largest hosts have tens of TiB): more is a typo in a unit, and
# would pass every memory check of the planners, so every plan would look like it fits.
MAX_MEM_BYTES = 2**50


def memory_problem(mem_bytes: float) -> str:
    return (f"memory is {mem_bytes:.3g} bytes, more than the {MAX_MEM_BYTES >> 50} PiB any one device has; check "
            "the number and its unit (GiB, TiB)")

CATALOG: MappingProxyType[str, DeviceType] = MappingProxyType(
    {
        t.name: t
        for t in (
            DeviceType("h200-141gb", "gpu", 67e12, 989e12, 141 * GiB, 4.8e12, 3.50,
                       description="NVIDIA H200 SXM 141GB", driver_names=("h200",)),
            DeviceType("h100-80gb", "gpu", 67e12, 989e12, 80 * GiB, 3.35e12, 3.00,
                       description="NVIDIA H100 SXM5 80GB", driver_names=("h100",)),
            DeviceType("a100-80gb", "gpu", 19.5e12, 312e12, 80 * GiB, 2.039e12, 2.00,
                       description="NVIDIA A100 SXM4 80GB", driver_names=("a100",)),
            DeviceType("a100-40gb", "gpu", 19.5e12, 312e12, 40 * GiB, 1.555e12, 1.50,
                       description="NVIDIA A100 SXM4 40GB", driver_names=("a100",)),
            DeviceType("v100-32gb", "gpu", 15.7e12, 125e12, 32 * GiB, 900e9, 1.10,
                       description="NVIDIA V100 SXM2 32GB", bf16_tensor=False, driver_names=("v100",)),
            DeviceType("v100-16gb", "gpu", 15.7e12, 125e12, 16 * GiB, 900e9, 0.90,
                       description="NVIDIA V100 SXM2 16GB", bf16_tensor=False, driver_names=("v100",)),
            DeviceType("t4-16gb", "gpu", 8.1e12, 65e12, 16 * GiB, 320e9, 0.35,
                       description="NVIDIA T4 16GB", bf16_tensor=False, driver_names=("t4",)),
            DeviceType("rtx3090-24gb", "gpu", 35.6e12, 71e12, 24 * GiB, 936e9, 0.30,
                       description="NVIDIA GeForce RTX 3090 24GB (fp16 tensor with fp32 accumulate)",
                       driver_names=("rtx 3090",)),
            DeviceType("l4-24gb", "gpu", 30.3e12, 121e12, 24 * GiB, 300e9, 0.70,
                       description="NVIDIA L4 24GB", driver_names=("l4",)),
        )
    }
)

# One x86 core with AVX2 and two FMA units at about 2 GHz: 2 units x 8 fp32 lanes x 2 FLOP x 2e9.
CPU_FLOPS_PER_THREAD = 64e9
CPU_MEM_BW_PER_THREAD_BPS = 10e9
CPU_MEM_BW_MAX_BPS = 200e9
CPU_DEFAULT_MEM_BYTES = 16 * GiB
CPU_USD_PER_THREAD_HOUR = 0.04  # about one cloud vCPU
_CPU_NAME = re.compile(r"^cpu-(\d+)t$")


def cpu_type(threads: int) -> DeviceType:
    """The device type of a CPU worker with `threads` threads (`cpu-4t` for 4)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ClusterError(f"a cpu needs a whole number of threads >= 1, got {threads!r}")
    return DeviceType(
        name=f"cpu-{threads}t",
        kind="cpu",
        peak_flops=threads * CPU_FLOPS_PER_THREAD,
        peak_flops_fp16=threads * CPU_FLOPS_PER_THREAD,
        mem_bytes=CPU_DEFAULT_MEM_BYTES,
        mem_bw_Bps=min(threads * CPU_MEM_BW_PER_THREAD_BPS, CPU_MEM_BW_MAX_BPS),
        usd_per_hour=round(threads * CPU_USD_PER_THREAD_HOUR, 6),
        threads=threads,
        description=f"CPU worker with {threads} thread{'s' if threads > 1 else ''}",
    )


def catalog_names() -> tuple[str, ...]:
    return (*CATALOG, "cpu")


def lookup(name: str, threads: int | None = None) -> DeviceType:
    """A catalog type by name; `cpu` takes a thread count, and `cpu-Nt` names one directly."""
    if name == "cpu":
        return cpu_type(1 if threads is None else threads)
    match = _CPU_NAME.match(name)
    if match:
        return cpu_type(int(match[1]))
    if name in CATALOG:
        return CATALOG[name]
    raise ClusterError(f"unknown device type {name!r} (known: {', '.join(catalog_names())})")


def by_driver_name(name: str, mem_bytes: int) -> DeviceType | None:
    """The catalog type of a GPU the CUDA driver calls `name`, with `mem_bytes` of memory: a type
    one of whose `driver_names` the name holds with no digit on either side (the `l4` is not the
    `l40s`, the `v100` is the `v100s`); of several, the one of nearest memory, as the driver
    reports a little less than the nominal (an A100 of 40 or 80 GB); None for a GPU it lacks."""
    low = name.lower()
    found = [t for t in CATALOG.values()
             if any(re.search(rf"(?<!\d){re.escape(k)}(?!\d)", low) for k in t.driver_names)]
    return min(found, key=lambda t: abs(t.mem_bytes - mem_bytes), default=None)


def find(name: str) -> DeviceType | None:
    """Like `lookup` but None for an unknown name."""
    try:
        return lookup(name)
    except ClusterError:
        return None
