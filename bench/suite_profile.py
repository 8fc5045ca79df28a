"""Where the test suite's time goes: the suite (or any pytest arguments) run under py-spy with every
process it starts sampled (`--subprocesses`: the pytest workers, the worker server and the workers
it forks, the commands the tests start), and the samples summed into what they were doing:
tracing (`torch.export`), copying traces for another rank (`split.rebind`), importing, planning,
simulating, and by test module.

py-spy counts a thread's samples while it waits in C (a lock, a socket) as well as while it
computes, so its seconds add up to more than the CPU seconds; read the shares, not the sums.
The suite runs under its usual `make test` settings (two workers), bytecode written.

    pip install py-spy  # not a dependency of hetplan
    .venv/bin/python bench/suite_profile.py [--out out/bench/suite] [-- PYTEST ARGS]
    .venv/bin/python bench/suite_profile.py --folded out/bench/suite/suite.folded   # summarise again
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

RATE_HZ = 50
# the first of these a sample's stack holds names what it was doing
KINDS = (
    ("tracing (torch.export)", "export_step (hetplan/pieces/tracing.py"),
    ("copying a trace for another rank (rebind)", "rebind (hetplan/pieces/split.py"),
    ("importing", "_find_and_load ("),
    ("event simulator", "simulate (hetplan/sim/__init__.py"),
    ("planners, besides the simulator", "make_plan (hetplan/planners/__init__.py"),
    ("profiler, besides tracing", "profile_step (hetplan/profile/__init__.py"),
    ("workers' steps (threads and processes)", "train (hetplan/runtime/worker.py"),
    ("building models", "load_model (hetplan/zoo/__init__.py"),
    ("hypothesis", "hypothesis/"),
)
TEST = re.compile(r"\((?:tests/)?(test_\w+)\.py")


def record(out: Path, pytest_args: list[str], py_spy: str) -> Path:
    folded = out / "suite.folded"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.monotonic()
    subprocess.run([py_spy, "record", "--subprocesses", "--rate", str(RATE_HZ), "--format", "raw", "-o", str(folded),
                    "--", sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", *pytest_args],
                   env=env, check=False)
    print(f"suite under py-spy: {time.monotonic() - start:,.0f} s wall")
    return folded


def summarise(folded: Path) -> tuple[collections.Counter, collections.Counter, float]:
    kinds: collections.Counter = collections.Counter()
    modules: collections.Counter = collections.Counter()
    total = 0
    with folded.open() as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            n = int(count)
            total += n
            kinds[next((kind for kind, mark in KINDS if mark in stack), "other")] += n
            found = TEST.search(stack)
            modules[found.group(1) if found else "(no test frame: forked workers, servers, commands)"] += n
    return kinds, modules, total / RATE_HZ


def show(kinds: collections.Counter, modules: collections.Counter, total_s: float) -> None:
    print(f"{total_s:,.0f} sampled seconds (py-spy, all processes)")
    for title, counter, top in (("by what it was doing", kinds, len(kinds)), ("by test module", modules, 25)):
        print(f"\n{title}:")
        for name, n in counter.most_common(top):
            print(f"  {n / RATE_HZ:8,.0f} s  {100 * n / RATE_HZ / total_s:5.1f} %  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/bench/suite"))
    parser.add_argument("--folded", type=Path, help="summarise this py-spy raw file instead of running the suite")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    folded = args.folded
    if folded is None:
        args.out.mkdir(parents=True, exist_ok=True)
        folded = record(args.out, args.pytest_args, args.py_spy)
    show(*summarise(folded))


if __name__ == "__main__":
    main()
