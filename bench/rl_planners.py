"""The RL planners (reinforce, ppo, heterps) against dp, local-search and, where it runs, exact.

    .venv/bin/python bench/rl_planners.py [--budget-s 10] [--parts table,ppo,heterps]
        [-o bench/results/rl_planners.json]

- table: gpt2, resnet50, gnmt and inception-tiny on v100x4, hetero-4 and cloud-mix. reinforce and
  ppo under the time objective, heterps under the cost objective (floor: half the throughput of
  the fastest baseline), each warm (default) and cold (`faithful`) with the same budget; dp and
  local-search (same budget) under the same objective; exact where it does not refuse. Values
  are the event simulator's (step time, or price per sample for cost); planning time and the
  number of plans scored (fast path) and simulated (event simulator).
- ppo: `ppo --faithful` on gpt2 / hetero-4 with 2 minutes: the time at which its best plan is
  within 5% of dp's; and 1,000 PPO iterations, timed (`--max-iters 1000`).
- heterps: on cloud-mix with a throughput floor, heterps's price per sample against the cheapest
  configuration that puts every layer on one device type (provisioned the same way) and meets the
  same floor.

gpt2 is the block-granularity profile cached in bench/results (CPU times projected to GPUs);
inception-tiny is profiled here on the CPU (`hetplan profile inception-tiny --granularity block`)
and cached too; resnet50 and gnmt are the shared PipeDream profiles.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.io.pipedream import import_pipedream
from hetplan.planners import PlanOptions, best_baseline, make_plan
from hetplan.planners.rl import all_one_type
from hetplan.planners.scoring import Scorer

SHARED = Path(os.environ.get("HETPLAN_SHARED", Path(__file__).resolve().parents[2] / "shared"))
RESULTS = Path(__file__).with_name("results")
CLUSTERS = ("v100x4", "hetero-4", "cloud-mix")


def cached_profile(name: str, args: list[str]):
    path = RESULTS / name
    if not path.exists():
        subprocess.run([str(Path(sys.executable).with_name("hetplan")), "profile", *args, "-o", str(path)], check=True)
    return serde.load(path)


def graphs():
    profiles = SHARED / "data" / "pipedream-profiles"
    return {
        "gpt2": cached_profile("gpt2-b8-s128-block.json", ["gpt2", "--batch-size", "8", "--seq-len", "128",
                                                           "--granularity", "block", "--device", "cpu"]),
        "resnet50": import_pipedream(profiles / "resnet50" / "graph.txt"),
        "gnmt": import_pipedream(profiles / "gnmt" / "graph.txt", batch_size=64),
        "inception-tiny": cached_profile("inception-tiny-b16-block.json", ["inception-tiny", "--batch-size", "16",
                                                                           "--granularity", "block", "--device",
                                                                           "cpu"]),
    }


def run(graph, cluster, planner, options):
    began = time.perf_counter()
    try:
        plan = make_plan(graph, cluster, planner, options)
    except HetplanError as exc:
        return {"planner": planner, "faithful": options.faithful, "error": str(exc),
                "seconds": time.perf_counter() - began}
    value = Scorer(graph, cluster, options).value(plan)
    meta = plan.meta.get(planner, {}) if plan.meta else {}
    local = plan.meta.get("local_search", {}) if plan.meta else {}
    return {"planner": planner, "faithful": options.faithful, "value": value if math.isfinite(value) else None,
            "step_s": plan.predicted.step_s, "usd_per_sample": plan.predicted.usd_per_step / graph.batch_size,
            "stages": len(plan.stages), "devices": len(plan.devices), "microbatches": plan.microbatches,
            "seconds": time.perf_counter() - began, "iterations": meta.get("iterations", local.get("iterations")),
            "fast_evaluations": meta.get("fast_evaluations"),
            "event_simulations": meta.get("event_simulations", local.get("simulations")),
            "returned": meta.get("returned")}


def table(budget_s: float) -> list[dict]:
    rows = []
    for model, graph in graphs().items():
        for cname in CLUSTERS:
            cluster = load_cluster(cname)
            base = best_baseline(graph, cluster)
            floor = base.predicted.samples_per_s / 2 if base is not None else None
            for objective, rl in (("time", ("reinforce", "ppo")), ("cost", ("heterps",))):
                options = PlanOptions(objective=objective, budget_s=budget_s,
                                      min_samples_per_s=floor if objective == "cost" else None)
                results = [run(graph, cluster, "dp", options), run(graph, cluster, "local-search", options)]
                for name in rl:
                    results.append(run(graph, cluster, name, options))
                    results.append(run(graph, cluster, name, replace(options, faithful=True)))
                results.append(run(graph, cluster, "exact", options))
                dp_v = results[0].get("value")
                for r in results:
                    r.update(model=model, cluster=cname, objective=objective, floor_samples_per_s=floor,
                             vs_dp=(r["value"] / dp_v - 1) if r.get("value") and dp_v else None)
                    rows.append(r)
                    tag = r["planner"] + (" --faithful" if r.get("faithful") else "")
                    gap = "-" if r["vs_dp"] is None else format(r["vs_dp"], "+.1%")
                    shown = "error: " + r["error"][:60] if "error" in r else f"{r['value']:.4g} ({gap} vs dp)"
                    print(f"{model:>14} {cname:<9} {objective:<4} {tag:<22} {shown}  {r['seconds']:.1f} s",
                          flush=True)
    return rows


def ppo_target() -> dict:
    graph = graphs()["gpt2"]
    cluster = load_cluster("hetero-4")
    options = PlanOptions()
    dp_v = Scorer(graph, cluster, options).value(make_plan(graph, cluster, "dp", options))
    began = time.perf_counter()
    plan = make_plan(graph, cluster, "ppo", PlanOptions(faithful=True, budget_s=120.0))
    wall = time.perf_counter() - began
    curve = plan.meta["ppo"]["curve"]
    within = next((row for row in curve if row[4] is not None and row[4] <= 1.05 * dp_v), None)
    final_v = Scorer(graph, cluster, options).value(plan)
    began = time.perf_counter()
    thousand = make_plan(graph, cluster, "ppo", PlanOptions(faithful=True, max_iters=1000))
    t1000 = time.perf_counter() - began
    out = {"dp_step_s": dp_v, "ppo_faithful_step_s": final_v, "gap": final_v / dp_v - 1, "wall_s": wall,
           "iterations": plan.meta["ppo"]["iterations"],
           "within_5pct_at_s": within[2] if within else None, "within_5pct_at_iteration": within[0] if within else None,
           "ppo_1000_iterations_s": t1000, "ppo_1000_step_s": Scorer(graph, cluster, options).value(thousand),
           "ppo_1000_gap": Scorer(graph, cluster, options).value(thousand) / dp_v - 1}
    print(json.dumps(out), flush=True)
    return out


def heterps_floor(budget_s: float) -> list[dict]:
    cluster = load_cluster("cloud-mix")
    out = []
    for model, graph in graphs().items():
        base = best_baseline(graph, cluster)
        if base is None:
            continue
        for share in (0.25, 0.5):
            floor = base.predicted.samples_per_s * share
            options = PlanOptions(objective="cost", min_samples_per_s=floor, budget_s=budget_s)
            scorer = Scorer(graph, cluster, options)
            singles = {}
            for t in sorted({d.type for d in cluster.devices}):
                plan = all_one_type(graph, cluster, options, t)
                v = scorer.value(plan) if plan is not None else math.inf
                singles[t] = v if math.isfinite(v) else None
            cheapest = min((v for v in singles.values() if v is not None), default=None)
            row = {"model": model, "floor_samples_per_s": floor, "floor_share_of_best_baseline": share,
                   "one_type_usd_per_sample": singles, "cheapest_one_type": cheapest}
            for faithful in (False, True):
                r = run(graph, cluster, "heterps", replace(options, faithful=faithful))
                key = "heterps_faithful" if faithful else "heterps"
                row[key] = r.get("value")
                row[key + "_vs_one_type"] = (r["value"] / cheapest - 1) if r.get("value") and cheapest else None
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=10.0)
    parser.add_argument("--parts", default="table,ppo,heterps")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS / "rl_planners.json")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    body = json.loads(args.output.read_text()) if args.output.exists() else {}
    body["machine"] = f"{os.cpu_count()} vCPU, {sys.platform}"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    body["budget_s"] = args.budget_s
    for part, fn in (("ppo", ppo_target), ("heterps", lambda: heterps_floor(args.budget_s)),
                     ("rows", lambda: table(args.budget_s))):
        if part.replace("rows", "table") in parts:
            body[part] = fn()
            args.output.write_text(json.dumps(body, indent=1) + "\n")  # after each part: a long run keeps what it did
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
