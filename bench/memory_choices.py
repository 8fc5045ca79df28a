"""Memory and precision choices on the same two workers: step and peak memory, predicted
against measured, on this machine's CPU workers, for each precision x (recomputation, or
optimizer-state sharding).

    .venv/bin/python bench/memory_choices.py [--steps 20] [--rounds 3] [--repeats 10]
        [--models NAME ...] [--choices NAME ...] [--precisions P ...] [-o bench/results/memory_choices.json]

`hetplan calibrate` of `local` first (as bench/schedules.py), then per model and precision
(fp32, bf16) a profile on one thread in that precision and, per round, the uniform two-stage
split under 1F1B with 4 micro-batches run with no stage, the first stage, and both stages
recomputing (whole, per block: `first-block`, `both-block`, or per block keeping the products'
outputs: `first-selective`, `both-selective`), and the model as one stage on
both workers (data parallel, 4 micro-batches) with
and without sharding Adam's state between them (`dp-shard`), and its gradients too (`dp-zero2`),
and its weights too (`dp-zero3`) (median step after 3 warm-up steps; the median
over rounds), against the event
simulator on the calibrated cluster from the median profile. Peak memory per worker: the
simulator's, against the worker's tensors as `hetplan run` measures them on a CPU (the most
malloc handed out over a step after the warm-up, above its level before the first step, plus
the weights, less what the math libraries keep between steps; the median over rounds), and
that libraries' part apart.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from predicted_vs_measured import median_graph
from schedules import MODELS as SCHEDULE_MODELS
from schedules import rounds, run_bench

from hetplan.plan import Stage
from hetplan.runtime.launch import launch, run_spec
from hetplan.runtime.settings import RunSettings
from hetplan.sim import simulate

PRECISIONS = ("fp32", "bf16")
CHOICES = {"none": (), "first": (0,), "both": (0, 1), "first-block": ((0,), "block"), "both-block": ((0, 1), "block"),
           "first-selective": ((0,), "selective"), "both-selective": ((0, 1), "selective"),
           "dp": "plain", "dp-shard": "shard", "dp-zero2": "shard2", "dp-zero3": "shard3"}
LEVELS = {"plain": 0, "shard": 1, "shard2": 2, "shard3": 3}  # the one-stage choices' `Stage.shard`
# the zoo's models of bench/schedules.py, and a Llama block by block (per-block recomputation's case)
MODELS = [*SCHEDULE_MODELS, ("llama-tiny", 8, 64, "block", None)]


def _choice(base, precision: str, choice) -> object:
    """The two-stage plan recomputing the stages `choice` names, or the model as one stage of
    both workers, sharding or not."""
    if isinstance(choice, str):
        nodes = tuple(n for s in base.stages for n in s.nodes)
        devices = tuple(d for s in base.stages for d in s.devices)
        return replace(base, precision=precision, stages=(Stage(nodes, devices, shard=LEVELS[choice]),))
    stages, unit = choice if len(choice) == 2 and isinstance(choice[1], str) else (choice, "stage")
    return replace(base, precision=precision, stages=tuple(replace(s, recompute=unit if k in stages else "none")
                                                           for k, s in enumerate(base.stages)))


def run_model(entry, cluster, calibrated, args, tmp) -> list[dict]:
    rows = []
    for precision in args.precisions or PRECISIONS:
        rows += _run_precision(entry, cluster, calibrated, args, tmp, precision)
    return rows


def _run_precision(entry, cluster, calibrated, args, tmp, precision: str) -> list[dict]:
    model, batch, seq, granularity, blocks = entry
    graphs, measured = [], {}
    for r, base in rounds(entry, cluster, args, graphs, precision):
        for name, choice in ((n, CHOICES[n]) for n in args.choices or CHOICES):
            plan = _choice(base, precision, choice)
            spec = run_spec(plan, cluster, model, RunSettings(batch_size=batch, seq_len=seq, granularity=granularity,
                            block_classes=tuple(blocks or ()), steps=args.steps, warmup=3,
                            out_dir=Path(tmp) / f"{model.replace(':', '-')}-{precision}-{r}-{name}"))
            result = launch(spec)
            library = {x["device"]: x.get("library_bytes") or 0 for x in result.ranks}
            measured.setdefault(name, []).append((result.measured_step_s, plan, result.peak_mem_bytes, library))
            print(f"{model:>22} {precision} {name:<8} round {r + 1}: "
                  f"{result.measured_step_s * 1e3:7.1f} ms", flush=True)
    graph = median_graph(graphs)
    rows = []
    for name, runs in measured.items():
        est = simulate(graph, calibrated, runs[0][1], timeline=False).estimate
        step = statistics.median(s for s, *_ in runs)
        rows.append({"model": model, "precision": precision, "recompute": name, "measured_step_s": step,
                     "measured_each_s": [s for s, *_ in runs], "predicted_step_s": est.step_s,
                     "measured_peak_mem_bytes": {d: statistics.median(r[2][d] for r in runs) for d in runs[0][2]},
                     "library_bytes": {d: statistics.median(r[3][d] for r in runs) for d in runs[0][3]},
                     "error": step / est.step_s - 1, "predicted_peak_mem_bytes": dict(est.peak_mem_bytes)})
    return rows


def describe(r: dict) -> str:
    mem = ", ".join(f"{d} {r['measured_peak_mem_bytes'][d] / 2**20:.1f} / {b / 2**20:.1f} MiB "
                    f"({r['measured_peak_mem_bytes'][d] / b - 1:+.0%}; libraries {r['library_bytes'][d] / 2**20:.1f})"
                    for d, b in r["predicted_peak_mem_bytes"].items())
    return (f"{r['model']:>22} {r['precision']} {r['recompute']:<8} measured {r['measured_step_s'] * 1e3:7.1f} ms "
            f"predicted {r['predicted_step_s'] * 1e3:7.1f} ms {r['error']:+.0%}; peak measured / predicted {mem}")


def more_arguments(parser) -> None:
    parser.add_argument("--choices", nargs="*", choices=list(CHOICES), help="a subset of the choices (default: all)")
    parser.add_argument("--precisions", nargs="*", choices=PRECISIONS, help="a subset of the precisions")


if __name__ == "__main__":
    run_bench("memory_choices", run_model, describe, MODELS, more_arguments)
