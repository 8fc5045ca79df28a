"""How well the numpy fast path ranks and times plans, against the event simulator.

    .venv/bin/python bench/fast_vs_event.py [--plans 200] [-o bench/results/fast_vs_event.json]

For four PipeDream profiles on three cluster presets: random plans (1 to min(nodes, devices)
stages, up to three replicas per stage, 1-16 micro-batches, GPipe or 1F1B) scored by the event
simulator with direct routing and by the fast path, which folds replicas into one stage and
relays tensors that skip stages. Reports Spearman's rank correlation and the relative error of
the fast path's step time (median, 90th percentile, worst), and the share of plans where it is
exact (within 1e-9).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from hetplan.cost import CostModel
from hetplan.io.clusters import load_cluster
from hetplan.io.pipedream import import_pipedream
from hetplan.planners.randomized import random_plan
from hetplan.sim import simulate
from hetplan.sim.fast import fast_step_s

SHARED = Path(os.environ.get("HETPLAN_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plans", type=int, default=200)
    parser.add_argument("-o", "--output", type=Path,
                        default=Path(__file__).with_name("results") / "fast_vs_event.json")
    args = parser.parse_args()
    rows = []
    for model in ("alexnet", "vgg16", "resnet50", "gnmt"):
        graph = import_pipedream(SHARED / "data" / "pipedream-profiles" / model / "graph.txt",
                                 batch_size=64 if model == "gnmt" else None)
        for cluster_name in ("hetero-4", "cloud-mix", "a100+v100-8"):
            cluster = load_cluster(cluster_name)
            cost = CostModel(graph, cluster)
            rng = np.random.default_rng(0)
            plans = [random_plan(graph, cluster, rng, max_replicas=3) for _ in range(args.plans)]
            event = np.array([simulate(graph, cluster, p, routing="direct", timeline=False, cost=cost).estimate.step_s
                              for p in plans])
            fast = fast_step_s(graph, cluster, plans)
            rel = np.abs(fast / event - 1)
            row = {"model": model, "cluster": cluster_name, "plans": len(plans),
                   "replicated_plans": sum(any(len(s.devices) > 1 for s in p.stages) for p in plans),
                   "spearman": float(spearmanr(event, fast).statistic),
                   "rel_err_median": float(np.median(rel)), "rel_err_p90": float(np.quantile(rel, 0.9)),
                   "rel_err_max": float(rel.max()), "exact_share": float(np.mean(rel < 1e-9))}
            rows.append(row)
            print(f"{model:>8} on {cluster_name:<11}: Spearman {row['spearman']:.4f}, relative error median "
                  f"{row['rel_err_median']:.2%}, p90 {row['rel_err_p90']:.2%}, worst {row['rel_err_max']:.1%}; "
                  f"exact on {row['exact_share']:.0%} of {len(plans)} plans ({row['replicated_plans']} with replicas)",
                  flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
