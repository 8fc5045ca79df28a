"""A day of a 32-GPU mixed cluster whose GPUs come and go, replayed against the three policies of
`hetplan replay` (`hetplan.availability`), side by side, at two restart costs.

The cluster: 16 A100-40GB (spot: preempted and returned a host of 4 at a time) and 16 V100-16GB
(on demand: a host fails now and then and comes back an hour later), hosts of 4 GPUs. The trace
is synthetic, from a seeded random process (no published per-type trace is at hand here): A100
events every 45 minutes on average (exponential gaps), each taking or returning one host; a V100
host fails every 6 hours on average. The model: OPT-1.3B counted (`--roofline`), 2,048 tokens, a
global batch of 512, planned by dp at every distinct set of devices.

    .venv/bin/python bench/availability_day.py [--seed 0] [--out bench/results/availability_day.json]

(the library's `hetplan replay`: each distinct set of devices planned once, replayed at both costs)
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from hetplan.io.clusters import hosts_spec

DAY_S, HOST = 86_400.0, 4


def synthetic_trace(seed: int) -> dict:
    rng = random.Random(seed)
    events = []
    t = 0.0
    while True:
        t += rng.expovariate(1 / 2700)
        if t >= DAY_S:
            break
        events.append((t, "a100-40gb", rng.choice((-HOST, HOST))))
    t = 0.0
    while True:
        t += rng.expovariate(1 / 21_600)
        if t >= DAY_S:
            break
        events += [(t, "v100-16gb", -HOST), (min(t + 3600, DAY_S - 1), "v100-16gb", HOST)]
    counts = {"a100-40gb": 16, "v100-16gb": 16}
    points = [{"t_s": 0.0, "counts": dict(counts)}]
    for t, kind, change in sorted(events):
        counts[kind] = min(max(counts[kind] + change, 0), 16)
        if counts != points[-1]["counts"]:
            points.append({"t_s": round(t, 1), "counts": dict(counts)})
    return {"horizon_s": DAY_S, "points": points}


def hetplan(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr)
    return done.stdout


def main() -> None:
    from dataclasses import asdict

    from hetplan.availability import Availability, Costs, plan_cache, replay
    from hetplan.graph import at_batch
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.io.graphs import load_graph
    from hetplan.planners import make_plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/availability_day.json"))
    ap.add_argument("--work", type=Path, default=Path("out/bench/availability"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    graph_file, trace_file = args.work / "opt13.json", args.work / "day.json"
    day = synthetic_trace(args.seed)
    trace_file.write_text(json.dumps(day, indent=1))
    hetplan("profile", "opt-1.3b", "--roofline", "a100-40gb", "--roofline", "v100-16gb", "--batch-size", "8",
            "--seq-len", "2048", "-o", str(graph_file))
    graph = at_batch(load_graph(graph_file), 512)
    cluster = cluster_from_spec(hosts_spec([("a100-40gb", 4, HOST), ("v100-16gb", 4, HOST)], name="mixed32"), "mixed32")
    trace = Availability(tuple(p["t_s"] for p in day["points"]), tuple(p["counts"] for p in day["points"]), DAY_S)
    plan_for = plan_cache(cluster, lambda there: make_plan(graph, there, "dp"))
    start = time.perf_counter()
    for counts in trace.counts:  # every distinct set of devices planned once, for both restart costs
        plan_for(counts)
    planning_s = time.perf_counter() - start
    rows = {}
    for restart_s in (120.0, 600.0):
        runs = replay(trace, plan_for, Costs(restart_s=restart_s, checkpoint_every_s=600.0))
        rows[str(int(restart_s))] = [{**asdict(r), "usd_per_million_samples": r.usd_per_million_samples}
                                     for r in runs]
        for r in runs:
            print(f"restart {restart_s:4.0f} s  {r.policy:14s} {r.samples / 1e6:8.3f} M samples  ${r.usd:9,.0f}  "
                  f"${r.usd_per_million_samples:8.2f}/M  lost {r.lost_s / 3600:5.2f} h  stopped "
                  f"{r.stopped_s / 3600:5.2f} h  restarts {r.restarts}", flush=True)
    distinct = len({tuple(sorted(c.items())) for c in trace.counts})
    print(f"{len(trace.times_s)} points, {distinct} distinct sets of devices planned by dp in {planning_s:.0f} s")
    args.out.write_text(json.dumps({"seed": args.seed, "points": len(day["points"]), "distinct": distinct,
                                    "planning_s": round(planning_s, 1), "trace": day, "by_restart_s": rows},
                                   indent=1))


if __name__ == "__main__":
    main()
