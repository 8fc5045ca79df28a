"""Zero bubble, interleaved 1F1B and ZB-V against 1F1B (and GPipe) on the same workers: step
and bubble, predicted against measured, on this machine's CPU workers.

    .venv/bin/python bench/schedules.py [--steps 20] [--rounds 3] [--repeats 10]
        [-o bench/results/schedules.json]

`hetplan calibrate` of `local` first (as bench/predicted_vs_measured.py), then per model a profile
on one thread and, per round, the same two-stage split run under each schedule with 4 and 8
micro-batches (median step after 3 warm-up steps; the median over rounds); interleaved 1F1B and
ZB-V run the same two workers with two stages each (stages 0, 2 and 1, 3; ZB-V's V: 0, 3 and
1, 2), the model cut in four by the planner's `hetplan.planners.interleave.interleaved` from the
first profile. The prediction is the
event simulator's on the calibrated cluster, from the median profile. Measured bubble: one minus
the workers' busy time (their actions less the receives inside them, and the optimizer step;
`hetplan.runtime.worker.step_busy_comm`) over workers x step. Zero bubble's I and W split the
backward by `hetplan.cost.formulas.WEIGHT_GRAD_SHARE` in the prediction (the profiler times the
backward whole). `predicted_without_tied_sum_s`: the same prediction with the graph's tied
parameters left out (no sum of GPT-2's shared embedding between the first and last stage).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from predicted_vs_measured import median_graph, profile_model

from hetplan.cost import CostModel
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.planners import PlanOptions, make_plan
from hetplan.planners.interleave import interleaved
from hetplan.runtime.calibrate import calibrate_cluster
from hetplan.runtime.launch import launch, run_spec
from hetplan.runtime.settings import RunSettings
from hetplan.schedule import get_schedule
from hetplan.sim import simulate

HERE = Path(__file__).resolve().parent
# (model, batch, sequence length, granularity, block classes)
MODELS = [("gpt2-tiny", 8, 64, "layer", None), ("mlp", 64, None, "layer", None),
          ("bench_models:encoder", 16, 32, "block", ("TransformerEncoderLayer",))]
SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "interleaved-1f1b", "zb-v")


def measured_bubble(result) -> float:
    busy = [statistics.median(r["busy_s"][result.warmup:] or r["busy_s"]) for r in result.ranks if r.get("busy_s")]
    return max(0.0, 1.0 - sum(busy) / (len(busy) * result.measured_step_s)) if busy else float("nan")


def rounds(entry, cluster, args, graphs: list, precision: str = "fp32", tp_degrees=()):
    """Per round: its index and the uniform two-stage plan, under 1F1B with 4 micro-batches, of
    the first profile; each round adds a profile in `precision` to `graphs` (with nodes timed on
    groups of `tp_degrees` workers)."""
    model, batch, seq, granularity, blocks = entry
    for r in range(args.rounds):
        graphs.append(profile_model(model, batch, seq, granularity, blocks, args.repeats, precision, tp_degrees))
        yield r, make_plan(graphs[0], cluster, "uniform", PlanOptions(microbatches=4, schedule="1f1b"))


def run_model(entry, cluster, calibrated, args, tmp) -> list[dict]:
    model, batch, seq, granularity, blocks = entry
    graphs, measured = [], {}
    for r, base in rounds(entry, cluster, args, graphs):
        for m in (4, 8):
            for schedule in SCHEDULES:
                plan = replace(base, microbatches=m, schedule=schedule)
                if get_schedule(schedule).interleaved:
                    plan = interleaved(CostModel(graphs[0], cluster), base, schedule, 2, m)
                spec = run_spec(plan, cluster, model, RunSettings(batch_size=batch, seq_len=seq,
                                granularity=granularity, block_classes=tuple(blocks or ()), steps=args.steps,
                                warmup=3, out_dir=Path(tmp) / f"{model.replace(':', '-')}-{r}-{m}-{schedule}"))
                result = launch(spec)
                measured.setdefault((m, schedule), []).append((result.measured_step_s, measured_bubble(result), plan))
                print(f"{model:>22} m={m} {schedule:<12} round {r + 1}: {result.measured_step_s * 1e3:7.1f} ms, "
                      f"bubble {measured_bubble(result):.0%}", flush=True)
    graph = median_graph(graphs)
    rows = []
    for (m, schedule), runs in measured.items():
        est = simulate(graph, calibrated, runs[0][2], timeline=False).estimate
        untied = simulate(replace(graph, tied=()), calibrated, runs[0][2], timeline=False).estimate
        step = statistics.median(s for s, _, _ in runs)
        rows.append({"model": model, "microbatches": m, "schedule": schedule, "stages": len(runs[0][2].stages),
                     "measured_step_s": step,
                     "measured_each_s": [s for s, _, _ in runs],
                     "measured_bubble": statistics.median(b for _, b, _ in runs),
                     "predicted_step_s": est.step_s, "predicted_bubble": est.bubble_fraction,
                     "error": step / est.step_s - 1, "tied_bytes": sum(t.bytes for t in graph.tied),
                     "predicted_without_tied_sum_s": untied.step_s})
    return rows


def run_bench(name: str, run_model, describe, models=None, more_arguments=None) -> None:
    """The command line and the run shared by the benchmarks of local workers on calibrated
    `local` (this one and bench/memory_choices.py): calibrate, then `run_model` per model, print each
    row by `describe`, write the rows to `-o` (default bench/results/NAME.json). `more_arguments`
    adds a benchmark's own flags to the parser."""
    parser = argparse.ArgumentParser()
    if more_arguments is not None:
        more_arguments(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10, help="profiler repeats per node")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="*", help="a subset of the models, by name")
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / f"{name}.json")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    plain = load_cluster("local")
    calibrated, figures = calibrate_cluster(plain, say=print)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    serde.dump(calibrated, args.output.with_name(f"local-calibrated-{name}.json"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in (m for m in models or MODELS if not args.models or m[0] in args.models):
            rows += run_model(entry, plain, calibrated, args, tmp)
    for r in rows:
        print(describe(r))
    args.output.write_text(json.dumps({"calibration": figures, "rounds": args.rounds, "steps": args.steps,
                                       "cpus": os.cpu_count(), "rows": rows}, indent=1, default=str) + "\n")
    print(f"wrote {args.output}")


def describe(r: dict) -> str:
    return (f"{r['model']:>22} m={r['microbatches']} {r['schedule']:<12} measured {r['measured_step_s'] * 1e3:7.1f} ms "
            f"(bubble {r['measured_bubble']:.0%}) predicted {r['predicted_step_s'] * 1e3:7.1f} ms "
            f"(bubble {r['predicted_bubble']:.0%}) {r['error']:+.0%}")


if __name__ == "__main__":
    run_bench("schedules", run_model, describe)
