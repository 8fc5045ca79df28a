"""How long dp takes to plan, against graph size and device count.

    .venv/bin/python bench/dp_scaling.py [-o bench/results/dp_scaling.json]

- resnet50 (the shared PipeDream profile, 177 nodes) on a100+v100-8, three runs;
- synthetic model-like graphs (`hetplan.planners.randomized.synthetic_graph`: residual blocks
  and Inception-like forks) of 100, 250, 500 and 1,000 nodes on 4, 8 and 16 devices of three
  types (A100, V100, T4, four to a host), one run each.
Reports the wall time of `make_plan(..., "dp")` (planning and the simulator's re-scoring), the
number of cut states (and how many the program kept), and the plan's simulated step against the
best of the five baselines.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from hetplan.io.clusters import load_cluster
from hetplan.io.pipedream import import_pipedream
from hetplan.planners import best_baseline, make_plan
from hetplan.planners.randomized import synthetic_cluster, synthetic_graph

SHARED = Path(os.environ.get("HETPLAN_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def run(graph, cluster) -> dict:
    t = time.perf_counter()
    plan = make_plan(graph, cluster, "dp")
    wall = time.perf_counter() - t
    base = best_baseline(graph, cluster)
    meta = plan.meta["dp"]
    return {"graph": graph.name, "nodes": len(graph.nodes), "devices": len(cluster.devices), "dp_s": wall,
            "states": meta["states"], "states_used": meta["states_used"], "device_orders": meta["device_orders"],
            "step_s": plan.predicted.step_s, "best_baseline_step_s": base.predicted.step_s if base else None,
            "stages": len(plan.stages)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("results") / "dp_scaling.json")
    args = parser.parse_args()
    rows = []
    r50 = import_pipedream(SHARED / "data" / "pipedream-profiles" / "resnet50" / "graph.txt")
    for _ in range(3):
        row = run(r50, load_cluster("a100+v100-8"))
        rows.append(row)
        print(row, flush=True)
    for n in (100, 250, 500, 1000):
        graph = synthetic_graph(n, np.random.default_rng(n))
        for devices in (4, 8, 16):
            row = run(graph, synthetic_cluster(devices))
            rows.append(row)
            print(row, flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
