"""dp's certified gap on the `throughput` objective: the MILP planner's optimum or bound.

    .venv/bin/python bench/milp_gap.py [--budget-s 60] [-o bench/results/milp_gap.json]

Every shared PipeDream profile but gnmt (imported with `--input-time zero`, as PipeDream's
optimizer plans), on three clusters of 8 devices of 2 types: 4 V100 and 4 T4 on one host (every
link the same), and on two hosts at 10 GB/s and at 1 GB/s. For each, dp's plan and `milp` with a
60-second budget (`hetplan.planners.milp`: bisection with HiGHS feasibility programs over every
cut state). Reported: dp's steady state, the certified lower bound, dp's gap above it, whether the
MILP closed the gap (optimal), its programs and time.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from results_file import write_results

from hetplan.io.clusters import cluster_from_spec
from hetplan.io.pipedream import import_pipedream
from hetplan.planners import PlanOptions, make_plan
from hetplan.planners.scoring import Scorer

HERE = Path(__file__).resolve().parent
PROFILES = HERE.parent.parent / "shared" / "data" / "pipedream-profiles"
MODELS = ("resnet50", "vgg16", "alexnet", "resnet18", "squeezenet1_0")


def clusters():
    one_host = {"devices": [{"id": "v", "type": "v100-16gb", "host": "h0", "count": 4},
                            {"id": "t", "type": "t4-16gb", "host": "h0", "count": 4}],
                "network": {"intra_host": {"bandwidth": "10GB/s", "latency": "0s"}}}
    yield "1 host, 10 GB/s", cluster_from_spec(one_host, "v100-t4-1host")
    for bw in ("10GB/s", "1GB/s"):
        spec = {"devices": [{"id": "v", "type": "v100-16gb", "host": "h0", "count": 4},
                            {"id": "t", "type": "t4-16gb", "host": "h1", "count": 4}],
                "network": {"intra_host": {"bandwidth": "10GB/s", "latency": "0s"},
                            "inter_host": {"bandwidth": bw, "latency": "0s"}}}
        yield f"2 hosts, {bw} between", cluster_from_spec(spec, f"v100-t4-2hosts-{bw}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "milp_gap.json")
    args = parser.parse_args()
    rows = []
    for model in args.models:
        graph = import_pipedream(PROFILES / model / "graph.txt", input_time="zero")
        for label, cluster in clusters():
            options = PlanOptions(objective="throughput", budget_s=args.budget_s)
            scorer = Scorer(graph, cluster, options)
            dp_plan = make_plan(graph, cluster, "dp", options)
            start = time.perf_counter()
            plan = make_plan(graph, cluster, "milp", options)
            wall = time.perf_counter() - start
            cert = plan.meta["milp"]
            dp_s = scorer.value(dp_plan)
            row = {"model": model, "nodes": len(graph.nodes), "cluster": label, "dp_bottleneck_s": dp_s,
                   "dp_replicas": [len(s.devices) for s in dp_plan.stages], "dp_planning_s": dp_plan.meta["planning_s"],
                   "milp_bottleneck_s": scorer.value(plan), "lower_bound_s": cert["lower_bound_s"],
                   "dp_gap": dp_s / cert["lower_bound_s"] - 1, "optimal": cert["optimal"],
                   "options": cert["options"], "programs": cert["programs"], "stopped": cert["stopped"],
                   "milp_s": wall}
            rows.append(row)
            print(f"{model:>14} {label:<24} dp {dp_s * 1e3:8.3f} ms | bound {cert['lower_bound_s'] * 1e3:8.3f} ms "
                  f"| dp gap {row['dp_gap']:+.2%} | {'optimal' if cert['optimal'] else 'bound'} "
                  f"| {cert['options']:,} options, {cert['programs']} programs, {wall:.1f} s", flush=True)
    summary = {"runs": len(rows), "optimal": sum(r["optimal"] for r in rows),
               "max_dp_gap": max(r["dp_gap"] for r in rows), "max_milp_s": max(r["milp_s"] for r in rows),
               "cpus": os.cpu_count()}
    write_results(args.output, summary, rows)


if __name__ == "__main__":
    main()
