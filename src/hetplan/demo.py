"""`hetplan demo`: the whole flow on this machine, from profile to plan to simulation to a real run.

1. Profile gpt2-tiny on one CPU thread (the type of the `local` preset's workers).
2. Compare the planners on the `local` cluster (one single-threaded worker per core).
3. Run the best plan the runtime can execute, and the `uniform` and `data-parallel` baselines,
   for a few steps each on real worker processes.
4. Print predicted against measured step time and the chosen plan's measured speed-up, and
   write a report folder: report.html (`hetplan report`: the chosen plan on the graph, its step
   predicted above measured, the runs and the planners' tables), report.md, the chosen plan's
   Gantt chart, the graph, the cluster, the plans and the runs' folders.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.plan import prediction_error
from hetplan.planners import BASELINES, PlanOptions, make_plan
from hetplan.planners.compare import compare
from hetplan.report.page import write_page
from hetplan.report.sources import load_report
from hetplan.sim import simulate
from hetplan.units import fmt_seconds

MODEL, BATCH, SEQ = "gpt2-tiny", 8, 64


@dataclass(frozen=True)
class DemoRun:
    label: str
    planner: str
    stages: int
    devices: int
    microbatches: int
    predicted_step_s: float
    measured_step_s: float
    loss_last: float | None

    @property
    def error(self) -> float:
        return prediction_error(self.measured_step_s, self.predicted_step_s)


def run_demo(out_dir: Path, steps: int = 12, budget_s: float = 3.0,
             say: Callable[[str], None] = print, cluster_ref: str = "local") -> dict:
    """The flow above on `cluster_ref` (`local`, or its calibrated file: `make demo` calibrates
    first, so that the predictions it shows include this machine's runtime costs)."""
    from hetplan.profile import profile_step
    from hetplan.runtime.run import run_plan
    from hetplan.runtime.settings import RunSettings
    from hetplan.timeline.gantt import draw_gantt
    from hetplan.zoo import load_model

    out_dir.mkdir(parents=True, exist_ok=True)
    cluster = load_cluster(cluster_ref)
    say(f"1/4 profiling {MODEL} (batch {BATCH} x {SEQ}) on one CPU thread, the local workers' type")
    zoo_model = load_model(MODEL, batch_size=BATCH, seq_len=SEQ)
    graph = profile_step(zoo_model.step, zoo_model.batch, name=MODEL, devices=["cpu:1"]).graph
    serde.dump(graph, out_dir / "graph.json")
    serde.dump(cluster, out_dir / "cluster.json")
    say(f"2/4 comparing planners on {cluster.name} ({len(cluster.devices)} workers)")
    options = PlanOptions(budget_s=budget_s)
    comparison = compare(graph, cluster, [*BASELINES, "dp", "local-search"], options)

    # the optimising planners' best plan (every plan they return runs: hetplan.runtime.support)
    ranked = sorted((r for r in comparison.rows if r.plan is not None and math.isfinite(r.value)),
                    key=lambda r: (r.planner not in ("dp", "local-search"), r.value))
    chosen = next(iter(ranked), None)
    if chosen is None:
        raise HetplanError("no planner found a plan for this machine")
    baselines = [(name, make_plan(graph, cluster, name, PlanOptions(microbatches=4 if name == "uniform" else None)))
                 for name in ("uniform", "data-parallel")]

    def same(a, b) -> bool:
        return a.stages == b.stages and a.microbatches == b.microbatches and a.schedule == b.schedule

    twin = next((name for name, plan in baselines if same(plan, chosen.plan)), None)
    label = f"chosen: {chosen.planner}" + (f" (the same plan as {twin})" if twin else "")
    to_run = [(label, chosen.plan)] + [(name, plan) for name, plan in baselines if name != twin]
    runs = []
    for i, (label, plan) in enumerate(to_run):
        say(f"3/4 running {label} ({len(plan.stages)} stage(s), {len(plan.devices)} worker(s), "
            f"{plan.microbatches} micro-batches) for {steps} steps")
        serde.dump(plan, out_dir / f"plan-{i}.json")
        settings = RunSettings(steps=steps, warmup=min(3, steps - 1), batch_size=BATCH, seq_len=SEQ,
                               granularity="layer", data="text", out_dir=out_dir / f"run-{i}", trace=i == 0)
        report = run_plan(plan, cluster, MODEL, graph, settings)  # its prediction: the event simulation
        runs.append(DemoRun(label, plan.planner, len(plan.stages), len(plan.devices), plan.microbatches,
                            report.predicted.step_s, report.measured.step_s,
                            report.result.losses[-1] if report.result.losses else None))
    say("4/4 writing the report")
    sim = simulate(graph, cluster, chosen.plan)
    title = f"{MODEL} on {cluster.name}: {chosen.planner} plan, predicted step {fmt_seconds(sim.estimate.step_s)}"
    draw_gantt(sim.timeline, out_dir / "chosen-plan.png", title=title)
    best_baseline = min(r.measured_step_s for r in runs[1:])
    speedup = best_baseline / runs[0].measured_step_s
    summary = {"kind": "demo", "model": MODEL, "cluster": cluster.name, "chosen": chosen.planner,
               "calibrated": cluster.calibration is not None,
               "speedup_over_best_baseline": speedup,
               "runs": [{**r.__dict__, "error": r.error} for r in runs],
               "comparison": comparison.to_json()}
    (out_dir / "demo.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# hetplan demo: {MODEL} on `{cluster.name}`", "",
             f"Graph: {len(graph.nodes)} nodes profiled on {graph.profiled_on}; cluster: "
             f"{', '.join(f'{d.id} ({d.type})' for d in cluster.devices)}.", "",
             "## Planners (simulated)", "", "| planner | stages | micro-batches | predicted step | samples/s |",
             "|---|---|---|---|---|"]
    for r in comparison.rows:
        if r.plan is not None:
            lines.append(f"| {r.planner} | {len(r.plan.stages)} | {r.plan.microbatches} | "
                         f"{fmt_seconds(r.plan.predicted.step_s)} | {r.plan.predicted.samples_per_s:,.1f} |")
    lines += ["", "## Runs (measured)", "", "| plan | stages | workers | micro-batches | predicted step | "
              "measured step | error | last loss |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.label} | {r.stages} | {r.devices} | {r.microbatches} | {fmt_seconds(r.predicted_step_s)} "
                     f"| {fmt_seconds(r.measured_step_s)} | {r.error:+.0%} | "
                     f"{'-' if r.loss_last is None else format(r.loss_last, '.3f')} |")
    lines += ["", f"Measured speed-up of the chosen plan over the faster baseline it was not equal to: {speedup:.2f}x "
              "(this 2-vCPU machine's timings vary by 10-25% between runs; see BENCHMARKS.md).", "",
              "![the chosen plan's simulated step](chosen-plan.png)", ""]
    (out_dir / "report.md").write_text("\n".join(lines))
    write_page(load_report(out_dir), out_dir / "report.html")
    return summary
