"""Every planner's plans run, and train as single-process training does.

For 20 random small problems (a model of the zoo, 2 to 4 local CPU workers of 1 or 2 threads
with `binding: cpu`, a schedule), every planner (single, data-parallel, uniform, params,
balanced-time, dp, local-search, reinforce, ppo, heterps) makes a plan, and the plan runs 3 SGD
steps under `hetplan run`'s launcher (worker processes over gloo; `--threads` runs the ranks as
threads instead, faster). The weights after the 3 steps are compared with single-process
training on the same batches. A plan that two planners return runs once.

    .venv/bin/python bench/every_plan_runs.py [--problems 20] [--threads] [--out out/bench/every-plan]

Writes RESULTS.md and results.json under --out; the table goes into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hetplan.errors import HetplanError  # noqa: E402
from hetplan.io import serde  # noqa: E402
from hetplan.io.clusters import cluster_from_spec  # noqa: E402
from hetplan.pieces.split import split_step  # noqa: E402
from hetplan.planners import PlanOptions, make_plan  # noqa: E402
from hetplan.profile import profile_step  # noqa: E402
from hetplan.runtime.launch import launch, run_spec  # noqa: E402
from hetplan.runtime.local import run_threads  # noqa: E402
from hetplan.runtime.settings import RunSettings
from hetplan.runtime.spec import RunSpec  # noqa: E402
from hetplan.runtime.stages import stage_modules  # noqa: E402
from hetplan.runtime.worker import _batches  # noqa: E402
from hetplan.zoo import load_model  # noqa: E402

PLANNERS = ("single", "data-parallel", "uniform", "params", "balanced-time", "dp", "local-search", "reinforce", "ppo",
            "heterps")
MODELS = {"mlp": (16, None), "gpt2-tiny": (8, 16), "llama-tiny": (8, 16)}  # batch, sequence length
STEPS, LR = 3, 0.05


def graph_for(name: str, out: Path):
    path = out / f"{name}.json"
    if path.exists():
        return serde.load(path, expect="graph")
    batch, seq = MODELS[name]
    zm = load_model(name, batch_size=batch, seq_len=seq)
    graph = profile_step(zm.step, zm.batch, name=name, devices=["cpu:1", "cpu:2"], repeats=2).graph
    serde.dump(graph, path)
    return graph


def problem(i: int):
    rng = np.random.default_rng(i)
    name = list(MODELS)[i % len(MODELS)]
    workers = int(rng.integers(2, 5))
    devices = [{"id": f"c{k}", "type": "cpu", "threads": int(rng.integers(1, 3)), "binding": "cpu",
                "host": "localhost"} for k in range(workers)]
    cluster = cluster_from_spec({"name": f"problem{i}", "devices": devices}, f"problem{i}")
    return name, cluster, str(rng.choice(["gpipe", "1f1b"]))


def options(planner: str, i: int, schedule: str) -> PlanOptions:
    if planner in ("reinforce", "ppo", "heterps"):
        return PlanOptions(seed=i, schedule=schedule, max_iters=20)
    if planner == "local-search":
        return PlanOptions(seed=i, schedule=schedule, budget_s=2.0)
    return PlanOptions(seed=i, schedule=schedule)


def reference(name: str, spec: RunSpec) -> dict[str, torch.Tensor]:
    """Single-process SGD on the same batches; parameters by id."""
    batch, seq = MODELS[name]
    zm = load_model(name, batch_size=batch, seq_len=seq, seed=spec.settings.seed)
    for mod in zm.step.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    opt = torch.optim.SGD(zm.step.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        zm.step(**_batches(spec, zm, step)).backward()
        opt.step()
    return zm


def check_run(name: str, plan, cluster, graph, out: Path, threads: bool) -> dict:
    batch, seq = MODELS[name]
    spec = run_spec(plan, cluster, name, RunSettings(batch_size=batch, seq_len=seq, granularity="layer", steps=STEPS,
                    warmup=0, optimizer="sgd", lr=LR, out_dir=out, no_dropout=True, return_weights=True,
                    timeout_s=120), graph=graph)
    t0 = time.perf_counter()
    if threads:
        weights = [r["weights"] for r in run_threads(spec)]
    else:
        launch(spec)
        weights = [torch.load(out / f"weights.{rank}.pt") for rank in range(spec.world)]
    wall = time.perf_counter() - t0
    zm = reference(name, spec)
    split = split_step(zm.step, {k: v[:1] for k, v in zm.batch.items()})
    modules = stage_modules(split, plan)
    worst = 0.0
    for rank, me in enumerate(spec.ranks):
        for pname, p in modules[me.stage].named_parameters():
            worst = max(worst, (weights[rank][pname] - p.detach()).abs().max().item())
    return {"max_weight_diff": worst, "wall_s": wall, "ok": worst <= 1e-4}


def describe(plan) -> str:
    return " | ".join("+".join(s.devices) for s in plan.stages) + f", m={plan.microbatches}, {plan.schedule}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--threads", action="store_true", help="run ranks as threads (LocalHub) instead of processes")
    ap.add_argument("--out", type=Path, default=Path("out/bench/every-plan"))
    ap.add_argument("--table", type=Path, help="only print the table of an earlier results.json")
    args = ap.parse_args(argv)
    if args.table:
        return write_table(json.loads(args.table.read_text()), args.table.parent)
    args.out.mkdir(parents=True, exist_ok=True)
    rows, seen = [], {}
    for i in range(args.problems):
        name, cluster, schedule = problem(i)
        graph = graph_for(name, args.out)
        for planner in PLANNERS:
            row = {"problem": i, "model": name, "workers": [d.threads for d in cluster.devices], "planner": planner}
            try:
                plan = make_plan(graph, cluster, planner, options(planner, i, schedule))
            except HetplanError as exc:
                rows.append({**row, "status": "no plan", "why": str(exc)})
                print(f"[{i}] {planner}: no plan: {exc}", flush=True)
                continue
            key = (i, plan.stages, plan.microbatches, plan.schedule)
            row.update(plan=describe(plan), replicas=[len(s.devices) for s in plan.stages],
                       stages_without_params=sum(1 for s in plan.stages
                                                 if sum(graph.by_id[n].param_bytes for n in s.nodes) == 0))
            if key in seen:
                rows.append({**row, **{k: v for k, v in seen[key].items() if k != "planner"},
                             "same_as": seen[key]["planner"]})
                continue
            try:
                result = check_run(name, plan, cluster, graph, args.out / f"run-{i}-{planner}", args.threads)
                result["status"] = "ok" if result["ok"] else "wrong weights"
            except Exception as exc:  # noqa: BLE001 - every failure is a row of the table
                result = {"status": "failed", "why": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                          "trace": traceback.format_exc()[-2000:]}
            seen[key] = {**result, "planner": planner}
            rows.append({**row, **result})
            print(f"[{i}] {name} {row['workers']} {planner}: {row['plan']}: {result['status']} "
                  f"{result.get('max_weight_diff', '')} {result.get('why', '')}", flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    return write_table(rows, args.out)


def write_table(rows: list[dict], out: Path) -> int:
    lines = ["| planner | plans | ran, weights match | failed | wrong weights | no plan | uneven replicas | "
             "stages without parameters | max weight diff |", "|---|---|---|---|---|---|---|---|---|"]
    for planner in PLANNERS:
        mine = [r for r in rows if r["planner"] == planner]
        planned = [r for r in mine if r["status"] != "no plan"]
        uneven = sum(1 for r in planned if len(set(r.get("replicas", [1]))) > 1)
        diffs = [r["max_weight_diff"] for r in planned if "max_weight_diff" in r]
        worst = f"{max(diffs):.1e}" if diffs else "-"
        lines.append(f"| {planner} | {len(planned)} | {sum(r['status'] == 'ok' for r in planned)} | "
                     f"{sum(r['status'] == 'failed' for r in planned)} | "
                     f"{sum(r['status'] == 'wrong weights' for r in planned)} | {len(mine) - len(planned)} | "
                     f"{uneven} | "
                     f"{sum(r.get('stages_without_params', 0) > 0 for r in planned)} | {worst} |")
    bad = [r for r in rows if r["status"] in ("failed", "wrong weights", "no plan")]
    lines += ["", "Not run or not equal:"] + [f"- problem {r['problem']} ({r['model']}, workers {r['workers']}), "
                                              f"{r['planner']}: {r['status']}: {r.get('why', r.get('max_weight_diff'))}"
                                              for r in bad]
    runs = len({(r["problem"], r.get("plan")) for r in rows if "plan" in r})
    lines += ["", f"{len(rows)} plans from {len(PLANNERS)} planners on {len({r['problem'] for r in rows})} problems; "
              f"{runs} distinct plans run (a plan that several planners return runs once)."]
    (out / "RESULTS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if not any(r["status"] in ("failed", "wrong weights") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
