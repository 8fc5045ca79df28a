"""Language models on 8 to 1,024 mixed GPUs with the memory and precision choices: where each one
changes dp's plan (devices used, step, price).

    .venv/bin/python bench/llm_choices.py [--only NAME ...] [-o bench/results/llm_choices.json]

The problems of bench/llm_plans.py and Llama-3-8B on 16 A100-40GB + 16 V100-16GB (transformer
chains counted from their shapes, a global batch of 1,024 sequences of 2,048 tokens, Adam, 1F1B,
whole hosts of one GPU type each), each planned by dp in these set-ups (`hetplan plan
--precision P --recompute R --shard S`):

- fp32 without choices (the plans-at-scale issue's table), with recomputation where needed, with
  optimizer-state sharding;
- fp16 mixed precision (the V100's and T4's tensor cores take fp16, not bf16) without choices,
  and with recomputation where needed and sharding;
- bf16 with both (a V100 or T4 runs bf16 products at its fp32 rate).

Each row: dp's step (event simulator), price per step, the GPUs it uses of each type, its stages'
widths, micro-batches, how many stages recompute and shard, and its fullest device's memory.
The graphs in 16 bits are counted as the fp32 ones (`hetplan.zoo.llm`), at 0.43 of the 16-bit
peak, the fraction measured on an H200 (BENCHMARKS.md); no V100 or T4 was measured.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from llm_plans import IB
from llm_plans import PROBLEMS as AT_SCALE
from results_file import write_results

from hetplan.errors import HetplanError
from hetplan.io.clusters import cluster_from_spec, hosts_spec
from hetplan.planners import PlanOptions, make_plan
from hetplan.zoo.llm import transformer_chain

HERE = Path(__file__).resolve().parent
# the plans-at-scale problems, and the memory issue's own: an 8B chain on 16 A100-40GB + 16 V100-16GB
PROBLEMS = {**AT_SCALE, "llama-3-8b/32": ("llama-3-8b", [("a100-40gb", 2, 8), ("v100-16gb", 2, 8)], IB)}
SETUPS = [  # (precision, recompute, shard)
    ("fp32", "never", "never"),
    ("fp32", "where-needed", "never"),
    ("fp32", "never", "replicated"),
    ("fp16", "never", "never"),
    ("fp16", "where-needed", "replicated"),
    ("bf16", "where-needed", "replicated"),
]


def plan_row(name: str, precision: str, recompute: str, shard: str) -> dict:
    model, groups, between = PROBLEMS[name]
    graph = transformer_chain(model, 1024, 2048, [t for t, _, _ in groups], precision)
    cluster = cluster_from_spec(hosts_spec(groups, inter_host=between, name=name.replace("/", "-")), name)
    row = {"problem": name, "gpus": len(cluster.devices), "precision": precision, "recompute": recompute,
           "shard": shard}
    start = time.perf_counter()
    try:
        plan = make_plan(graph, cluster, "dp", PlanOptions(recompute=recompute, shard=shard))
    except HetplanError as exc:
        return {**row, "step_s": None, "why": str(exc), "planning_s": time.perf_counter() - start}
    est = plan.predicted
    used: dict[str, int] = {}
    for d in plan.devices:
        used[cluster.device(d).type] = used.get(cluster.device(d).type, 0) + 1
    fullest = max(est.peak_mem_bytes[d] / cluster.device(d).mem_bytes for d in plan.devices)
    return {**row, "step_s": est.step_s, "usd_per_step": est.usd_per_step, "used": used,
            "widths": [len(s.devices) for s in plan.stages], "microbatches": plan.microbatches,
            "recomputing": sum(s.recompute for s in plan.stages), "sharded": sum(s.shard for s in plan.stages),
            "fullest_memory": fullest, "planning_s": time.perf_counter() - start}


def describe(r: dict) -> str:
    head = f"{r['problem']:>16} {r['precision']} recompute {r['recompute']:<12} shard {r['shard']:<10}"
    if r["step_s"] is None:
        return f"{head} no plan: {r['why']}"
    used = ", ".join(f"{n} {t}" for t, n in sorted(r["used"].items()))
    return (f"{head} {r['step_s']:8.2f} s ${r['usd_per_step']:.3f} | {used} | widths {r['widths']} "
            f"m={r['microbatches']} | recompute {r['recomputing']} shard {r['sharded']} "
            f"| fullest {r['fullest_memory']:.0%} "
            f"| planned in {r['planning_s']:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", action="append", choices=list(PROBLEMS))
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "llm_choices.json")
    args = parser.parse_args()
    rows = []
    for name in args.only or PROBLEMS:
        for setup in SETUPS:
            rows.append(plan_row(name, *setup))
            print(describe(rows[-1]), flush=True)
    write_results(args.output, {"problems": len(args.only or PROBLEMS), "setups": len(SETUPS)}, rows)


if __name__ == "__main__":
    main()
