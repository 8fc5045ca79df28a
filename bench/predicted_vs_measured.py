"""Predicted against measured step time on this machine's CPU workers, uncalibrated and calibrated.

    .venv/bin/python bench/predicted_vs_measured.py [--steps 20] [--repeats 10] [--no-calibrate]
        [-o bench/results/predicted_vs_measured.json]

First `hetplan calibrate` of the `local` cluster (one single-threaded worker per core: two here),
in this session (`calibrate_cluster`, written beside the output as `local-calibrated.json`). Then
each model is profiled on one thread (`cpu:1`, the type of `local`'s workers) and every plan is
run once with `hetplan.runtime` (median step after 3 warm-up steps), and its measured step is
compared with two predictions of the event simulator for the same plan and graph: on `local` as
it is (catalog figures) and on the calibrated cluster. Models: three of the zoo (gpt2-tiny, the
wide mlp, inception-tiny) and a user model of this folder (`bench_models:encoder`, a transformer
encoder written from torch's layers). Plans: one worker alone, the two workers as a two-stage
pipeline (uniform split) under GPipe and 1F1B with 2, 4 and 8 micro-batches, dp's plan with 4
micro-batches, and data parallelism over both (replicas). The calibration's probe is a perceptron
of hetplan's own, none of these models.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan, Stage
from hetplan.planners import PlanOptions, make_plan
from hetplan.profile import profile_step
from hetplan.runtime.calibrate import calibrate_cluster
from hetplan.runtime.launch import launch, run_spec
from hetplan.sim import simulate
from hetplan.zoo import load_model

HERE = Path(__file__).resolve().parent
# (model, batch, sequence length, granularity, block classes)
MODELS = [("gpt2-tiny", 8, 64, "layer", None), ("mlp", 64, None, "layer", None),
          ("inception-tiny", 16, None, "block", None),
          ("bench_models:encoder", 16, 32, "block", ("TransformerEncoderLayer",))]


def plans_for(graph, cluster):
    ids = cluster.ids
    out = [("single", Plan((Stage(graph.topo_order, (ids[0],)),), 1, "1f1b", "single"))]
    for schedule in ("gpipe", "1f1b"):
        for m in (2, 4, 8):
            if graph.batch_size % m == 0:
                out.append((f"uniform {schedule} m={m}",
                            make_plan(graph, cluster, "uniform", PlanOptions(microbatches=m, schedule=schedule))))
    out.append(("dp m=4", make_plan(graph, cluster, "dp", PlanOptions(microbatches=4))))
    out.append(("data-parallel", make_plan(graph, cluster, "data-parallel")))
    return out


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_model(model, batch, seq, granularity, blocks, clusters, args, tmp, rows):
    zm = load_model(model, batch_size=batch, seq_len=seq)
    graph = profile_step(zm.step, zm.batch, name=model, devices=["cpu:1"], granularity=granularity,
                         block_classes=blocks or zm.block_classes or None, repeats=args.repeats).graph
    plain, calibrated = clusters
    for label, plan in plans_for(graph, plain):
        predicted = {name: simulate(graph, c, plan, timeline=False).estimate.step_s
                     for name, c in (("uncalibrated", plain), ("calibrated", calibrated)) if c is not None}
        spec = run_spec(plan, plain, model, batch_size=batch, seq_len=seq, granularity=granularity,
                        steps=args.steps, warmup=3, out_dir=Path(tmp) / f"run-{len(rows)}")
        measured = launch(spec).measured_step_s
        row = {"model": model, "plan": label, "stages": len(plan.stages),
               "replicas": [len(s.devices) for s in plan.stages], "microbatches": plan.microbatches,
               "schedule": plan.schedule, "measured_step_s": measured,
               **{f"predicted_{k}_s": v for k, v in predicted.items()},
               **{f"error_{k}": measured / v - 1 for k, v in predicted.items()}}
        rows.append(row)
        print(f"{model:>22} {label:<20} measured {measured * 1e3:7.1f} ms | " + " | ".join(
            f"{k} {v * 1e3:7.1f} ms ({row[f'error_{k}']:+.0%})" for k, v in predicted.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10, help="profiler repeats per node")
    parser.add_argument("--no-calibrate", action="store_true", help="predict on `local` as it is only")
    parser.add_argument("--models", nargs="*", help="a subset of the models, by name")
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "predicted_vs_measured.json")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    plain = load_cluster("local")
    calibrated, figures = (None, {}) if args.no_calibrate else calibrate_cluster(plain, say=print)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if calibrated is not None:
        serde.dump(calibrated, args.output.with_name("local-calibrated.json"))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, batch, seq, granularity, blocks in MODELS:
            if not args.models or model in args.models:
                run_model(model, batch, seq, granularity, blocks, (plain, calibrated), args, tmp, rows)
    summary = {"plans": len(rows), "steps": args.steps, "profile_repeats": args.repeats, "cpus": os.cpu_count()}
    for kind in ("uncalibrated", "calibrated"):
        errors = [abs(r[f"error_{kind}"]) for r in rows if f"error_{kind}" in r]
        if errors:
            summary[kind] = {"median_abs_error": statistics.median(errors), "p90_abs_error": percentile(errors, 0.9),
                             "max_abs_error": max(errors)}
    print(json.dumps(summary))
    args.output.write_text(json.dumps({"summary": summary, "calibration": figures, "rows": rows}, indent=1,
                                      default=str) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
