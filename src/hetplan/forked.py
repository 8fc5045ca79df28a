"""Local worker processes (the runtime's workers, the calibration probes, the profiler's
tensor-parallel groups), forked from one server process that has imported what they need.

A worker started as `python -m hetplan.runtime.worker` spends seconds importing before its first
step: torch with its distributed and export packages, and for a transformers model the library's
shared machinery (`transformers.modeling_utils`), about 5 s of one core here, per worker of every
run. Forked from a process that has imported them once, a worker starts with them imported.

The server is multiprocessing's forkserver: a fresh process started from the launcher, which
imports `hetplan.runtime.preload` (and `preload_transformers` for a model that needs it: 2.7 s a
run of another model need not wait for) and nothing else runs in it (no torch kernel, so no OpenMP
thread that a forked child could not use), started once per launching process and kept for its
later runs (a notebook, the test suite). It ignores Ctrl-C and ends when the launching process
ends, however it ends; the workers ask the kernel to end with it (`supervise.end_with_launcher`).

As under multiprocessing's spawn, a worker imports the launching script again (as `__mp_main__`)
before it runs: a script that starts a run does so under `if __name__ == "__main__":`
(multiprocessing refuses to start processes from a script being imported so, and says that).

Each worker gets here what a process started from the command line would have: the launcher's
environment with its own variables (RANK, WORLD_SIZE, ...), a session of its own (a terminal's
Ctrl-C reaches the launcher only, which stops the workers in order), its output in its log file,
and `hetplan-worker` as its name in `ps -o comm` and `top`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD = ("hetplan.runtime.preload",)  # what every worker imports: torch, hetplan's runtime
TRANSFORMERS = "hetplan.runtime.preload_transformers"  # what a transformers model's worker imports too
NAME = b"hetplan-worker"
_PR_SET_NAME = 15  # from <linux/prctl.h>


def context(preload: Sequence[str] = PRELOAD):
    """multiprocessing's forkserver context, its server importing `preload` when it starts (the
    list in force when this process's server starts decides: one given later is not read)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    return context


def warm(preload: Sequence[str] = (*PRELOAD, TRANSFORMERS)) -> None:
    """Start this process's server now, importing `preload`: for a process that will start
    workers of several models (a notebook, a test session)."""
    context(preload)
    multiprocessing.forkserver.ensure_running()


def start(target: str, args: Sequence, env: Mapping[str, str], log: Path, preload: Sequence[str] = PRELOAD):
    """A `multiprocessing.Process` running `target(*args)` forked from the server, with `env` as
    its whole environment and its output in `log`; its exit status is what `target` returns.
    `target` is "module:function", imported in the worker (as `python -m module` would be);
    `preload`: what the server imports if this starts it."""
    process = context(preload).Process(target=_forked, args=(target, tuple(args), dict(env), str(log)), daemon=False)
    process.start()
    return process


def stop(procs: Sequence, grace_s: float = 5.0) -> None:
    """End the processes still running: asked to (SIGTERM, so a worker can leave its files as it
    should), then killed after `grace_s`; each reaped."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()


def _forked(target: str, args: tuple, env: dict[str, str], log: str) -> None:
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for out in (1, 2):
        os.dup2(fd, out)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    _name_me()
    module, function = target.split(":")
    sys.exit(getattr(importlib.import_module(module), function)(*args))


def _name_me() -> None:
    with contextlib.suppress(OSError, AttributeError):
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(NAME), 0, 0, 0)
