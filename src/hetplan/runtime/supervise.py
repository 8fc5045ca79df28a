"""Supervision both ways between `hetplan run` and its workers.

The launcher stops its workers when it fails or is interrupted (launch.py); this module covers the
other ways it can end. Workers start in sessions of their own (so that a terminal's Ctrl-C reaches
the launcher only, which then stops them in order), so when the launcher is killed (SIGKILL, an
out-of-memory kill) nothing else would stop them: each worker watches the launcher's process (a
pidfd on Linux, else its pid) and exits when it ends, and asks the kernel for SIGKILL when its
parent, the server that forked it, dies (Linux's PR_SET_PDEATHSIG).
SIGTERM and SIGHUP to the launcher become the same clean stop as Ctrl-C.

A run folder holds one run's heartbeats, results and logs; two runs writing one folder delete
each other's files, so the launcher holds an exclusive lock on the folder while it runs.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from hetplan import forked
from hetplan.errors import HetplanError

LAUNCHER_PID = "HETPLAN_LAUNCHER_PID"  # set by the launcher in each worker's environment
LOST_PEER = 4  # a worker's exit status when it failed because a peer had failed or fell silent


def _watch(launcher: int, every_s: float, wake: int | None = None) -> bool:
    """Return True when the launcher has ended: at once where Linux gives a handle on the process
    (a pidfd is readable from its exit, even before it is reaped), else by polling its pid; False
    when `wake` (a pipe's end) is written to first."""
    waits = [] if wake is None else [wake]
    try:
        handle = os.pidfd_open(launcher)
    except (AttributeError, OSError):
        handle = None
    if handle is not None:
        try:
            return handle in select.select([handle, *waits], [], [])[0]
        finally:
            os.close(handle)
    while _alive(launcher):
        if not waits:
            time.sleep(every_s)
        elif select.select(waits, [], [], every_s)[0]:
            return False
    return True


def _watch_launcher(launcher: int, every_s: float, wake: int | None = None) -> None:
    if _watch(launcher, every_s, wake):
        os._exit(3)  # orphaned: nobody will read what this worker does


def _launcher() -> int | None:
    """The pid of the `hetplan run` that started this process (None under torchrun); it exits
    at once if that launcher has ended already, and asks the kernel to end it with its parent."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher:
        return None
    forked.die_with_parent()
    if not _alive(int(launcher)):  # the launcher died before the watch began
        os._exit(3)
    return int(launcher)


def end_with_launcher(every_s: float = 0.5) -> None:
    """In a worker started by `hetplan run`: end when the launcher ends, however it ends. The
    worker's parent is the launcher's worker server (`runtime.forked`), which outlives the
    launcher while a worker of it runs: so each worker watches the launcher itself, and asks the
    kernel to end it with the server too. A worker started by torchrun (no launcher pid) is
    torchrun's to supervise."""
    launcher = _launcher()
    if launcher is not None:
        threading.Thread(target=_watch_launcher, args=(launcher, every_s), daemon=True, name="launcher-watch").start()


@contextlib.contextmanager
def launcher_watched(every_s: float = 0.5) -> Iterator[None]:
    """`end_with_launcher` while inside: the watching thread ends with the block, for a process
    that forks after it (a fork keeps only the thread that forks; one that copies a process while
    another thread holds a lock can hang)."""
    launcher = _launcher()
    if launcher is None:
        yield
        return
    wake, woken = os.pipe()
    watcher = threading.Thread(target=_watch_launcher, args=(launcher, every_s, wake), daemon=True,
                               name="launcher-watch")
    watcher.start()
    try:
        yield
    finally:
        os.write(woken, b"x")
        watcher.join()
        os.close(wake)
        os.close(woken)


def _alive(pid: int) -> bool:
    """Whether the process runs (an ended one not yet reaped, a zombie, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # there, but another user's
        return True
    with contextlib.suppress(OSError, IndexError):  # Linux: an ended process not yet reaped is a zombie
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


class Stopped(KeyboardInterrupt):
    """The launcher got SIGTERM or SIGHUP: stop as on Ctrl-C."""


def _stop_on_signal(signum, _frame) -> None:
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def stop_on_terminate() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Stopped` (a KeyboardInterrupt) in the main thread while inside."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, _stop_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def run_folder_lock(out_dir: Path, flag: str = "--out") -> Iterator[None]:
    """Hold `out_dir` for one run; another run asking for it is refused in one line (`flag`: the
    option that named the folder, `--out` or `--checkpoint-dir`, said in that line)."""
    import fcntl

    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise HetplanError(f"{out_dir} is in use by another hetplan run (pid {holder}); wait for it to end or "
                               f"give this run another {flag} folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def space_left(folder: Path) -> str:
    """What a failed write into `folder` most often means, said with the figure: the free space
    of its disk."""
    import shutil

    try:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        return f"check that {folder} can be written"
    return f"{free:,} bytes free on the disk of {folder}" + ("; free some space or write elsewhere"
                                                            if free < 64 << 20 else "")


def clear_failed_run(out_dir: Path, made: bool) -> None:
    """After a run failed: what only a running run needs goes (temporary files, heartbeats, empty
    error files and logs); an error or log with something in it stays, to read. A folder this run
    made that is left with nothing to read goes entirely, lock and run.json too."""
    for f in [*out_dir.glob(".*.tmp"), *out_dir.glob("heartbeat.*"), *out_dir.glob("error.*"),
              *out_dir.glob("worker.*.log"), *out_dir.glob("tracing.log")]:
        with contextlib.suppress(OSError):
            if f.name.startswith((".", "heartbeat.")) or f.stat().st_size == 0:
                f.unlink()
    left = {f.name for f in out_dir.iterdir()} if out_dir.is_dir() else set()
    if made and left <= {".lock", "run.json", "cluster.json", "graph.json"}:
        for name in left:
            with contextlib.suppress(OSError):
                (out_dir / name).unlink()
        with contextlib.suppress(OSError):
            out_dir.rmdir()


STOP_FILE = "stop-at-step"  # in the run folder: the step after which the launcher has the run stop


def stop_step(out_dir: Path) -> int | None:
    """The step whose checkpoint the launcher asked every worker to stop at (`runtime.elastic`, to
    go on under a plan for more devices; the workers agree on it: `saving.agreed_stop`); None if none."""
    try:
        return int((Path(out_dir) / STOP_FILE).read_text())
    except (OSError, ValueError):
        return None
