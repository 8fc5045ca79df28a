"""How a process that trains on the CPU gets its memory back from the C library.

torch's CPU tensors come from `malloc`. glibc's malloc serves an allocation above its mmap
threshold (128 KiB at start, raised on the fly as mapped blocks are freed, up to 32 MiB) with a
fresh `mmap`, unmaps it on `free`, and returns the heap's free top to the system above its trim
threshold. A training step frees and allocates the same tensors every step (the gradients after
`zero_grad`, the optimizer's temporaries), so under the defaults it faults the same megabytes in
again every step, and how many depends on the process's history of allocations. Measured here
(the 784-1024x4-10 perceptron, one thread): Adam's step took 14-15 ms with 3,000-5,000
page faults per step, and 8.4 ms with none once both thresholds were fixed high; the same step
had been seen at 10-15 ms in one process and 24 ms in the next. The profiler measured the quiet
regime and the workers ran the faulting one, so every run of that model was slower than its
prediction.

So the profiler and every runtime and probe process call `keep_freed_memory`: freed memory stays
in the process for the next step (its resident size stays at its peak, which a training loop
reaches every step anyway), and the profile and the run measure the same allocator. The setting
is for the whole process and cannot be undone. Other C libraries are left as they are, and so is
every process when the environment says `HETPLAN_HOST_MEMORY=system` (for a machine whose other
jobs need the memory back; `bench/host_memory.py` compares the two).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
# glibc >= 2.35 accepts a threshold up to 1 GiB here; older ones cap it at 32 MiB (HEAP_MAX / 2),
# and a tensor above the cap is still mapped and unmapped every step. Threads other than the main
# one allocate from arenas whose blocks over 64 MiB are mapped whatever the threshold.
MMAP_THRESHOLDS_BYTES = (1 << 30, 32 << 20)
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # the largest `int` mallopt takes


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds high in this process (see the module's docstring);
    True if both were set; False where the C library is not glibc, where it refused (the mmap
    threshold may then be set alone), or where `HETPLAN_HOST_MEMORY=system` says to leave it."""
    if os.environ.get("HETPLAN_HOST_MEMORY", "keep") == "system":
        return False
    mallopt = _mallopt()
    if mallopt is None or not any(mallopt(_M_MMAP_THRESHOLD, size) for size in MMAP_THRESHOLDS_BYTES):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def _glibc(name: str):
    """A function of glibc, the C library this process already has loaded; None elsewhere (or
    where this glibc has no such function)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


@functools.cache
def _mallopt():
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    mallinfo2 = _glibc("mallinfo2")  # glibc 2.33 and later
    if mallinfo2 is not None:
        mallinfo2.argtypes, mallinfo2.restype = (), _MallInfo2
    return mallinfo2


def malloc_in_use_bytes() -> int | None:
    """What the C library's malloc has handed out and not had back, over all its arenas and its
    mapped blocks (glibc's `mallinfo2`): torch's CPU tensors among them. None where the C library
    cannot say. Sampled between a worker's actions, its rise over the step is the worker's tensors
    (activations, gradients, optimizer state, messages), which the process's resident size hides
    under torch's own libraries and buffers, hundreds of megabytes."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)

