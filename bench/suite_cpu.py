"""The test suite's wall time and the CPU seconds the machine spent on it, at one or more commits
side by side, one after the other in one run.

The CPU seconds are the machine's busy time over the run (/proc/stat: user, system and the rest,
all processes), so they count every process the suite starts (pytest's workers, the worker
servers and the workers they fork, the commands the tests run), which `time` misses for the
processes it does not wait for. Run it on an otherwise idle machine. On a 2-core VM the suite
keeps both cores busy (BENCHMARKS.md, "How steady this machine is"): its wall time follows the CPU
seconds, give or take the machine's noise, and those are what a change of the suite's work moves.

Each commit runs from a throwaway checkout (`git worktree`) with this checkout's .venv, hetplan
imported from the checkout's src (PYTHONPATH), bytecode cached as `make test` caches it.

    .venv/bin/python bench/suite_cpu.py a4f4507 HEAD            # the whole suite at both
    .venv/bin/python bench/suite_cpu.py HEAD -- tests/test_rebind.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def busy_s() -> float:
    """The machine's busy CPU seconds since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - fields[3] - fields[4]) / ticks


def run_at(commit: str, pytest_args: list[str]) -> tuple[float, float, str]:
    """(wall s, busy CPU s, pytest's last line and the tests that failed) of the suite at `commit`."""
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        tree = Path(tmp) / "tree"
        (Path(tmp) / "shared").symlink_to((REPO.parent / "shared").resolve())  # the tests' ../shared
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), commit], check=True)
        try:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
            env["PYTHONPATH"] = str(tree / "src")
            start_wall, start_busy = time.monotonic(), busy_s()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                                   *pytest_args], cwd=tree, env=env, capture_output=True, text=True)
            wall, busy = time.monotonic() - start_wall, busy_s() - start_busy
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    lines = proc.stdout.strip().splitlines() or ["(no output)"]
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]  # pytest's short summary
    return wall, busy, "\n".join([lines[-1], *(f"{'':<33}{line}" for line in failed)])


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="after --: pytest's arguments (default: the whole suite)")
    ap.add_argument("commits", nargs="+", help="commits to run the suite at, in this order")
    args = ap.parse_args(argv[:split])
    pytest_args = argv[split + 1:]
    print(f"{'commit':<10} {'wall s':>8} {'busy CPU s':>11}  pytest")
    for commit in args.commits:
        wall, busy, last = run_at(commit, pytest_args)
        print(f"{commit:<10} {wall:8.0f} {busy:11.0f}  {last}", flush=True)


if __name__ == "__main__":
    main()
