"""Predicted against measured step time on this machine's CPU workers.

    .venv/bin/python bench/predicted_vs_measured.py [--steps 20] [--repeats 10]
        [-o bench/results/predicted_vs_measured.json]

Profiles each model on one thread (`--device cpu:1`, the type of the `local` preset's workers),
then runs plans on the `local` cluster (one single-threaded worker per core: two here) with
`hetplan.runtime`, and compares the measured median step (after 3 warm-up steps) with the event
simulator's prediction for the same plan, graph and cluster (relay routing). Plans: one worker
alone, the two workers as a two-stage pipeline (uniform and dp's split) under GPipe and 1F1B with
2 to 8 micro-batches, and data parallelism over both. With `--cluster F` from `hetplan calibrate`,
the simulator also charges the runtime's measured cost per action (calibrated on hetplan's probe
perceptron, a model not in this benchmark).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan, Stage
from hetplan.planners import PlanOptions, make_plan
from hetplan.profile import profile_step
from hetplan.runtime.launch import launch, run_spec
from hetplan.sim import simulate
from hetplan.zoo import load_model

MODELS = [("gpt2-tiny", 8, 64, "layer"), ("mlp", 64, None, "layer"), ("inception-tiny", 16, None, "block")]


def plans_for(graph, cluster):
    ids = cluster.ids
    out = [("single", Plan((Stage(graph.topo_order, (ids[0],)),), 1, "1f1b", "single"))]
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4, 8):
            if graph.batch_size % m == 0:
                out.append((f"uniform {schedule} m={m}",
                            make_plan(graph, cluster, "uniform", PlanOptions(microbatches=m, schedule=schedule))))
    dp = make_plan(graph, cluster, "dp", PlanOptions(microbatches=4))
    if len({len(s.devices) for s in dp.stages}) == 1:
        out.append(("dp m=4", dp))
    out.append(("data-parallel", make_plan(graph, cluster, "data-parallel")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10, help="profiler repeats per node")
    parser.add_argument("--profile-calibrate", action="store_true",
                        help="profile with calibrate=True (node times scaled to the pieces run in sequence)")
    parser.add_argument("--cluster", default="local",
                        help="local, or the cluster `hetplan calibrate --cluster local -o F` wrote")
    parser.add_argument("-o", "--output", type=Path,
                        default=Path(__file__).with_name("results") / "predicted_vs_measured.json")
    args = parser.parse_args()
    cluster = load_cluster(args.cluster)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, batch, seq, granularity in MODELS:
            zm = load_model(name, batch_size=batch, seq_len=seq)
            graph = profile_step(zm.step, zm.batch, name=name, devices=["cpu:1"], granularity=granularity,
                                 block_classes=zm.block_classes or None, repeats=args.repeats,
                                 calibrate=args.profile_calibrate).graph
            for label, plan in plans_for(graph, cluster):
                predicted = simulate(graph, cluster, plan, timeline=False).estimate.step_s
                spec = run_spec(plan, cluster, name, batch_size=batch, seq_len=seq, granularity=granularity,
                                steps=args.steps, warmup=3, out_dir=Path(tmp) / f"{name}-{len(rows)}")
                result = launch(spec)
                row = {"model": name, "plan": label, "stages": len(plan.stages),
                       "replicas": len(plan.stages[0].devices), "microbatches": plan.microbatches,
                       "schedule": plan.schedule, "predicted_step_s": predicted,
                       "measured_step_s": result.measured_step_s, "step_times_s": list(result.step_times_s),
                       "error": result.measured_step_s / predicted - 1}
                rows.append(row)
                print(f"{name:>14} {label:<22} predicted {predicted * 1e3:8.1f} ms, measured "
                      f"{result.measured_step_s * 1e3:8.1f} ms, error {row['error']:+.0%}", flush=True)
    errors = [abs(r["error"]) for r in rows]
    summary = {"plans": len(rows), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
               "cluster": cluster.name, "steps": args.steps, "profile_repeats": args.repeats,
               "profile_calibrate": args.profile_calibrate,
               "action_overhead_s": max(d.action_overhead_s for d in cluster.devices),
               "step_overhead_s": max(d.step_overhead_s for d in cluster.devices)}
    print(json.dumps(summary))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
