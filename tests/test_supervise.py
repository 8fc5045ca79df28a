"""Supervision both ways: workers end when their launcher ends, however it
ends, and a run folder serves one run at a time. Before, `kill -9` or SIGTERM on `hetplan run`
left its workers training to the last step, and a second run in the same folder deleted the
first one's files."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetplan.errors import HetplanError
from hetplan.runtime.launch import launch
from hetplan.runtime.supervise import run_folder_lock
from slowness import limit_s
from test_runtime import two_stage

LAUNCHER = ("import sys; from pathlib import Path; from hetplan.runtime.launch import launch; "
            "from hetplan.runtime.spec import RunSpec; launch(RunSpec.from_json(Path(sys.argv[1]).read_text()))")


def workers_of(out_dir: Path) -> list[int]:
    """Pids of the worker processes running this run folder's spec."""
    spec = str(out_dir / "run.json")
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"hetplan.runtime.worker" in cmd and spec.encode() in cmd:
            found.append(int(entry.name))
    return found


def until(predicate, timeout_s: float, what: str):
    timeout_s = limit_s(timeout_s)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout_s:.0f} s")


def start_launcher(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A launcher of a long two-stage run, in a process of its own; returns once it trains."""
    out = tmp_path / "run"
    spec = two_stage(out, 100_000, timeout_s=60)
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(path)], stderr=subprocess.PIPE, text=True)
    until(lambda: all((out / f"heartbeat.{r}").exists() and json.loads((out / f"heartbeat.{r}").read_text())
                      .get("step", -1) >= 1 for r in range(2)), 120, "the workers did not start training")
    assert len(workers_of(out)) == 2
    return proc, out


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc to find the workers")
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_workers_end_when_the_launcher_is_killed_or_terminated(tmp_path, how):
    proc, out = start_launcher(tmp_path)
    if how == signal.SIGTERM:  # while it runs, a second run in the same folder is refused
        with pytest.raises(HetplanError, match=r"run is in use by another hetplan run \(pid \d+\)"):
            launch(two_stage(out, 2))
    os.kill(proc.pid, how)
    proc.wait(timeout=30)
    until(lambda: not workers_of(out), 15, "the workers outlived their launcher")
    if how == signal.SIGTERM:  # a clean stop, as on Ctrl-C: the launcher stopped them itself
        assert "Stopped: stopped by SIGTERM" in proc.stderr.read()


def test_a_run_folder_is_free_again_after_its_run(tmp_path):
    with run_folder_lock(tmp_path), pytest.raises(HetplanError, match="in use"), run_folder_lock(tmp_path):
        pass
    with run_folder_lock(tmp_path):  # released
        assert (tmp_path / ".lock").read_text() == str(os.getpid())
