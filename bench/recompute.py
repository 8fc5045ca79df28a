"""Activation recomputation against none on the same two workers: step and peak memory,
predicted against measured, on this machine's CPU workers.

    .venv/bin/python bench/recompute.py [--steps 20] [--rounds 3] [--repeats 10]
        [-o bench/results/recompute.json]

`hetplan calibrate` of `local` first (as bench/schedules.py), then per model a profile on one
thread and, per round, the uniform two-stage split under 1F1B with 4 micro-batches run with
no stage, the first stage, and both stages recomputing (median step after 3 warm-up steps; the
median over rounds), against the event simulator on the calibrated cluster from the median
profile. Peak memory per worker: the simulator's, against the worker's tensors as `hetplan run`
measures them on a CPU (the most malloc handed out over a step after the warm-up, above its level
before the first step, plus the weights; the median over rounds).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from predicted_vs_measured import median_graph
from schedules import rounds, run_bench

from hetplan.runtime.launch import launch, run_spec
from hetplan.runtime.settings import RunSettings
from hetplan.sim import simulate

CHOICES = {"none": (), "first": (0,), "both": (0, 1)}


def run_model(entry, cluster, calibrated, args, tmp) -> list[dict]:
    model, batch, seq, granularity, blocks = entry
    graphs, measured = [], {}
    for r, base in rounds(entry, cluster, args, graphs):
        for name, stages in CHOICES.items():
            plan = replace(base, stages=tuple(replace(s, recompute=k in stages) for k, s in enumerate(base.stages)))
            spec = run_spec(plan, cluster, model, RunSettings(batch_size=batch, seq_len=seq, granularity=granularity,
                            block_classes=tuple(blocks or ()), steps=args.steps, warmup=3,
                            out_dir=Path(tmp) / f"{model.replace(':', '-')}-{r}-{name}"))
            result = launch(spec)
            measured.setdefault(name, []).append((result.measured_step_s, plan, result.peak_mem_bytes))
            print(f"{model:>22} recompute {name:<6} round {r + 1}: {result.measured_step_s * 1e3:7.1f} ms", flush=True)
    graph = median_graph(graphs)
    rows = []
    for name, runs in measured.items():
        est = simulate(graph, calibrated, runs[0][1], timeline=False).estimate
        step = statistics.median(s for s, _, _ in runs)
        peaks = {d: statistics.median(r[2][d] for r in runs) for d in runs[0][2]}
        rows.append({"model": model, "recompute": name, "measured_step_s": step,
                     "measured_each_s": [s for s, _, _ in runs], "predicted_step_s": est.step_s,
                     "measured_peak_mem_bytes": peaks,
                     "error": step / est.step_s - 1, "predicted_peak_mem_bytes": dict(est.peak_mem_bytes)})
    return rows


def describe(r: dict) -> str:
    mem = ", ".join(f"{d} {r['measured_peak_mem_bytes'][d] / 2**20:.1f} / {b / 2**20:.1f} MiB"
                    for d, b in r["predicted_peak_mem_bytes"].items())
    return (f"{r['model']:>22} {r['recompute']:<6} measured {r['measured_step_s'] * 1e3:7.1f} ms predicted "
            f"{r['predicted_step_s'] * 1e3:7.1f} ms {r['error']:+.0%}; peak measured / predicted {mem}")


if __name__ == "__main__":
    run_bench("recompute", run_model, describe)
