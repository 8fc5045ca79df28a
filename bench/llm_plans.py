"""Language models on 8 to 1,024 mixed GPUs: dp against the baselines and against local search
from several starts, every plan scored by the event simulator.

    .venv/bin/python bench/llm_plans.py [--search-s 600] [--only NAME] [-o bench/results/llm_plans.json]

Problems: transformer chains counted from their shapes (`hetplan.zoo.llm`: OPT-350M, OPT-1.3B,
Llama-3-8B; fp32, Adam, 1F1B) at a global batch of 1,024 sequences of 2,048 tokens, on clusters
of whole hosts of 4 or 8 GPUs of one type each (A100-40GB, V100-16GB, T4, H100), 100 GB/s
inside a host and 1.7 GB/s or 100 Gbit/s between hosts (`hetplan.io.clusters.hosts_spec`).

For each problem:
- dp (`make_plan(..., "dp")`) in a process of its own: planning time and peak memory (ru_maxrss);
- the baselines (single, data-parallel, uniform, params, balanced-time), with their default
  micro-batches and with dp's;
- local search (`hetplan.planners.search.local_search`) from several starts, `--search-s` in all
  (split evenly): dp's plan; the best of the type-contiguous grid (every split of the layers into
  1-8 stages, each stage one device type's hosts split evenly among the type's stages, layers
  in proportion to the stages' speed, the three most micro-batch counts its widest stage allows);
  and one stage per type (all data-parallel per type).
The row says whether any of them beat dp by more than 1%.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import dp_scale
from results_file import write_results

from hetplan.errors import HetplanError
from hetplan.io import serde
from hetplan.io.clusters import cluster_from_spec, hosts_spec
from hetplan.plan import Plan, Stage, plan_problems
from hetplan.planners import BASELINES, PlanOptions, make_plan
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.scoring import Scorer
from hetplan.planners.search import local_search
from hetplan.zoo.llm import transformer_chain

HERE = Path(__file__).resolve().parent
IB = "12.5GB/s"  # 100 Gbit/s
GRID_COUNTS = 3  # the grid's plans try the most micro-batches their widest stage allows, and the two counts below
PROBLEMS = {  # name: (model, [(type, hosts, per host)], between hosts)
    "opt-350m/8": ("opt-350m", [("a100-40gb", 1, 4), ("v100-16gb", 1, 4)], "1.7GB/s"),
    "opt-350m/32": ("opt-350m", [("a100-40gb", 2, 8), ("v100-16gb", 2, 8)], "1.7GB/s"),
    "opt-350m/128": ("opt-350m", [("a100-40gb", 4, 8), ("v100-16gb", 12, 8)], "1.7GB/s"),
    "opt-1.3b/32": ("opt-1.3b", [("a100-40gb", 1, 8), ("v100-16gb", 1, 8), ("t4-16gb", 2, 8)], IB),
    "opt-1.3b/128": ("opt-1.3b", [("a100-40gb", 4, 8), ("v100-16gb", 8, 8), ("t4-16gb", 4, 8)], IB),
    "llama-3-8b/128": ("llama-3-8b", [("h100-80gb", 8, 8), ("a100-40gb", 8, 8)], IB),
    "llama-3-8b/1024": ("llama-3-8b", [("h100-80gb", 32, 8), ("a100-40gb", 48, 8), ("v100-16gb", 48, 8)], IB),
}
def problem(name: str):
    model, groups, between = PROBLEMS[name]
    graph = transformer_chain(model, 1024, 2048, [t for t, _, _ in groups])
    return graph, cluster_from_spec(hosts_spec(groups, inter_host=between, name=name.replace("/", "-")), name)


def run_dp(graph, cluster, tmp: Path) -> dict:
    """dp in a process of its own (`bench/dp_scale.py`'s): seconds, peak memory, plan."""
    graph_file = tmp / "graph.json"
    serde.dump(graph, graph_file)
    return dp_scale.run_dp(graph_file, cluster, tmp)


def grid_plans(graph, cluster, scorer: Scorer) -> list[Plan]:
    """Type-contiguous pipelines of 1-8 stages (types fastest first), each type's hosts split
    evenly among its stages, layers in proportion to the stages' speed, at the best of the
    GRID_COUNTS most micro-batches whose rows its widest stage can share; the feasible ones,
    best first."""
    types = sorted({d.type for d in cluster.devices}, key=lambda t: graph.fwd_s_total(t))
    devices = {t: [d.id for d in cluster.devices if d.type == t] for t in types}
    order = graph.topo_order
    weight = [graph.by_id[n].fwd_s[types[0]] + graph.by_id[n].bwd_s[types[0]] for n in order]
    found = []
    for depth in range(1, 9):
        for counts in itertools.product(range(depth + 1), repeat=len(types)):
            if sum(counts) != depth:
                continue
            groups = []
            for t, k in zip(types, counts, strict=True):
                if k and len(devices[t]) >= k:
                    size = len(devices[t]) // k
                    groups += [(t, devices[t][i * size:(i + 1) * size]) for i in range(k)]
            if len(groups) != depth or depth > len(order):
                continue
            speed = [len(g) / (graph.fwd_s_total(t) + graph.bwd_s_total(t)) for t, g in groups]
            # block_partition balances weights: scale each stage's by its group's speed, by sizes
            sizes = _speed_split(weight, speed)
            stages, start = [], 0
            for (_, g), size in zip(groups, sizes, strict=True):
                stages.append(Stage(order[start:start + size], tuple(g)))
                start += size
            widest = max(len(g) for _, g in groups)  # every replica a row of every micro-batch: m <= B / widest
            counts = [m for m in microbatch_choices(graph, PlanOptions()) if graph.batch_size // m >= widest]
            plans = [Plan(tuple(stages), m, "1f1b", "grid") for m in counts[-GRID_COUNTS:]]
            plans = [p for p in plans if not plan_problems(p, graph, cluster)]
            scored = [(scorer.value(p), i, p) for i, p in enumerate(plans)]
            found += [x for x in scored if math.isfinite(x[0])]
    found.sort(key=lambda x: (x[0], x[1]))
    return [p for _, _, p in found]


def _speed_split(weight: list[float], speed: list[float]) -> list[int]:
    """Consecutive sizes giving each stage a share of the work in proportion to its speed."""
    total, share = sum(weight), sum(speed)
    sizes, acc, start = [], 0.0, 0
    for k, s in enumerate(speed):
        acc += s / share * total
        end = start + 1
        while end < len(weight) - (len(speed) - k - 1) and sum(weight[:end + 1]) <= acc + 1e-12:
            end += 1
        if k == len(speed) - 1:
            end = len(weight)
        sizes.append(end - start)
        start = end
    return sizes


def one_problem(name: str, search_s: float, tmp: Path) -> dict:
    graph, cluster = problem(name)
    scorer = Scorer(graph, cluster, PlanOptions())
    dp = run_dp(graph, cluster, tmp)
    dp_plan, dp_step = dp["plan"], dp["plan"].predicted.step_s
    row = {"problem": name, "devices": len(cluster.devices), "dp_step_s": dp_step, "dp_planning_s": dp["seconds"],
           "dp_peak_rss_mib": dp["peak_rss_mib"], "dp_devices_used": len(dp_plan.devices),
           "dp_stages": [len(s.devices) for s in dp_plan.stages], "dp_microbatches": dp_plan.microbatches}
    baselines = {}
    for b in (x for x in BASELINES if x != "dp"):
        for m in (None, dp_plan.microbatches):
            try:
                plan = make_plan(graph, cluster, b, PlanOptions(microbatches=m))
            except HetplanError:
                continue
            if plan.predicted.feasible:
                key = f"{b}@m={plan.microbatches}"
                baselines[key] = plan.predicted.step_s
    row["baselines"] = baselines
    row["best_baseline_s"] = min(baselines.values(), default=None)
    began = time.perf_counter()
    grid = grid_plans(graph, cluster, scorer)
    per_type = [p for p in grid if len(p.stages) == len({cluster.device(s.devices[0]).type for s in p.stages})]
    row["grid_best_s"] = scorer.value(grid[0]) if grid else None
    row["grid_s"] = time.perf_counter() - began
    starts = {"dp": dp_plan, "grid": grid[0] if grid else None, "per-type": per_type[0] if per_type else None}
    starts = {k: v for k, v in starts.items() if v is not None}
    search = {}
    for k, start in starts.items():
        plan = local_search(graph, cluster, PlanOptions(budget_s=search_s / len(starts)), start=replace(
            start, planner="local-search"))
        search[k] = scorer.value(plan)
    row["search_s"] = search_s
    row["search_from"] = search
    best_other = min([*search.values(), *(baselines.values()), row["grid_best_s"] or math.inf])
    row["best_other_s"] = best_other
    row["dp_over_best_other"] = dp_step / best_other
    row["dp_beaten_by_over_1pct"] = dp_step > best_other * 1.01
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--search-s", type=float, default=600.0, help="local search's budget per problem")
    parser.add_argument("--only", action="append", help="problem names (default: all)")
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "llm_plans.json")
    args = parser.parse_args()
    names = args.only or list(PROBLEMS)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [one_problem(name, args.search_s, Path(tmp)) for name in names]
    summary = {"problems": len(rows), "dp_beaten_by_over_1pct": sum(r["dp_beaten_by_over_1pct"] for r in rows),
               "worst_dp_over_best_other": max(r["dp_over_best_other"] for r in rows),
               "search_s": args.search_s, "machine": f"{os.cpu_count()} cores"}
    write_results(args.output, summary, rows)


if __name__ == "__main__":
    main()
