"""The commands that run: `run` (a plan on workers, measured against predicted; `--dry-run`
writes RUN.json and prints torchrun commands), `calibrate` and `demo`."""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from hetplan.cli._shared import _console, _emit_json, _note_estimates, _progress_bar
from hetplan.errors import HetplanError
from hetplan.io import serde
from hetplan.io.clusters import load_cluster, presets
from hetplan.io.graphs import load_graph
from hetplan.report import tables
from hetplan.report.summary import CLUSTER_REF
from hetplan.units import fmt_seconds

if TYPE_CHECKING:
    from hetplan.runtime.spec import RunSpec


def plan_cluster_ref(plan) -> str:
    """The cluster a plan was made on: the file `hetplan plan` recorded (`meta.cluster_ref`), or
    the cluster's name (a preset)."""
    recorded = plan.meta.get(CLUSTER_REF) if plan.meta else None
    if isinstance(recorded, str) and recorded:
        if Path(recorded).is_file() or recorded in presets():
            return recorded
        raise HetplanError(f"the plan was made on {recorded}, which is not there now; pass --cluster C")
    if not plan.cluster:
        raise HetplanError("the plan does not name its cluster; pass --cluster C")
    return plan.cluster


def cmd_run(args: argparse.Namespace) -> int:
    from hetplan.runtime.run import faithful_warnings, prepare_run
    from hetplan.runtime.settings import RunSettings

    plan = serde.load(args.plan, expect="plan")
    if args.precision and args.precision != plan.precision:
        raise HetplanError(f"--precision {args.precision}: {args.plan} was planned for {plan.precision}; plan again "
                           f"from a graph profiled with --precision {args.precision}")
    graph = load_graph(args.graph) if args.graph else None
    args.cluster = args.cluster or plan_cluster_ref(plan)  # the notes name the file too
    cluster = load_cluster(args.cluster)
    if graph is not None:
        _note_estimates(args, graph, cluster)  # said only if the run succeeds
    if args.checkpoint_every is not None and (args.checkpoint_every < 1 or not args.checkpoint_dir):
        raise HetplanError(f"--checkpoint-every {args.checkpoint_every}: K must be >= 1 and needs --checkpoint-dir "
                           "DIR (without --checkpoint-every, the last step is saved there)")
    settings = RunSettings.from_args(args)
    serde.check_output_dir(args.out, "the run folder")  # probes only: a refused run leaves no folder behind
    if args.checkpoint_dir:
        serde.check_output_dir(args.checkpoint_dir, "checkpoints")
    spec = prepare_run(plan, cluster, args.model, graph, settings, source=str(args.plan))[0]
    args.warnings.extend(faithful_warnings(spec))  # loads the model: after the cheap checks
    if args.dry_run:
        return _dry_run(args, spec, graph, cluster)
    report, changes = _train(args, plan, cluster, graph, settings)
    summary = report.summary(str(args.plan))
    page = _write_page(args.out)
    if args.json:
        said = {"changes": [{**asdict(c), "steps_lost": c.steps_lost} for c in changes]} if args.elastic else {}
        _emit_json({**summary, "report": page, "warnings": args.warnings, **said})
        return 0
    tables.show_run(_console(), summary, report.plan)
    for change in changes:
        _console().print(change.line())
    if report.trace_files:
        _console().print(f"trace of the last step: {', '.join(report.trace_files)}")
    _console().print(f"report: {page}")
    return 0


def _train(args: argparse.Namespace, plan, cluster, graph, settings):
    """The run, under a progress bar where the terminal shows one; with --elastic, re-planned when
    a worker dies (`runtime.elastic`). Returns the report and the re-plans."""
    from hetplan.planners import replan
    from hetplan.runtime.elastic import run_elastic
    from hetplan.runtime.run import run_plan

    if args.max_restarts < 0:
        raise HetplanError(f"--max-restarts {args.max_restarts}: N must be >= 0")

    def go(progress=None):
        if args.elastic:
            return run_elastic(plan, cluster, args.model, graph, settings, replan, progress, str(args.plan),
                               say=lambda line: print(f"hetplan: {line}", file=sys.stderr),
                               max_restarts=args.max_restarts, cluster_file=args.cluster)
        return run_plan(plan, cluster, args.model, graph, settings, progress, str(args.plan)), ()

    bar = _progress_bar(args)
    if bar is None:
        return go()
    with bar:
        workers = sum(len(st.devices) for st in plan.stages)
        task = bar.add_task(f"starting {workers} workers (loading and tracing the model)", total=args.steps)

        def step(done: int, total: int) -> None:
            bar.update(task, completed=done, description=f"training on {workers} workers" if done else None)

        return go(step)


