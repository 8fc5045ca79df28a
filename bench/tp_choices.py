"""Tensor parallelism on this machine's two CPU workers: the model as one stage on one worker,
on both as data-parallel replicas, on both as one 2-way tensor-parallel group (with sequence
parallelism too: `tp2-sp`), and split in two pipeline stages; step time and peak memory per
worker predicted against measured (as bench/memory_choices.py measures it).

    .venv/bin/python bench/tp_choices.py [--steps 10] [--rounds 2] [--repeats 10]
        [--models NAME ...] [--plans NAME ...] [--tp-measured] [-o bench/results/tp_choices.json]

`hetplan calibrate` of `local` first (as bench/schedules.py), then per model a profile on one
thread per round (block granularity: each transformer block one node) and the four plans, 4
micro-batches, 1F1B for the pipeline (median step after 3 warm-up steps; the median over
rounds), against the event simulator on the calibrated cluster from the median profile. With
`--tp-measured` the profile times each node on a 2-way group of workers too, which the prediction
takes over the projection; each row says both.
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

PLANS = ("one", "dp", "tp2", "tp2-sp", "pipeline")
MODELS = [("gpt2-tiny", 8, 64, "block", ("GPT2Block",)), ("llama-tiny", 8, 64, "block", ("LlamaDecoderLayer",))]


def _choice(base, name: str):
    nodes = tuple(n for s in base.stages for n in s.nodes)
    a, b = base.stages[0].devices[0], base.stages[1].devices[0]
    return {"one": replace(base, stages=(Stage(nodes, (a,)),)),
            "dp": replace(base, stages=(Stage(nodes, (a, b)),)),
            "tp2": replace(base, stages=(Stage(nodes, (a,), tp=2, tp_devices=((a, b),)),)),
            "tp2-sp": replace(base, stages=(Stage(nodes, (a,), tp=2, tp_devices=((a, b),), sequence_parallel=True),)),
            "pipeline": base}[name]


def run_model(entry, cluster, calibrated, args, tmp) -> list[dict]:
    model, batch, seq, granularity, blocks = entry
    graphs, measured = [], {}
    for r, base in rounds(entry, cluster, args, graphs, tp_degrees=(2,) if args.tp_measured else ()):
        for name in args.plans or PLANS:
            plan = _choice(base, name)
            spec = run_spec(plan, cluster, model, RunSettings(batch_size=batch, seq_len=seq, granularity=granularity,
                            block_classes=tuple(blocks or ()), steps=args.steps, warmup=3,
                            out_dir=Path(tmp) / f"{model}-{r}-{name}"))
            result = launch(spec)
            measured.setdefault(name, []).append((result.measured_step_s, plan, result.peak_mem_bytes))
            print(f"{model:>12} {name:<9} round {r + 1}: {result.measured_step_s * 1e3:7.1f} ms", flush=True)
    graph = median_graph(graphs)
    rows = []
    for name, runs in measured.items():
        est = simulate(graph, calibrated, runs[0][1], timeline=False).estimate
        projected = simulate(replace(graph, nodes=tuple(replace(n, tp_s={}) for n in graph.nodes)), calibrated,
                             runs[0][1], timeline=False).estimate.step_s
        step = statistics.median(s for s, *_ in runs)
        rows.append({"model": model, "plan": name, "measured_step_s": step, "measured_each_s": [s for s, *_ in runs],
                     "predicted_step_s": est.step_s, "error": step / est.step_s - 1,
                     "projected_step_s": projected, "projected_error": step / projected - 1,
                     "measured_peak_mem_bytes": {d: statistics.median(r[2][d] for r in runs) for d in runs[0][2]},
                     "predicted_peak_mem_bytes": dict(est.peak_mem_bytes)})
    return rows


def describe(r: dict) -> str:
    mem = ", ".join(f"{d} {r['measured_peak_mem_bytes'][d] / 2**20:.1f} / {b / 2**20:.1f} MiB "
                    f"({r['measured_peak_mem_bytes'][d] / b - 1:+.0%})"
                    for d, b in r["predicted_peak_mem_bytes"].items() if d in r["measured_peak_mem_bytes"])
    return (f"{r['model']:>12} {r['plan']:<9} measured {r['measured_step_s'] * 1e3:7.1f} ms predicted "
            f"{r['predicted_step_s'] * 1e3:7.1f} ms {r['error']:+.0%} (the group projected: "
            f"{r['projected_step_s'] * 1e3:7.1f} ms {r['projected_error']:+.0%}); peak measured / predicted {mem}")


def more_arguments(parser) -> None:
    parser.add_argument("--plans", nargs="*", choices=PLANS, help="a subset of the plans (default: all)")
    parser.add_argument("--tp-measured", action="store_true",
                        help="profile each node on a 2-way group too (`hetplan profile --tp-degrees 2`); each row "
                             "then says the step predicted from those times and from the projection alone")


if __name__ == "__main__":
    run_bench("tp_choices", run_model, describe, MODELS, more_arguments)
