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
import gc
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRELOAD = ("hetplan.runtime.preload",)  # what every worker imports: torch, hetplan's runtime
TRANSFORMERS = "hetplan.runtime.preload_transformers"  # what a transformers model's worker imports too
NAME = b"hetplan-worker"
_PR_SET_NAME = 15  # from <linux/prctl.h>
_PR_SET_PDEATHSIG = 1


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
    _settle(env, log)
    _name_me()
    sys.exit(_function(target)(*args))


def _settle(env: Mapping[str, str], log: str) -> None:
    """`env` as the whole environment, stdout and stderr into `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for out in (1, 2):
        os.dup2(fd, out)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)


def _function(target: str):
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when the thread that forked it ends; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class Member:
    """One process of a group: `target(*args, made)` with `env` as its environment and its output in `log`."""

    args: tuple
    env: Mapping[str, str]
    log: str


class Group:
    """The launcher's side of `start_group`: each member's exit status as the group's process
    relays it (None while it runs), and a stop for all."""

    def __init__(self, process, receive, size: int) -> None:
        self._process, self._receive, self._codes = process, receive, [None] * size
        self._forked: set[int] = set()

    def exitcodes(self) -> list[int | None]:
        ended = self._process.exitcode is not None  # read first: what it sent before it ended is in the pipe
        with contextlib.suppress(EOFError, OSError):  # OSError: closed by `stop`, all read
            while self._receive.poll():
                index, code = self._receive.recv()
                if code is None:
                    self._forked.add(index)
                else:
                    self._codes[index] = code
        if ended:  # the group's process has ended, so have its members (they die with it)
            gone = self._process.exitcode or -signal.SIGKILL
            self._codes = [gone if c is None else c for c in self._codes]
        return list(self._codes)

    def never_forked(self) -> set[int]:
        """The members whose status is the group's process's own: it ended before forking them."""
        codes = self.exitcodes()
        return {i for i, c in enumerate(codes) if c is not None and i not in self._forked} \
            if self._process.exitcode is not None else set()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to every member still running (the group's process passes it on), SIGKILL to
        all after `grace_s` (the members die with the group's process)."""
        stop([self._process], grace_s)
        self.exitcodes()  # what it relayed before it ended
        self._receive.close()


def start_group(make: str | None, make_args: Sequence, target: str, members: Sequence[Member],
                env: Mapping[str, str], log: Path, preload: Sequence[str] = PRELOAD) -> Group:
    """Processes running `target(*member.args, made)`, forked from one process that first ran
    `made = make(*make_args)` (with `env` and its output in `log`). `make` must leave that process
    without an OpenMP team or other threads; where it fails (said in `log`), or is None, `made`
    is None and each member makes what it needs itself."""
    receive, send = context(preload).Pipe(duplex=False)
    process = start("hetplan.forked:_brood", (make, tuple(make_args), target, tuple(members), send), env, log,
                    preload)
    send.close()
    return Group(process, receive, len(members))


def _brood(make: str | None, make_args: tuple, target: str, members: tuple[Member, ...], send) -> int:
    die_with_parent()  # the server that forked it ends with the launcher
    brood = os.getpid()
    try:
        made = _function(make)(*make_args) if make is not None else None
    except Exception:  # noqa: BLE001 - the members make their own, and say what fails
        with contextlib.suppress(OSError):  # a full disk: the log cannot take it, the members still start
            traceback.print_exc()
            print(f"{make} failed: each member makes what it needs itself", file=sys.stderr, flush=True)
        made = None
    live: dict[int, int] = {}
    stopping = []

    def pass_on(_signum, _frame) -> None:
        stopping.append(True)
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, pass_on)
    for index, member in enumerate(members):
        # SIGTERM waits while a member is forked, so that it reaches every member forked
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        if not stopping:
            pid = os.fork()
            if pid == 0:
                try:
                    send.close()  # the group's pipe is not the member's
                finally:
                    _member(target, member, made, brood)
            live[pid] = index
            send.send((index, None))
        else:
            send.send((index, -signal.SIGTERM))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # the members hold it by the fork: this process lets its own copy go (a model's weights
    # would otherwise sit here once more while they train)
    del made
    gc.collect()
    while live:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid in live:
            send.send((live.pop(pid), os.waitstatus_to_exitcode(status)))
    return 0


def _member(target: str, member: Member, made: Any, parent: int) -> None:
    """A member just forked: never returns to the group's loop."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if die_with_parent() and os.getppid() != parent:  # the group's process ended before it could ask
            os._exit(3)
        _settle(member.env, member.log)
        code = _status(_function(target)(*member.args, made))
    except SystemExit as exc:
        code = _status(exc.code)
    except BaseException:  # noqa: BLE001 - said in the member's log, as an uncaught error would be
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _status(result: object) -> int:
    """A process's exit status for what its function returned, as `sys.exit` takes it."""
    if result is None:
        return 0
    if isinstance(result, int):
        return result
    print(result, file=sys.stderr)
    return 1


def _name_me() -> None:
    with contextlib.suppress(OSError, AttributeError):
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(NAME), 0, 0, 0)
