"""Does dp miss plans? Local search from dp's plan, and the Input node's time zeroed.

    .venv/bin/python bench/dp_no_miss.py [--max-iters 300 | --budget-s 60] [-o bench/results/dp_no_miss.json]

For every shared profile but gnmt x {4, 8} V100s on one host x {10, 1 GB/s} links x {time,
throughput}:
- miss: dp's plan against local search started from it (`hetplan.planners.search`, the same
  scorer: the event simulator and the objective). The issue's target: never more than 1% better.
- Input zeroed: dp on the graph imported with `--input-time zero` (strictly less work) against
  dp's plan for the kept-Input graph re-scored on the zeroed graph. It must not be worse.
Local search by iterations (`--max-iters`, the same answer every run) or by time (`--budget-s`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from results_file import write_results

from hetplan.io.clusters import cluster_from_spec
from hetplan.io.pipedream import import_pipedream
from hetplan.planners import PlanOptions, make_plan
from hetplan.planners.scoring import Scorer
from hetplan.planners.search import local_search

HERE = Path(__file__).resolve().parent
PROFILES = HERE.parent.parent / "shared" / "data" / "pipedream-profiles"
MODELS = ("alexnet", "vgg16", "resnet18", "resnet50", "squeezenet1_0")


def v100s(n: int, bandwidth: str):
    return cluster_from_spec({"devices": [{"id": "gpu", "type": "v100-16gb", "host": "box", "count": n}],
                              "network": {"intra_host": {"bandwidth": bandwidth, "latency": "0s"}}},
                             f"v100x{n}-{bandwidth}")


def one(model: str, n: int, bandwidth: str, objective: str, args) -> dict:
    kept = import_pipedream(PROFILES / model / "graph.txt")
    zeroed = import_pipedream(PROFILES / model / "graph.txt", input_time="zero")
    cluster = v100s(n, bandwidth)
    options = PlanOptions(objective=objective, budget_s=args.budget_s, max_iters=args.max_iters)
    scorer = Scorer(kept, cluster, options)
    plan = make_plan(kept, cluster, "dp", options)
    searched = local_search(kept, cluster, options, start=plan, max_iters=args.max_iters)
    dp_value, ls_value = scorer.value(plan), scorer.value(searched)
    zero_scorer = Scorer(zeroed, cluster, options)
    zero_plan = make_plan(zeroed, cluster, "dp", options)
    return {"model": model, "devices": n, "bandwidth": bandwidth, "objective": objective,
            "dp": dp_value, "local_search": ls_value, "miss": dp_value / ls_value - 1,
            "zero_dp": zero_scorer.value(zero_plan), "kept_plan_on_zero": zero_scorer.value(plan),
            "zero_worse": zero_scorer.value(zero_plan) / zero_scorer.value(plan) - 1}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-iters", type=int, default=300)
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "dp_no_miss.json")
    args = parser.parse_args()
    if args.budget_s is not None:
        args.max_iters = None
    rows = []
    for model in args.models:
        for n in (4, 8):
            for bandwidth in ("10GB/s", "1GB/s"):
                for objective in ("time", "throughput"):
                    row = one(model, n, bandwidth, objective, args)
                    rows.append(row)
                    print(f"{model:>14} {n} {bandwidth:>7} {objective:<10} dp {row['dp'] * 1e3:8.2f} ms | local search "
                          f"{row['local_search'] * 1e3:8.2f} ms ({row['miss']:+.2%}) | Input zeroed: dp "
                          f"{row['zero_dp'] * 1e3:8.2f} ms, kept plan {row['kept_plan_on_zero'] * 1e3:8.2f} ms "
                          f"({row['zero_worse']:+.2%})", flush=True)
    summary = {"runs": len(rows), "over_1pct": sum(r["miss"] > 0.01 for r in rows),
               "max_miss": max(r["miss"] for r in rows), "zero_worse": sum(r["zero_worse"] > 1e-9 for r in rows),
               "max_zero_worse": max(r["zero_worse"] for r in rows), "max_iters": args.max_iters,
               "budget_s": args.budget_s, "cpus": os.cpu_count()}
    write_results(args.output, summary, rows)


if __name__ == "__main__":
    main()
