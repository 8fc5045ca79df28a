"""Print the Markdown tables of BENCHMARKS.md from the JSON files in bench/results/.

    .venv/bin/python bench/tables.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).with_name("results")
BASELINES = ("single", "data-parallel", "uniform", "params", "balanced-time")


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


def dp_vs_exact() -> None:
    s = json.loads((RESULTS / "dp_vs_exact.json").read_text())["summary"]
    print(f"{s['problems']} problems ({s['chains']} chains, {s['problems'] - s['chains']} branchy DAGs), none "
          f"refused by exact ({s['refused_by_exact']}), none without a feasible plan ({s['no_feasible_plan']})")
    print()
    print("| | within 1% of exact | within 5% | equal to exact | worst gap | mean gap | planning time median (max) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| dp | {s['dp_within_1pct']:.1%} | {s['dp_within_5pct']:.1%} | {s['dp_exact_share']:.1%} "
          f"| {s['dp_gap_max']:.2%} | {s['dp_gap_mean']:.3%} | {s['dp_s_median'] * 1e3:.0f} ms "
          f"({s['dp_s_max'] * 1e3:.0f} ms) |")
    print(f"| best of the 5 baselines | {s['baseline_within_1pct']:.1%} | | | {s['baseline_gap_max']:.0%} "
          f"| median {s['baseline_gap_median']:.0%} | |")
    print(f"| exact (reference) | | | | | | {s['exact_s_median'] * 1e3:.0f} ms ({s['exact_s_max']:.1f} s) |")


def dp_scaling() -> None:
    rows = json.loads((RESULTS / "dp_scaling.json").read_text())["rows"]
    print("| graph | nodes | devices | cut states (kept) | device orders | dp planning time | stages | "
          "step | best baseline step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['graph']} | {r['nodes']} | {r['devices']} | {r['states']} ({r['states_used']}) "
              f"| {r['device_orders']} | {r['dp_s']:.2f} s | {r['stages']} | {r['step_s'] * 1e3:.1f} ms "
              f"| {r['best_baseline_step_s'] * 1e3:.1f} ms |")


def compare_table() -> None:
    data = json.loads((RESULTS / "compare.json").read_text())["comparisons"]
    print("| model | cluster | objective | best baseline | its value | dp | dp's gain | local-search | best |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in data:
        rows = {r["planner"]: r for r in c["rows"]}
        base = [r for n, r in rows.items() if n in BASELINES and r.get("objective_value") is not None]
        best_base = min(base, key=lambda r: r["objective_value"]) if base else None

        def show(r, c=c):
            if r is None or r.get("objective_value") is None:
                return "infeasible"
            if c["objective"] == "time":
                return f"{r['step_s'] * 1e3:.1f} ms ({r['samples_per_s']:,.0f}/s)"
            return f"${r['usd_per_1k_samples']:.4f}/1k ({r['samples_per_s']:,.0f}/s)"

        dp = rows.get("dp")
        gain = dp.get("gain_over_best_baseline") if dp else None
        objective = c["objective"] + (f" >= {c['floor_samples_per_s']:,.0f}/s" if c["objective"] == "cost" else "")
        print(f"| {c['model']} | {c['cluster']} | {objective} | {best_base['planner'] if best_base else '-'} "
              f"| {show(best_base)} | {show(dp)} | {'-' if gain is None else f'{gain:+.1%}'} "
              f"| {show(rows.get('local-search'))} | {c['best']} |")


def predicted_vs_measured(name: str = "predicted_vs_measured.json") -> None:
    data = json.loads((RESULTS / name).read_text())
    print("| model | plan | stages x replicas | m | predicted | measured | error |")
    print("|---|---|---|---|---|---|---|")
    for r in data["rows"]:
        print(f"| {r['model']} | {r['plan']} | {r['stages']} x {r['replicas']} | {r['microbatches']} "
              f"| {r['predicted_step_s'] * 1e3:.1f} ms | {r['measured_step_s'] * 1e3:.1f} ms | {r['error']:+.0%} |")
    s = data["summary"]
    print()
    print(f"{s['plans']} plans: median absolute error {s['median_abs_error']:.0%}, worst {s['max_abs_error']:.0%}")


def rl_planners() -> None:
    data = json.loads((RESULTS / "rl_planners.json").read_text())
    print(f"Budget {data['budget_s']:g} s per search planner.")
    print()
    print("| model | cluster | objective | planner | value | vs dp | plans scored (fast) | simulated | time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in data.get("rows", []):
        name = r["planner"] + (" --faithful" if r.get("faithful") else "")
        if "error" in r:
            print(f"| {r['model']} | {r['cluster']} | {r['objective']} | {name} | refused: {r['error'][:70]} "
                  f"| | | | {r['seconds']:.1f} s |")
            continue
        value = "-" if r["value"] is None else (f"{r['value'] * 1e3:.2f} ms" if r["objective"] == "time"
                                                 else f"${r['value'] * 1e6:.3f}/M samples")
        vs = "-" if r["vs_dp"] is None else f"{r['vs_dp']:+.1%}"
        fast = "-" if r.get("fast_evaluations") is None else f"{r['fast_evaluations']:,}"
        sims = "-" if r.get("event_simulations") is None else f"{r['event_simulations']:,}"
        print(f"| {r['model']} | {r['cluster']} | {r['objective']} | {name} | {value} | {vs} | {fast} | {sims} "
              f"| {r['seconds']:.1f} s |")
    if "ppo" in data:
        print()
        print(json.dumps(data["ppo"]))
    if "heterps" in data:
        print()
        print("| model | floor (samples/s) | cheapest one type ($/M samples) | heterps | vs one type "
              "| heterps --faithful | vs one type |")
        print("|---|---|---|---|---|---|---|")

        def usd(v):
            return "-" if v is None else f"{v * 1e6:.3f}"

        def pct(v):
            return "-" if v is None else f"{v:+.1%}"

        for r in data["heterps"]:
            print(f"| {r['model']} | {r['floor_samples_per_s']:.1f} | {usd(r['cheapest_one_type'])} "
                  f"| {usd(r['heterps'])} | {pct(r['heterps_vs_one_type'])} | {usd(r['heterps_faithful'])} "
                  f"| {pct(r['heterps_faithful_vs_one_type'])} |")


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
    print()
    dp_vs_exact()
    print()
    dp_scaling()
    print()
    compare_table()
    print()
    predicted_vs_measured()
    print()
    predicted_vs_measured("predicted_vs_measured_calibrated.json")
    print()
    rl_planners()
