"""Worker processes forked from the server that has imported torch (`hetplan.forked`) get what a
process started from the command line would: the environment they are given and nothing else of
it, a session of their own, their output in their log, their exit status, and a name `ps` shows;
a script that would start them while each of them imports it again is told to guard its start."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetplan import forked
from hetplan.runtime.preload import EXPORT_MACHINERY


def _report(out: str) -> int:
    print("to the log")
    print("and its errors", file=sys.stderr)
    comm = Path("/proc/self/comm").read_text().strip() if Path("/proc/self/comm").exists() else ""
    Path(out).write_text(json.dumps({"env": dict(os.environ), "session_leader": os.getsid(0) == os.getpid(),
                                     "comm": comm, "torch_imported_before": "torch" in sys.modules,
                                     "export_imported_before": all(m in sys.modules for m in EXPORT_MACHINERY)}))
    return 7


def test_a_forked_worker_has_its_environment_session_log_name_and_status(tmp_path):
    out, log = tmp_path / "out.json", tmp_path / "w.log"
    p = forked.start("test_forked:_report", (str(out),), {"ONLY": "this", "PATH": os.environ.get("PATH", "")}, log)
    p.join(timeout=120)
    assert p.exitcode == 7
    seen = json.loads(out.read_text())
    assert seen["env"] == {"ONLY": "this", "PATH": os.environ.get("PATH", "")}
    # and what torch.export imports at its first call: each run's tracing starts without that wait
    assert seen["session_leader"] and seen["torch_imported_before"] and seen["export_imported_before"]
    if sys.platform.startswith("linux"):
        assert seen["comm"] == "hetplan-worker"
    assert log.read_text().split() == ["to", "the", "log", "and", "its", "errors"]


SCRIPT = """
import sys
from hetplan import forked

def nothing():
    return 0

p = forked.start("__main__:nothing", (), {}, sys.argv[1])
p.join()
print("exit", p.exitcode)
"""


def test_a_script_that_starts_workers_unguarded_is_told_how_to_guard_it(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "w.log")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(Path(forked.__file__).parents[1])})
    assert "exit 1" in proc.stdout  # the worker's own import of the script failed, not the script
    assert "if __name__ == '__main__':" in proc.stderr and "bootstrapping phase" in proc.stderr


@pytest.mark.parametrize("status", [0, 3])
def test_the_exit_status_is_the_targets(tmp_path, status):
    p = forked.start("builtins:int", (status,), {}, tmp_path / "w.log")
    p.join(timeout=120)
    assert p.exitcode == status


def test_the_server_imports_transformers_only_for_a_model_that_uses_it():
    from hetplan.zoo import uses_transformers

    assert [uses_transformers(m) for m in ("gpt2-tiny", "llama-tiny", "resnet50", "mlp", "inception-tiny", "ctr-dnn")] \
        == [True, True, True, False, False, False]


def _wait_forever(deaf: bool, ready: str) -> None:
    import signal

    if deaf:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(ready).write_text("ready")
    while True:
        time.sleep(1)


def test_stop_asks_then_kills_what_does_not_listen(tmp_path):
    """A worker that ends on SIGTERM ends so (-15); one that ignores it is killed after the grace
    period (-9); one already ended is left as it ended; all are reaped."""
    ready = [tmp_path / "a.ready", tmp_path / "b.ready"]
    listens = forked.start("test_forked:_wait_forever", (False, str(ready[0])), {}, tmp_path / "a.log")
    deaf = forked.start("test_forked:_wait_forever", (True, str(ready[1])), {}, tmp_path / "b.log")
    done = forked.start("test_forked:_report", (str(tmp_path / "out.json"),), {}, tmp_path / "c.log")
    done.join(timeout=120)
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    forked.stop([listens, deaf, done], grace_s=1.0)
    assert (listens.exitcode, deaf.exitcode, done.exitcode) == (-15, -9, 7)


def _make(out: str) -> dict:
    Path(out).write_text(str(os.getpid()))
    return {"made_by": os.getpid()}


def _member(out: str, code: int, made) -> int:
    print("member", code)
    Path(out).write_text(json.dumps({"made": made, "parent": os.getppid(), "env": dict(os.environ)}))
    return code


def _cannot_make() -> None:
    raise ValueError("nothing to make")


def test_a_groups_members_start_with_what_was_made_once(tmp_path):
    """One process makes the thing once; each member, forked from it, starts with it, in its own
    environment and log, and its exit status comes back as its own."""
    outs = [tmp_path / f"m{i}.json" for i in range(3)]
    members = [forked.Member((str(o), code), {"WHO": str(i)}, str(tmp_path / f"m{i}.log"))
               for i, (o, code) in enumerate(zip(outs, (0, 5, 0), strict=True))]
    group = forked.start_group("test_forked:_make", (str(tmp_path / "maker"),), "test_forked:_member", members,
                               {"PATH": os.environ.get("PATH", "")}, tmp_path / "maker.log")
    deadline = time.monotonic() + 120
    while None in group.exitcodes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group.exitcodes() == [0, 5, 0]
    maker = int((tmp_path / "maker").read_text())
    for i, out in enumerate(outs):
        seen = json.loads(out.read_text())
        assert seen["made"]["made_by"] == maker == seen["parent"]
        assert seen["env"] == {"WHO": str(i)}
        assert (tmp_path / f"m{i}.log").read_text().split() == ["member", str((0, 5, 0)[i])]
    group.stop()


def test_a_group_whose_make_fails_starts_its_members_without_it(tmp_path):
    out = tmp_path / "m.json"
    group = forked.start_group("test_forked:_cannot_make", (), "test_forked:_member",
                               [forked.Member((str(out), 0), {}, str(tmp_path / "m.log"))], {},
                               tmp_path / "maker.log")
    deadline = time.monotonic() + 120
    while None in group.exitcodes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group.exitcodes() == [0]
    assert json.loads(out.read_text())["made"] is None
    said = (tmp_path / "maker.log").read_text()
    assert "ValueError: nothing to make" in said and "each member makes what it needs itself" in said
    group.stop()


def _member_waits(deaf: bool, ready: str, made) -> None:
    _wait_forever(deaf, ready)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="members die with their parent on Linux only")
def test_a_group_passes_sigterm_on_and_its_members_die_with_it(tmp_path):
    """Stopping the group asks its members to end (-15); one that ignores it dies with the
    group's process when that is killed after the grace period; none is left running."""
    ready = [tmp_path / "a.ready", tmp_path / "b.ready"]
    members = [forked.Member((deaf, str(r)), {}, str(tmp_path / f"{i}.log"))
               for i, (deaf, r) in enumerate(zip((False, True), ready, strict=True))]
    group = forked.start_group("test_forked:_make", (str(tmp_path / "maker"),), "test_forked:_member_waits",
                               members, {}, tmp_path / "maker.log")
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) ==
            int((tmp_path / "maker").read_text())]
    assert len(pids) == 2
    group.stop(grace_s=5.0)  # time for the group's process to pass SIGTERM on, on a busy machine
    assert group.exitcodes()[0] == -15 and group.exitcodes()[1] is not None
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in pids)


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _returns(value, made):
    return value


