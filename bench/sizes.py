"""How long hetplan takes to answer for clusters of many devices, each command
in a process of its own as a user types it (Python's start included).

    .venv/bin/python bench/sizes.py [-o bench/results/sizes.json]

Clusters of N one-thread CPUs (`count: N`): 16, 256 and 1,024 (`hetplan.cluster.MAX_DEVICES`),
which load, and 100,000, which is refused. Commands: `info --json`, `simulate` of a two-stage
plan, `plan --planner single` and `plan --planner uniform` of a two-node graph.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COUNTS = (16, 256, 1024, 100_000)


def files(folder: Path, count: int) -> dict[str, Path]:
    cluster = folder / f"c{count}.yaml"
    cluster.write_text(f"devices: [{{id: c, type: cpu, threads: 1, binding: cpu, count: {count}}}]\n")
    graph = {"kind": "graph", "schema_version": 1, "name": "g", "batch_size": 8, "profiled_on": "cpu-1t",
             "nodes": [{"id": n, "op": "Linear", "fwd_s": {"cpu-1t": 0.01}, "bwd_s": {"cpu-1t": 0.02}} for n in "ab"],
             "edges": [{"src": "a", "dst": "b", "bytes": 1000}]}
    plan = {"kind": "plan", "schema_version": 1, "planner": "hand", "microbatches": 2, "schedule": "1f1b",
            "stages": [{"nodes": ["a"], "devices": ["c0"]}, {"nodes": ["b"], "devices": ["c1"]}]}
    (folder / "g.json").write_text(json.dumps(graph))
    (folder / "p.json").write_text(json.dumps(plan))
    return {"cluster": cluster, "graph": folder / "g.json", "plan": folder / "p.json"}


def timed(argv: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hetplan.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=600)
    return {"seconds": round(time.perf_counter() - start, 3), "exit": proc.returncode,
            "stderr": proc.stderr.strip().splitlines()[-1][:160] if proc.stderr.strip() else ""}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("results") / "sizes.json")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in COUNTS:
            f = files(Path(tmp), count)
            out = Path(tmp) / "out.json"
            commands = {"info --json": ["info", f["cluster"], "--json"],
                        "simulate": ["simulate", f["plan"], "--graph", f["graph"], "--cluster", f["cluster"]],
                        "plan single": ["plan", f["graph"], "--cluster", f["cluster"], "--planner", "single",
                                        "-o", out],
                        "plan uniform": ["plan", f["graph"], "--cluster", f["cluster"], "--planner", "uniform",
                                         "-o", out]}
            for name, command in commands.items():
                out.unlink(missing_ok=True)
                rows.append({"devices": count, "command": name, **timed(command)})
                print(f"{count:>7} devices  {name:<14} {rows[-1]['seconds']:7.2f} s  exit {rows[-1]['exit']}",
                      flush=True)
    args.output.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
