"""A worker's heartbeat file, which the launcher's watchdog reads (`runtime.supervise`): the
worker's phase and step, and within a step the action it is at, so that a stuck run names what
each worker waits for.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetplan.runtime.spec import RunSpec


def write_json(path: Path, obj: Any) -> None:
    """`obj` as JSON, written whole: a reader (the launcher) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)
    except OSError:  # a full disk: no half file stays behind
        tmp.unlink(missing_ok=True)
        raise


def write_heartbeat(spec: RunSpec, rank: int, phase: str, step: int, at: str = "", done: int = 0) -> None:
    """The rank's heartbeat file, which the launcher's watchdog reads: its phase and step, and
    within a step where it is (`executor.Where`)."""
    write_json(spec.settings.out_dir / f"heartbeat.{rank}", {"rank": rank, "stage": spec.ranks[rank].stage,
                                                             "phase": phase, "step": step, "at": at, "done": done,
                                                             "t": time.time(), "pid": os.getpid()})


BEAT_S = 0.5  # how often a worker's heartbeat says where it is within a step, while that changes


class Heartbeat:
    """A worker's heartbeat: `beat(phase, step)` writes it at once; within a step a thread writes
    where the worker is (`where`, which its `RankRunner` moves) every BEAT_S while it changes, so
    that a stuck run names the action each worker is at and the peer it waits for (a file per
    action would cost more than many actions)."""

    def __init__(self, spec: RunSpec, rank: int) -> None:
        from hetplan.runtime.executor import Where

        self.spec, self.rank, self.where = spec, rank, Where()
        self.phase, self.step = "starting", -1
        self._lock = threading.Lock()
        self._written: tuple | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def beat(self, phase: str, step: int) -> None:
        with self._lock:  # the thread's write sees the phase and step together, never an older one
            self.phase, self.step, self.where.at = phase, step, ""
            self._write()
        if phase == "step" and not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def write(self) -> None:
        with self._lock:
            self._write()

    def _write(self) -> None:
        state = (self.phase, self.step, self.where.at, self.where.done)
        if state != self._written:
            write_heartbeat(self.spec, self.rank, *state)
            self._written = state

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            with contextlib.suppress(OSError):  # the main thread's next beat says what the disk refused
                self.write()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
