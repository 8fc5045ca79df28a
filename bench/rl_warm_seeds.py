"""Warm-started RL planners over seeds, with a fixed number of iterations (so every figure repeats).

    .venv/bin/python bench/rl_warm_seeds.py [--seeds 5] [-o bench/results/rl_warm_seeds.json]

gpt2 / hetero-4 and gnmt / cloud-mix; `ppo` with 250 iterations and `reinforce` with 1,000
(7-30 s each here), seeds 0 .. N-1; the event simulator's step time against dp's. The
warm start guarantees "never worse"; this measures how often it is better.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.io.pipedream import import_pipedream
from hetplan.planners import PlanOptions, make_plan
from hetplan.planners.scoring import Scorer

RESULTS = Path(__file__).with_name("results")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "pipedream-profiles"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("-o", "--output", type=Path, default=RESULTS / "rl_warm_seeds.json")
    args = parser.parse_args()
    problems = [("gpt2", serde.load(RESULTS / "gpt2-b8-s128-block.json"), "hetero-4"),
                ("gnmt", import_pipedream(SHARED / "gnmt" / "graph.txt", batch_size=64), "cloud-mix")]
    rows = []
    for model, graph, cname in problems:
        cluster = load_cluster(cname)
        scorer = Scorer(graph, cluster, PlanOptions())
        dp_v = scorer.value(make_plan(graph, cluster, "dp"))
        for planner, iters in (("ppo", 250), ("reinforce", 1000)):
            for seed in range(args.seeds):
                began = time.perf_counter()
                plan = make_plan(graph, cluster, planner, PlanOptions(max_iters=iters, seed=seed))
                gap = scorer.value(plan) / dp_v - 1
                rows.append({"model": model, "cluster": cname, "planner": planner, "iterations": iters, "seed": seed,
                             "vs_dp": gap, "seconds": time.perf_counter() - began,
                             "returned": plan.meta[planner]["returned"]})
                print(f"{model:>5} {cname:<9} {planner:<9} seed {seed}: {gap:+.2%} vs dp "
                      f"({rows[-1]['seconds']:.1f} s)", flush=True)
    args.output.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
