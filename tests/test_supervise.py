"""Supervision both ways: workers end when their launcher ends, however it ends (`kill -9` or
SIGTERM on `hetplan run` must not leave them training to the last step), and a run folder, or a
checkpoint folder, serves one run at a time (two runs in one folder would delete each other's
files); a run that fails, a full disk included, says so in one line and leaves nothing half-made."""

import contextlib
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
    """Pids of this run folder's worker processes still alive (each heartbeat names its worker)."""
    found = []
    for beat in out_dir.glob("heartbeat.*"):
        with contextlib.suppress(OSError, ValueError):
            pid = json.loads(beat.read_text())["pid"]
            stat = Path(f"/proc/{pid}/stat").read_text()
            if Path(f"/proc/{pid}/comm").read_text().strip() == "hetplan-worker" and stat.split()[2] != "Z":
                found.append(pid)
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
    spec = two_stage(out, 100_000, "mlp", timeout_s=60)
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    # its temporary files (the workers' rendezvous) in the test's folder: a killed launcher leaves them
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(path)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
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
            launch(two_stage(out, 2, "mlp"))
    os.kill(proc.pid, how)
    proc.wait(timeout=30)
    until(lambda: not workers_of(out), 15, "the workers outlived their launcher")
    if how == signal.SIGTERM:  # a clean stop, as on Ctrl-C: the launcher stopped them itself
        assert "Stopped: stopped by SIGTERM" in proc.stderr.read()


def test_local_workers_meet_at_a_file_not_at_a_port_another_program_can_take(tmp_path, monkeypatch):
    """A port picked by the launcher and bound by rank 0 seconds later, once the step is traced,
    can be taken in between by another program (another run's gloo pairs): local workers meet at
    a file of their own (`backend.init_method`). A run goes through with the port its environment
    names held by someone else, and the file's folder goes with the run."""
    import socket

    from hetplan import forked
    from hetplan.runtime.backend import RENDEZVOUS_ENV

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
    envs, real = [], forked.start_group

    def seen(make, args, target, members, env, log, preload):
        envs.extend(m.env for m in members)
        return real(make, args, target, members, env, log, preload)

    monkeypatch.setattr(forked, "start_group", seen)
    with held:
        result = launch(two_stage(tmp_path / "run", 1, "mlp", warmup=0))
    assert result.steps == 1 and len(envs) == 2
    meet = {Path(env[RENDEZVOUS_ENV]) for env in envs}
    assert len(meet) == 1 and not next(iter(meet)).parent.exists()


def test_a_run_folder_is_free_again_after_its_run(tmp_path):
    with run_folder_lock(tmp_path), pytest.raises(HetplanError, match="in use"), run_folder_lock(tmp_path):
        pass
    with run_folder_lock(tmp_path):  # released
        assert (tmp_path / ".lock").read_text() == str(os.getpid())


def _small_disk(folder: Path, kib: int, command: str) -> subprocess.CompletedProcess:
    """`command` in a mount namespace of its own where `folder` is a tmpfs of `kib` KiB: a full
    disk, real, without root (an unprivileged user namespace maps this user to root in it)."""
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           f"mount -t tmpfs -o size={kib}k tmpfs {folder} && {command}"],
                          capture_output=True, text=True, timeout=limit_s(240))


def _can_mount(tmp_path: Path) -> bool:
    try:
        return _small_disk(tmp_path / "probe", 8, "true").returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture
def mlp_plan(tmp_path, cli):
    g, p = tmp_path / "g.json", tmp_path / "p.json"
    assert cli("profile", "mlp", "--batch-size", "8", "-o", g).code == 0
    assert cli("plan", g, "--cluster", "local", "--planner", "uniform", "-o", p).code == 0
    return g, p


@pytest.mark.parametrize("where", ["--out", "--checkpoint-dir"])
def test_a_run_on_a_full_disk_is_one_line_that_says_so_and_leaves_nothing(tmp_path, mlp_plan, where):
    """Workers that cannot write their heartbeats, errors or checkpoints: the launcher names the
    full disk with its free space (the workers' error files are empty there: no first line to
    read), and what the run made there goes again (the temporary files of an atomic write
    included)."""
    if not _can_mount(tmp_path):
        pytest.skip("no unprivileged mount namespace here (unshare --user --mount)")
    g, p = mlp_plan
    disk = tmp_path / "disk"
    out = disk / "run" if where == "--out" else tmp_path / "run"
    flags = f"--out {out}" + (f" --checkpoint-dir {disk / 'ck'}" if where == "--checkpoint-dir" else "")
    r = _small_disk(disk, 12 if where == "--out" else 100,
                    f"{sys.executable} -m hetplan run {p} --model mlp --graph {g} --steps 2 {flags}; echo rc=$?; "
                    f"ls -A {disk}")
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hetplan: error: ") and "Traceback" not in r.stderr, r.stderr
    assert "rc=2" in r.stdout and "bytes free on the disk of" in err[0], (r.stdout, err)
    if where == "--checkpoint-dir":
        assert "cannot write the checkpoint" in err[0]
    assert r.stdout.split("rc=2")[1].split() == [], r.stdout  # the small disk is empty again


def test_a_checkpoint_folder_serves_one_run_and_a_dry_run_waits_for_none(tmp_path, mlp_plan, cli):
    """Two runs with different --out folders but one --checkpoint-dir would write the same files;
    a dry run into the folder of a run still going would replace its run.json mid-run."""
    g, p = mlp_plan
    ck, out = tmp_path / "ck", tmp_path / "busy"
    with run_folder_lock(ck, "--checkpoint-dir"):
        r = cli("run", p, "--model", "mlp", "--graph", g, "--steps", "2", "--out", tmp_path / "other",
                "--checkpoint-dir", ck)
        assert r.code == 2 and "in use by another hetplan run" in r.err and "another --checkpoint-dir" in r.err
        assert not (tmp_path / "other").exists()
    with run_folder_lock(out):
        (out / "run.json").write_text("the running run's\n")
        (out / "heartbeat.0").write_text("{}")
        r = cli("run", p, "--model", "mlp", "--graph", g, "--steps", "2", "--out", out)
        assert r.code == 2 and "in use by another hetplan run" in r.err
        assert (out / "heartbeat.0").exists(), "a refused run cleared the running run's folder"
        r = cli("run", p, "--model", "mlp", "--graph", g, "--dry-run", "--out", out)
        assert r.code == 2 and "in use by another hetplan run" in r.err
        assert (out / "run.json").read_text() == "the running run's\n"
    assert cli("run", p, "--model", "mlp", "--graph", g, "--dry-run", "--out", out).code == 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to see a zombie")
def test_an_ended_launcher_not_yet_reaped_is_not_alive():
    """A killed launcher stays a zombie until its parent reaps it: its workers must end anyway."""
    from hetplan.runtime.supervise import _alive

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    until(lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 60,
          "the child did not end")
    assert not _alive(proc.pid) and _alive(os.getpid())
    proc.wait()
    assert not _alive(proc.pid)


def test_a_worker_that_lost_its_peer_is_told_from_one_that_failed():
    from hetplan.runtime.transport import lost_peer

    said = ["[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:427",
            "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete",
            "Connection reset by peer"]
    assert all(lost_peer(RuntimeError(s)) for s in said)
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not lost_peer(ValueError("Connection closed by peer"))  # only gloo's RuntimeError
