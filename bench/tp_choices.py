"""Tensor parallelism on this machine's two CPU workers: the model as one stage on one worker,
on both as data-parallel replicas, on both as one 2-way tensor-parallel group, and split in two
pipeline stages; step time predicted against measured.

    .venv/bin/python bench/tp_choices.py [--steps 10] [--rounds 2] [--repeats 10]
        [--models NAME ...] [-o bench/results/tp_choices.json]

`hetplan calibrate` of `local` first (as bench/schedules.py), then per model a profile on one
thread per round (block granularity: each transformer block one node) and the four plans, 4
micro-batches, 1F1B for the pipeline (median step after 3 warm-up steps; the median over
rounds), against the event simulator on the calibrated cluster from the median profile.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from predicted_vs_measured import median_graph
from schedules import rounds, run_bench

from hetplan.plan import Stage
from hetplan.runtime.launch import launch, run_spec
from hetplan.runtime.settings import RunSettings
from hetplan.sim import simulate

MODELS = [("gpt2-tiny", 8, 64, "block", ("GPT2Block",)), ("llama-tiny", 8, 64, "block", ("LlamaDecoderLayer",))]


def _choice(base, name: str):
    nodes = tuple(n for s in base.stages for n in s.nodes)
    a, b = base.stages[0].devices[0], base.stages[1].devices[0]
    return {"one": replace(base, stages=(Stage(nodes, (a,)),)),
            "dp": replace(base, stages=(Stage(nodes, (a, b)),)),
            "tp2": replace(base, stages=(Stage(nodes, (a,), tp=2, tp_devices=((a, b),)),)),
            "pipeline": base}[name]


def run_model(entry, cluster, calibrated, args, tmp) -> list[dict]:
    model, batch, seq, granularity, blocks = entry
    graphs, measured = [], {}
    for r, base in rounds(entry, cluster, args, graphs):
        for name in ("one", "dp", "tp2", "pipeline"):
            plan = _choice(base, name)
            spec = run_spec(plan, cluster, model, RunSettings(batch_size=batch, seq_len=seq, granularity=granularity,
                            block_classes=tuple(blocks or ()), steps=args.steps, warmup=3,
                            out_dir=Path(tmp) / f"{model}-{r}-{name}"))
            result = launch(spec)
            measured.setdefault(name, []).append((result.measured_step_s, plan))
            print(f"{model:>12} {name:<9} round {r + 1}: {result.measured_step_s * 1e3:7.1f} ms", flush=True)
    graph = median_graph(graphs)
    rows = []
    for name, runs in measured.items():
        est = simulate(graph, calibrated, runs[0][1], timeline=False).estimate
        step = statistics.median(s for s, _ in runs)
        rows.append({"model": model, "plan": name, "measured_step_s": step, "measured_each_s": [s for s, _ in runs],
                     "predicted_step_s": est.step_s, "error": step / est.step_s - 1})
    return rows


def describe(r: dict) -> str:
    return (f"{r['model']:>12} {r['plan']:<9} measured {r['measured_step_s'] * 1e3:7.1f} ms predicted "
            f"{r['predicted_step_s'] * 1e3:7.1f} ms {r['error']:+.0%}")


if __name__ == "__main__":
    run_bench("tp_choices", run_model, describe, MODELS)
