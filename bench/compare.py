"""`hetplan compare` on gpt2, resnet50 and gnmt over v100x4, hetero-4 and cloud-mix, for the time
and cost objectives.

    .venv/bin/python bench/compare.py [--budget-s 5] [-o bench/results/compare.json]

- resnet50 and gnmt: the shared PipeDream profiles (V100; gnmt with batch 64); gpt2: profiled
  here with `hetplan profile gpt2 --batch-size 8 --seq-len 128 --granularity block --device cpu`
  (cached in bench/results/gpt2-b8-s128-block.json), so on GPU clusters its times are roofline
  projections from this CPU and only roughly right.
- time objective: every planner (exact refuses problems this size); local-search with a budget.
- cost objective: the floor is half the throughput of the fastest baseline under the time
  objective (run at least half as fast as the best simple plan, as cheaply as possible).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.io.pipedream import import_pipedream
from hetplan.planners import BASELINES, PlanOptions
from hetplan.planners.compare import compare

SHARED = Path(os.environ.get("HETPLAN_SHARED", Path(__file__).resolve().parents[2] / "shared"))
RESULTS = Path(__file__).with_name("results")
PLANNERS = [*BASELINES, "dp", "local-search"]


def gpt2_graph():
    path = RESULTS / "gpt2-b8-s128-block.json"
    if not path.exists():
        subprocess.run([str(Path(sys.executable).with_name("hetplan")), "profile", "gpt2", "--batch-size", "8",
                        "--seq-len", "128", "--granularity", "block", "--device", "cpu", "-o", str(path)], check=True)
    return serde.load(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=5.0)
    parser.add_argument("-o", "--output", type=Path, default=RESULTS / "compare.json")
    args = parser.parse_args()
    profiles = SHARED / "data" / "pipedream-profiles"
    graphs = {"gpt2": gpt2_graph(), "resnet50": import_pipedream(profiles / "resnet50" / "graph.txt"),
              "gnmt": import_pipedream(profiles / "gnmt" / "graph.txt", batch_size=64)}
    out = []
    for model, graph in graphs.items():
        for cluster_name in ("v100x4", "hetero-4", "cloud-mix"):
            cluster = load_cluster(cluster_name)
            timed = compare(graph, cluster, PLANNERS, PlanOptions(budget_s=args.budget_s))
            fastest = max(r.plan.predicted.samples_per_s for r in timed.rows
                          if r.planner in BASELINES and r.plan is not None and r.plan.predicted.feasible)
            floor = fastest / 2
            costed = compare(graph, cluster, PLANNERS,
                             PlanOptions(objective="cost", min_samples_per_s=floor, budget_s=args.budget_s))
            for objective, result in (("time", timed), ("cost", costed)):
                body = result.to_json()
                body.update({"model": model, "objective": objective,
                             "floor_samples_per_s": floor if objective == "cost" else None})
                out.append(body)
                dp = next(r for r in result.rows if r.planner == "dp")
                gain = result.gain_over_baselines(dp)
                print(f"{model:>8} {cluster_name:<9} {objective:<4}: best {body['best']}, dp gain over the best "
                      f"baseline {'-' if gain is None else f'{gain:+.1%}'}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"comparisons": out}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