def _write_page(folder) -> str:
    from hetplan.report.page import write_page
    from hetplan.report.sources import load_report

    return str(write_page(load_report(folder), folder / "report.html"))


def _dry_run(args: argparse.Namespace, spec: RunSpec, graph, cluster) -> int:
    from hetplan.runtime.launch import torchrun_commands
    from hetplan.runtime.run import write_for_elsewhere

    path = write_for_elsewhere(spec, graph, cluster)
    commands = torchrun_commands(path, spec)
    if args.json:
        _emit_json({"kind": "run", "dry_run": True, "run_json": str(path), "torchrun": commands,
                    "warnings": args.warnings})
        return 0
    console = _console()
    console.print(f"wrote {path}; copy it to the same path on every machine, then run, one per machine "
                  "(set --master-addr to the first machine's address):")
    for cmd in commands:
        console.print(f"  {cmd}", soft_wrap=True)
    console.print(f"when they end, the first machine's rank 0 prints the step measured against the prediction "
                  f"and leaves {spec.settings.out_dir} ready for `hetplan report {spec.settings.out_dir}`")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hetplan.runtime.calibrate import PHASES, calibrate_cluster

    cluster = load_cluster(args.cluster)
    bar = _progress_bar(args)
    with bar or contextlib.nullcontext():
        task = bar.add_task("calibrating", total=PHASES) if bar else None

        begun = []

        def say(what: str) -> None:  # a phase begins: the ones before it are done
            if bar:
                bar.update(task, completed=min(len(begun), PHASES - 1), description=what)
            begun.append(what)

        calibrated, report = calibrate_cluster(cluster, steps=args.steps, say=say)
    serde.dump(calibrated, args.output)
    if args.json:
        _emit_json({"kind": "calibration", **report, "output": str(args.output)})
        return 0
    from hetplan.cost import calibrated_figures

    console = _console()
    allreduce, optimizer = calibrated_figures(report, 32 << 20, 64e6)
    console.print(f"gloo between local workers: {report['link_bandwidth_Bps'] / 1e9:.2f} GB/s, "
                  f"{report['link_latency_s'] * 1e6:.0f} us latency; all-reduce of 32 MiB: " + ", ".join(
                      f"{t * 1e3:.1f} ms among {r}" for r, t in allreduce.items()))
    console.print("optimizer step per 64 MB of weights: " + ", ".join(
        f"{d} {t * 1e3:.1f} ms" for d, t in optimizer.items()))
    console.print("CPU workers side by side: " + ", ".join(
        f"{k} x{f:.2f}" for k, f in report["corun_slowdown"].items()))
    console.print(f"runtime overhead on {cluster.name}'s workers: {report['action_overhead_s'] * 1e3:.2f} "
                  f"ms per pipeline action, {report['step_overhead_s'] * 1e3:.1f} ms per step; wrote {args.output} "
                  "(use it as --cluster)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hetplan.demo import run_demo

    err = Console(stderr=True, highlight=False)
    summary = run_demo(args.out, steps=args.steps, budget_s=args.budget_s,
                       say=(lambda msg: None) if args.json else err.print, cluster_ref=args.cluster)
    if args.json:
        _emit_json(summary)
        return 0
    from rich.table import Table

    console = _console()
    table = Table(title=f"{summary['model']} on {summary['cluster']}: predicted against measured",
                  title_justify="left")
    for col in ("plan", "stages", "workers", "m", "predicted step", "measured step", "error"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for r in summary["runs"]:
        table.add_row(r["label"], str(r["stages"]), str(r["devices"]), str(r["microbatches"]),
                      fmt_seconds(r["predicted_step_s"]), fmt_seconds(r["measured_step_s"]), f"{r['error']:+.0%}")
    console.print(table)
    console.print(f"measured speed-up of the chosen plan ({summary['chosen']}) over the faster other baseline: "
                  f"{summary['speedup_over_best_baseline']:.2f}x; report in {args.out}/report.html (and report.md)")
    if not summary["calibrated"]:
        console.print(f"[bold]These predictions are not calibrated[/bold]: {summary['cluster']} has catalog figures, "
                      "not this machine's gloo links, optimizer steps and per-action costs; here that left "
                      "predictions 2-4x short (+100% to +300%) where calibration brought them within ~5-20% "
                      f"(BENCHMARKS.md). Run `hetplan calibrate --cluster {args.cluster} -o cal.json`, then "
                      "`hetplan demo --cluster cal.json` (`make demo` does both).")
    return 0
