"""Training steps with the host allocator kept (`hetplan.pieces.hostmem`, the default) against
glibc's defaults (`HETPLAN_HOST_MEMORY=system`), side by side in one run.

    .venv/bin/python bench/host_memory.py [--rounds 3] [--steps 20] [-o bench/results/host_memory.json]

For each model (the zoo's wide mlp at 64, gpt2-tiny 8x64, inception-tiny 16 and the encoder of
`bench_models.py` 16x32) and plan (one worker alone; the two workers of `local` as replicas),
`hetplan.runtime` runs the plan once per setting per round, the settings alternating within a
round so that the machine's drift falls on both. The measured step is the median over steps
after 3 warm-up steps; the figure is the median over rounds. The workers inherit the setting
from the environment; the profile a run needs for its shapes is taken once per model with the
default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan, Stage
from hetplan.planners import make_plan
from hetplan.runtime.launch import launch, run_spec
from hetplan.runtime.settings import RunSettings

HERE = Path(__file__).resolve().parent
MODELS = [("mlp", 64, None), ("gpt2-tiny", 8, 64), ("inception-tiny", 16, None), ("bench_models:encoder", 16, 32)]
SETTINGS = ("keep", "system")


def _plans(graph, cluster):
    return [("single", Plan((Stage(graph.topo_order, (cluster.ids[0],)),), 1, "1f1b", "single")),
            ("data-parallel", make_plan(graph, cluster, "data-parallel"))]


def _graph(model, batch, seq):
    from hetplan.profile import profile_step
    from hetplan.zoo import load_model

    zm = load_model(model, batch_size=batch, seq_len=seq)
    return profile_step(zm.step, zm.batch, name=model, devices=["cpu:1"], repeats=1, fixed=False).graph


def _run(plan, cluster, model, batch, seq, steps, out_dir, setting) -> float:
    before = os.environ.get("HETPLAN_HOST_MEMORY")
    os.environ["HETPLAN_HOST_MEMORY"] = setting
    try:
        spec = run_spec(plan, cluster, model, RunSettings(batch_size=batch, seq_len=seq, granularity="layer",
                        steps=steps, warmup=3, out_dir=out_dir))
        return launch(spec).measured_step_s
    finally:
        if before is None:
            os.environ.pop("HETPLAN_HOST_MEMORY", None)
        else:
            os.environ["HETPLAN_HOST_MEMORY"] = before


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "host_memory.json")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    cluster = load_cluster("local")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, batch, seq in MODELS:
            graph = _graph(model, batch, seq)
            for label, plan in _plans(graph, cluster):
                each = {s: [] for s in SETTINGS}
                for r in range(args.rounds):
                    for s in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:
                        out = Path(tmp) / f"{model}-{label}-{s}-{r}".replace(":", "_")
                        each[s].append(_run(plan, cluster, model, batch, seq, args.steps, out, s))
                med = {s: statistics.median(v) for s, v in each.items()}
                rows.append({"model": model, "plan": label, "each_s": each, "median_s": med,
                             "system_over_keep": med["system"] / med["keep"]})
                print(f"{model:>22} {label:<14} kept {med['keep'] * 1e3:7.1f} ms | glibc's defaults "
                      f"{med['system'] * 1e3:7.1f} ms | x{rows[-1]['system_over_keep']:.2f}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"rounds": args.rounds, "steps": args.steps, "cpus": os.cpu_count(),
                                       "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
