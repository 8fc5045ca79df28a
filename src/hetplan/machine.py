"""What this machine lets this process use: its cores. One owner, because the profiler (how many
threads a `cpu:N` device may have), the `local` preset (one worker per core) and the launcher
(which cores each worker is pinned to) must agree; a container or `taskset` gives a process
fewer cores than `os.cpu_count()` reports."""

from __future__ import annotations

import os


def core_ids() -> list[int]:
    """The cores this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many cores this process may run on."""
    return len(core_ids())
