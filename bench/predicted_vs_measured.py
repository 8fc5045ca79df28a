"""Predicted against measured step time on this machine's CPU workers, uncalibrated and calibrated.

    .venv/bin/python bench/predicted_vs_measured.py [--steps 20] [--repeats 10] [--rounds 3]
        [--no-calibrate] [-o bench/results/predicted_vs_measured.json]

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

Rounds: this VM's speed moves by 15-25% between two profiles of the same model a few seconds
apart (inception-tiny's sum of nodes 165, 167, 209, 168, 193 and 170 ms in a row, one process),
so one profile and one run per plan measure the machine's moment as much as the simulator.
With `--rounds R` (3 by default) every model is profiled and every plan run once per round, the
rounds one after the other; the prediction comes from the per-node median of the R profiles
(`median_graph`) and the measured step is the median of the R runs. Each row also keeps each
round's own pair (that round's profile against that round's run), whose errors are summarised
as `single_shot`: what one profile and one run give on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan, Stage
from hetplan.planners import PlanOptions, make_plan
from hetplan.profile import profile_step
from hetplan.runtime.calibrate import calibrate_cluster
from hetplan.runtime.launch import launch, run_spec
from hetplan.runtime.settings import RunSettings
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


def median_graph(graphs):
    """The per-node median over profiles of one model (same nodes, same device types) of each
    time the simulator reads: forward, backward, their fixed parts (no more than the pass), the
    optimizer step, and the same on tensor-parallel groups where profiled."""
    first = graphs[0]
    ids = [tuple(n.id for n in g.nodes) for g in graphs]
    assert all(i == ids[0] for i in ids), "the profiles of one model differ in their nodes"

    def med(field, node_id, limit=None):
        maps = [getattr(g.node(node_id), field) for g in graphs]
        out = {k: statistics.median(m[k] for m in maps) for k in maps[0]}
        return {k: min(v, limit[k]) for k, v in out.items()} if limit else out

    def med_tp(node_id):  # each of a group's four times, per type and degree
        maps = [g.node(node_id).tp_s for g in graphs]
        out = {t: {k: tuple(statistics.median(m[t][k][i] for m in maps) for i in range(4)) for k in per}
               for t, per in maps[0].items()}
        return {t: {k: (w, b, min(f, w), min(g, b)) for k, (w, b, f, g) in per.items()} for t, per in out.items()}

    nodes = []
    for node in first.nodes:
        fwd, bwd = med("fwd_s", node.id), med("bwd_s", node.id)
        nodes.append(replace(node, fwd_s=fwd, bwd_s=bwd, fwd_fixed_s=med("fwd_fixed_s", node.id, fwd),
                             bwd_fixed_s=med("bwd_fixed_s", node.id, bwd), opt_s=med("opt_s", node.id),
                             tp_s=med_tp(node.id)))
    return replace(first, nodes=tuple(nodes))


def predict(graph, clusters, plan):
    plain, calibrated = clusters
    return {name: simulate(graph, c, plan, timeline=False).estimate.step_s
            for name, c in (("uncalibrated", plain), ("calibrated", calibrated)) if c is not None}


def profile_model(model, batch, seq, granularity, blocks, repeats, precision="fp32", tp_degrees=()):
    zm = load_model(model, batch_size=batch, seq_len=seq)
    return profile_step(zm.step, zm.batch, name=model, devices=["cpu:1"], granularity=granularity,
                        block_classes=blocks or zm.block_classes or None, repeats=repeats,
                        precision=precision, tp_degrees=tp_degrees).graph


def run_round(entry, clusters, args, tmp, rounds):
    """One round of a model: a profile, then every plan run once; appended to `rounds[model]`.
    The plans are made from the first round's profile and kept (dp's could change with it)."""
    model, batch, seq, granularity, blocks = entry
    graph = profile_model(model, batch, seq, granularity, blocks, args.repeats)
    plans = [(label, plan) for label, plan, _, _ in rounds[model][0][1]] if rounds[model] else plans_for(
        graph, clusters[0])
    runs = []
    for label, plan in plans:
        spec = run_spec(plan, clusters[0], model, RunSettings(batch_size=batch, seq_len=seq, granularity=granularity,
                        steps=args.steps, warmup=3,
                        out_dir=Path(tmp) / f"run-{model}-{len(rounds[model])}-{len(runs)}"))
        measured = launch(spec).measured_step_s
        runs.append((label, plan, measured, predict(graph, clusters, plan)))
        print(f"{model:>22} {label:<20} round {len(rounds[model]) + 1}: measured {measured * 1e3:7.1f} ms | "
              + " | ".join(f"{k} {v * 1e3:7.1f} ms ({measured / v - 1:+.0%})" for k, v in runs[-1][3].items()),
              flush=True)
    rounds[model].append((graph, runs))


def model_rows(model, rounds, clusters):
    """One row per plan: the median graph's prediction against the median measured step, and
    each round's own pair."""
    graph = median_graph([g for g, _ in rounds])
    rows = []
    for k, (label, plan, _, _) in enumerate(rounds[0][1]):
        measured_each = [runs[k][2] for _, runs in rounds]
        measured = statistics.median(measured_each)
        predicted = predict(graph, clusters, plan)
        rows.append({"model": model, "plan": label, "stages": len(plan.stages),
                     "replicas": [len(s.devices) for s in plan.stages], "microbatches": plan.microbatches,
                     "schedule": plan.schedule, "measured_step_s": measured, "measured_each_s": measured_each,
                     **{f"predicted_{n}_s": v for n, v in predicted.items()},
                     **{f"error_{n}": measured / v - 1 for n, v in predicted.items()},
                     **{f"error_each_{n}": [runs[k][2] / runs[k][3][n] - 1 for _, runs in rounds] for n in predicted}})
    return rows


def error_summary(errors):
    return {"median_abs_error": statistics.median(errors), "p90_abs_error": percentile(errors, 0.9),
            "max_abs_error": max(errors)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10, help="profiler repeats per node")
    parser.add_argument("--rounds", type=int, default=3, help="profiles and runs of each plan (medians)")
    parser.add_argument("--no-calibrate", action="store_true", help="predict on `local` as it is only")
    parser.add_argument("--models", nargs="*", help="a subset of the models, by name")
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "predicted_vs_measured.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds takes 1 or more")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    plain = load_cluster("local")
    calibrated, figures = (None, {}) if args.no_calibrate else calibrate_cluster(plain, say=print)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if calibrated is not None:
        serde.dump(calibrated, args.output.with_name("local-calibrated.json"))
    models = [m for m in MODELS if not args.models or m[0] in args.models]
    rounds: dict[str, list] = {m[0]: [] for m in models}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for entry in models:
                run_round(entry, (plain, calibrated), args, tmp, rounds)
    rows = [row for m in models for row in model_rows(m[0], rounds[m[0]], (plain, calibrated))]
    summary = {"plans": len(rows), "rounds": args.rounds, "steps": args.steps, "profile_repeats": args.repeats,
               "cpus": os.cpu_count()}
    for kind in ("uncalibrated", "calibrated"):
        errors = [abs(r[f"error_{kind}"]) for r in rows if f"error_{kind}" in r]
        if errors:
            summary[kind] = error_summary(errors)
            summary[f"single_shot_{kind}"] = error_summary([abs(e) for r in rows for e in r[f"error_each_{kind}"]])
    print(json.dumps(summary))
    args.output.write_text(json.dumps({"summary": summary, "calibration": figures, "rows": rows}, indent=1,
                                      default=str) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
