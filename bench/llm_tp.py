"""Language models on mixed GPUs with tensor parallelism allowed: dp with --max-tp 1 against
--max-tp 8 on the problems of bench/llm_plans.py, every plan scored by the event simulator.

    .venv/bin/python bench/llm_tp.py [--only NAME ...] [--max-tp 8] [-o bench/results/llm_tp.json]

Per problem: the step and planning time of each, how many groupings of the devices dp planned
on (`hetplan.planners.tensor_groups`), and which stages of the plan are tensor-parallel (their
device type, degree and replicas). Planning runs in this process, one problem after another.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from llm_plans import PROBLEMS, problem
from results_file import write_results

from hetplan.planners import PlanOptions, make_plan

HERE = Path(__file__).resolve().parent


def _plan(graph, cluster, max_tp: int) -> dict:
    start = time.perf_counter()
    plan = make_plan(graph, cluster, "dp", PlanOptions(max_tp=max_tp))
    seconds = time.perf_counter() - start
    stages = [{"stage": k, "type": cluster.device(s.devices[0]).type, "tp": s.tp, "replicas": len(s.devices),
               "layers": len(s.nodes)} for k, s in enumerate(plan.stages)]
    return {"step_s": plan.predicted.step_s, "planning_s": seconds, "microbatches": plan.microbatches,
            "feasible": plan.predicted.feasible, "groupings": plan.meta.get("tp_groupings", 0), "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", choices=list(PROBLEMS))
    parser.add_argument("--max-tp", type=int, default=8)
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "llm_tp.json")
    args = parser.parse_args()
    rows = []
    for name in args.only or [n for n in PROBLEMS if n != "llama-3-8b/1024"]:
        graph, cluster = problem(name)
        flat, tp = _plan(graph, cluster, 1), _plan(graph, cluster, args.max_tp)
        rows.append({"problem": name, "without": flat, "with": tp, "speedup": flat["step_s"] / tp["step_s"]})
        chosen = ", ".join(f"stage {s['stage']} {s['type']} tp{s['tp']} x{s['replicas']}" for s in tp["stages"]
                           if s["tp"] > 1) or "none"
        print(f"{name:>16}: {flat['step_s']:7.2f} s ({flat['planning_s']:5.1f} s planning) -> "
              f"{tp['step_s']:7.2f} s ({tp['planning_s']:6.1f} s, {tp['groupings']} groupings); TP: {chosen}",
              flush=True)
    write_results(args.output, {r["problem"]: round(r["speedup"], 3) for r in rows}, rows, cpus=os.cpu_count(),
                  max_tp=args.max_tp)


if __name__ == "__main__":
    main()
