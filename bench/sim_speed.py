"""Simulator speed: plans scored per second by the event simulator and by the numpy fast path,
for chains of 4, 8 and 16 stages with 16 and 64 micro-batches (resnet50's PipeDream profile,
177 nodes, on a 16-device cluster of A100s, V100s and T4s on four hosts).

    taskset -c 0 .venv/bin/python bench/sim_speed.py [--seconds 2] [-o bench/results/sim_speed.json]

Measured for each shape, each as the best of three timed rounds of about `--seconds`:
- event: `simulate(..., timeline=False, cost=shared CostModel)` on random single-device chain
  plans (what a planner re-scoring plans calls), and with the timeline kept (what `hetplan
  simulate` does);
- fast, arrays: `ChainScorer.score` on batches of 1024 plans given as cut points and device
  indices (what a planner that searches over cuts calls);
- fast, plans: `fast_step_s` on the same `Plan` objects as the event simulator (builds each
  plan's inputs in Python first).
Run it on one core (taskset) with nothing else running; numpy here does element-wise work, so
one core is what it uses anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from hetplan.cost import CostModel  # noqa: E402
from hetplan.io.clusters import cluster_from_spec  # noqa: E402
from hetplan.io.pipedream import import_pipedream  # noqa: E402
from hetplan.planners.randomized import random_plan  # noqa: E402
from hetplan.sim import simulate  # noqa: E402
from hetplan.sim.chains import ChainScorer  # noqa: E402
from hetplan.sim.fast import fast_step_s  # noqa: E402

SHARED = Path(os.environ.get("HETPLAN_SHARED", Path(__file__).resolve().parents[2] / "shared"))
CLUSTER = {
    "name": "bench-16",
    "devices": [
        {"id": "a", "type": "a100-40gb", "host": "h0", "count": 4},
        {"id": "v", "type": "v100-32gb", "host": "h1", "count": 4},
        {"id": "t", "type": "t4-16gb", "host": "h2", "count": 4},
        {"id": "u", "type": "t4-16gb", "host": "h3", "count": 4},
    ],
    "network": {"intra_host": {"bandwidth": "100GB/s", "latency": "5us"},
                "inter_host": {"bandwidth": "25Gbit/s", "latency": "50us"}},
}


def rate(fn, per_call: int, seconds: float) -> float:
    """Best of three rounds: calls of `fn` (each scoring `per_call` plans) per second x per_call."""
    best = 0.0
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            fn()
            calls += 1
        best = max(best, calls * per_call / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("results") / "sim_speed.json")
    args = parser.parse_args()
    graph = import_pipedream(SHARED / "data" / "pipedream-profiles" / "resnet50" / "graph.txt")
    cluster = cluster_from_spec(CLUSTER, "bench-16")
    scorer = ChainScorer(graph, cluster)
    cost = CostModel(graph, cluster)  # shared across calls, as a planner shares it (node times cached)
    rng = np.random.default_rng(0)
    rows = []
    for n in (4, 8, 16):
        for m in (16, 64):
            plans = [random_plan(graph, cluster, rng, stages=n, microbatches=(m,), schedules=("1f1b",))
                     for _ in range(32)]
            it = iter(range(10**12))

            def event(plans=plans, it=it):
                simulate(graph, cluster, plans[next(it) % len(plans)], timeline=False, cost=cost)

            def event_timeline(plans=plans, it=it):
                simulate(graph, cluster, plans[next(it) % len(plans)], timeline=True, cost=cost)

            cuts = np.array([np.sort(rng.choice(np.arange(1, len(scorer.order)), n - 1, replace=False))
                             for _ in range(1024)])
            devices = np.array([rng.permutation(len(cluster.ids))[:n] for _ in range(1024)])
            scorer.program(n, m, "1f1b")  # compiled once per shape, as a planner would

            row = {
                "stages": n, "microbatches": m,
                "event_per_s": rate(event, 1, args.seconds),
                "event_timeline_per_s": rate(event_timeline, 1, args.seconds),
                "fast_arrays_per_s": rate(lambda cuts=cuts, devices=devices, m=m:
                                          scorer.score(cuts, devices, m, "1f1b"), len(cuts), args.seconds),
                "fast_plans_per_s": rate(lambda plans=plans: fast_step_s(graph, cluster, plans), len(plans),
                                         args.seconds),
            }
            rows.append(row)
            print(f"{n:>2} stages x {m:>2} micro-batches: event {row['event_per_s']:8,.0f}/s "
                  f"(with timeline {row['event_timeline_per_s']:7,.0f}/s), fast on arrays "
                  f"{row['fast_arrays_per_s']:10,.0f}/s, fast on Plan objects {row['fast_plans_per_s']:8,.0f}/s",
                  flush=True)
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "python": platform.python_version(),
               "numpy": np.__version__}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": machine, "graph": "resnet50 (PipeDream, 177 nodes)",
                                       "cluster": "bench-16", "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
