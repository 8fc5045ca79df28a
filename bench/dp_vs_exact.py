"""dp against the exact optimum on random small problems.

    .venv/bin/python bench/dp_vs_exact.py [--problems 200] [--seed 0] [-o bench/results/dp_vs_exact.json]

Problems from `hetplan.planners.randomized.random_problem`: chains and branchy DAGs (forks of two
or three branches) of 3 to 12 nodes, 2 to 4 devices of 1 or 2 types on one or two hosts, memory
sometimes too small for the whole model; the time objective under 1F1B, micro-batches chosen by
the planners from {1, 2, 4, ..., 32}. Every plan is scored by the event simulator (relay
routing). Problems that `exact` refuses (too many candidates) or that have no feasible plan are
counted and skipped. Also reported: the best of the five baselines on the same problems.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from hetplan.errors import InfeasibleError
from hetplan.planners import best_baseline, make_plan
from hetplan.planners.randomized import random_problem


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("results") / "dp_vs_exact.json")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rows, refused, infeasible, drawn = [], 0, 0, 0
    while len(rows) < args.problems:
        graph, cluster = random_problem(rng)
        drawn += 1
        try:
            t = time.perf_counter()
            best = make_plan(graph, cluster, "exact")
            exact_s = time.perf_counter() - t
        except InfeasibleError as exc:
            if "too many to search" in str(exc):
                refused += 1
            else:
                infeasible += 1
            continue
        t = time.perf_counter()
        dp = make_plan(graph, cluster, "dp")
        dp_s = time.perf_counter() - t
        base = best_baseline(graph, cluster)
        opt = best.predicted.step_s
        rows.append({"nodes": len(graph.nodes), "edges": len(graph.edges), "devices": len(cluster.devices),
                     "types": len({d.type for d in cluster.devices}), "exact_step_s": opt,
                     "dp_step_s": dp.predicted.step_s, "dp_gap": dp.predicted.step_s / opt - 1,
                     "best_baseline_gap": (base.predicted.step_s / opt - 1) if base else None,
                     "exact_candidates": best.meta["exact"]["candidates"],
                     "exact_simulated": best.meta["exact"]["simulated"], "exact_s": exact_s, "dp_s": dp_s})
        if len(rows) % 20 == 0:
            print(f"{len(rows)} problems", flush=True)
    gaps = np.array([r["dp_gap"] for r in rows])
    base = np.array([r["best_baseline_gap"] for r in rows if r["best_baseline_gap"] is not None])
    summary = {
        "problems": len(rows), "drawn": drawn, "refused_by_exact": refused, "no_feasible_plan": infeasible,
        "dp_within_1pct": float(np.mean(gaps <= 0.01)), "dp_within_5pct": float(np.mean(gaps <= 0.05)),
        "dp_gap_max": float(gaps.max()), "dp_gap_mean": float(gaps.mean()),
        "dp_exact_share": float(np.mean(gaps <= 1e-9)),
        "baseline_within_1pct": float(np.mean(base <= 0.01)), "baseline_gap_median": float(np.median(base)),
        "baseline_gap_max": float(base.max()),
        "exact_s_median": float(np.median([r["exact_s"] for r in rows])),
        "exact_s_max": float(max(r["exact_s"] for r in rows)),
        "dp_s_median": float(np.median([r["dp_s"] for r in rows])), "dp_s_max": float(max(r["dp_s"] for r in rows)),
        "chains": sum(r["edges"] == r["nodes"] - 1 for r in rows),
    }
    print(json.dumps(summary, indent=1))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