@pytest.mark.parametrize("value,status", [(None, 0), (3, 3), ("said", 1)])
def test_a_members_status_is_what_its_function_returns_as_sys_exit_takes_it(tmp_path, value, status):
    group = forked.start_group(None, (), "test_forked:_returns", [forked.Member((value,), {}, str(tmp_path / "m.log"))],
                               {}, tmp_path / "maker.log")
    deadline = time.monotonic() + 120
    while None in group.exitcodes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group.exitcodes() == [status]
    assert (tmp_path / "m.log").read_text().strip() == ("said" if value == "said" else "")
    group.stop()


BIG = 256 << 20


def _make_big(out: str) -> bytes:
    Path(out).write_text(str(os.getpid()))
    return b"\x01" * BIG


def _holds_big(ready: str, done: str, made) -> int:
    # written whole, then renamed: the test polls for the file and reads it at once
    Path(ready + ".tmp").write_text(str(len(made) == BIG and made[-1] == 1))
    os.replace(ready + ".tmp", ready)
    while not Path(done).exists():
        time.sleep(0.05)
    return 0


def _status_kib(pid: int, field: str) -> int:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's memory from /proc")
def test_the_group_process_lets_its_copy_go_once_the_members_hold_theirs(tmp_path):
    """What was made (here 256 MiB) stays whole in the members; the process that made it keeps no
    copy while they run, so a model's weights are not held once more beside them."""
    ready, done = tmp_path / "ready", tmp_path / "done"
    group = forked.start_group("test_forked:_make_big", (str(tmp_path / "maker"),), "test_forked:_holds_big",
                               [forked.Member((str(ready), str(done)), {}, str(tmp_path / "m.log"))], {},
                               tmp_path / "maker.log")
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.read_text() == "True"
        maker = int((tmp_path / "maker").read_text())
        deadline = time.monotonic() + 60  # the member may run before the maker lets go
        while _status_kib(maker, "VmHWM") - _status_kib(maker, "VmRSS") < 0.8 * BIG / 1024 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        peak, now = _status_kib(maker, "VmHWM"), _status_kib(maker, "VmRSS")
        assert peak - now > 0.8 * BIG / 1024, (peak, now)
    finally:
        done.write_text("")
        group.stop()
