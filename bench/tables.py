"""Print the Markdown tables of BENCHMARKS.md from the JSON files in bench/results/.

    .venv/bin/python bench/tables.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).with_name("results")


def faithfulness() -> None:
    data = json.loads((RESULTS / "profile_faithfulness.json").read_text())
    print("| model | batch | granularity | nodes | sum of nodes (median) | whole step: median (fastest-slowest) "
          "| ratio, fastest | ratio, medians | profiling (wall) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in data["rows"]:
        shape = f"{r['batch']}x{r['seq_len']}" if r["seq_len"] else str(r["batch"])
        lo, hi = r["whole_step_range_s"]
        print(f"| {r['model']} | {shape} | {r['granularity']} | {r['nodes']} | {r['sum_nodes_s']:.2f} s "
              f"| {r['whole_step_s']:.2f} s ({lo:.2f}-{hi:.2f}) | {r['ratio']:.3f} | {r['ratio_median']:.3f} "
              f"| {r['wall_s']:.0f} s |")
    print()
    print("gpt2 batch 8 x 128, plain profile (no --check), wall seconds:",
          ", ".join(f"{t:.1f}" for t in data["gpt2_b8_s128_profile_wall_s"]))


def calibrated() -> None:
    """The --calibrate experiment (made when calibration was the default, commit e1017cc)."""
    rows = [json.loads(line) for line in (RESULTS / "profile_faithfulness_calibrated.jsonl").read_text().splitlines()]
    print("| model | granularity | ratio of medians, isolated | ratio of medians, calibrated |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['granularity']} | {r['ratio_isolated']:.3f} | {r['ratio_median']:.3f} |")


def projection() -> None:
    data = json.loads((RESULTS / "projection_error.json").read_text())
    print("| model | batch | nodes | sum on 1 thread | 2 threads measured | 2 threads projected | error of the sum "
          "| node error (median) | node error (time-weighted) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in data["rows"]:
        shape = f"{r['batch_size']}x{r['seq_len']}" if r.get("seq_len") else str(r["batch_size"])
        print(f"| {r['model']} | {shape} | {r['nodes']} | {r['sum_1t_s']:.2f} s | {r['sum_2t_measured_s']:.2f} s "
              f"(speed-up {r['measured_speedup_2t']:.2f}x) | {r['sum_2t_projected_s']:.2f} s | "
              f"{r['total_rel_error']:+.0%} | {r['node_median_abs_rel_error']:.0%} | "
              f"{r['node_time_weighted_abs_rel_error']:.0%} |")


def sim_speed() -> None:
    data = json.loads((RESULTS / "sim_speed.json").read_text())
    print("| stages | micro-batches | event simulator | event, with timeline | fast path, arrays (batches of 1024) "
          "| fast path, Plan objects |")
    print("|---|---|---|---|---|---|")
    for r in data["rows"]:
        print(f"| {r['stages']} | {r['microbatches']} | {r['event_per_s']:,.0f}/s | {r['event_timeline_per_s']:,.0f}/s "
              f"| {r['fast_arrays_per_s']:,.0f}/s | {r['fast_plans_per_s']:,.0f}/s |")


def fast_vs_event() -> None:
    data = json.loads((RESULTS / "fast_vs_event.json").read_text())
    print("| model | cluster | plans (with replicas) | Spearman | exact | rel. error median | p90 | worst |")
    print("|---|---|---|---|---|---|---|---|")
    for r in data["rows"]:
        print(f"| {r['model']} | {r['cluster']} | {r['plans']} ({r['replicated_plans']}) | {r['spearman']:.4f} "
              f"| {r['exact_share']:.0%} | {r['rel_err_median']:.2%} | {r['rel_err_p90']:.2%} "
              f"| {r['rel_err_max']:.1%} |")


if __name__ == "__main__":
    faithfulness()
    print()
    calibrated()
    print()
    projection()
    print()
    sim_speed()
    print()
    fast_vs_event()
