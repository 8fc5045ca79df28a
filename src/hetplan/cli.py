"""The `hetplan` command: a thin layer over the library.

Every command takes `--json` and then prints exactly one JSON object on stdout. Bad input ends
with one line on stderr and exit status 2 (see `hetplan.errors`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from hetplan import catalog
from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.errors import HetplanError, InputError
from hetplan.graph import GRANULARITIES, Graph
from hetplan.io import serde
from hetplan.io.clusters import cluster_from_data, load_cluster, presets
from hetplan.io.graphs import load_graph, refuse_pipedream_text
from hetplan.io.pipedream import DEFAULT_DEVICE_TYPE, import_pipedream
from hetplan.plan import OBJECTIVES, SCHEDULES, Plan, validate_plan
from hetplan.planners import PLANNERS, RL_PLANNERS, PlanOptions, get_planner, make_plan
from hetplan.report import tables
from hetplan.report.summary import cluster_summary, graph_summary, plan_summary
from hetplan.sim.model import ROUTINGS
from hetplan.units import fmt_bytes, fmt_flops, fmt_seconds
from hetplan.zoo import ZOO, zoo_names

DESCRIPTION = """\
hetplan plans how to split the training of a PyTorch model across a mixed set of devices,
predicts how fast and how expensive each plan is, and runs it.

workflow:
  1. a graph of the model:  hetplan profile gpt2-tiny --device cpu:1 --device cpu:2 -o g.json
                            (or import one: hetplan import pipedream resnet50/graph.txt -o r50.json)
  2. a cluster:             a YAML file, or a preset such as hetero-4 (hetplan catalog lists them)
  3. a plan:                hetplan plan r50.json --cluster hetero-4 -o plan.json   (planner dp)
                            hetplan compare r50.json --cluster hetero-4              (all planners)
  4. its predicted step:    hetplan simulate plan.json --graph r50.json --cluster hetero-4 --gantt step.png
  5. a look at any of them: hetplan info r50.json | hetplan info hetero-4 | hetplan info plan.json
  6. a real run:            hetplan run plan.json --model gpt2-tiny --graph g.json   (a plan for local CPU
                            workers or a cluster file with bindings; predicted against measured)

Every command takes --json and then prints one JSON object."""


def _console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=120)
    return console


def _emit_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, allow_nan=False) + "\n")


def load_any(ref: str) -> Graph | Cluster | Plan:
    """A graph, cluster or plan file, a cluster description, or a preset name."""
    path = Path(ref)
    if path.is_file():
        if path.suffix in (".yaml", ".yml"):
            return load_cluster(path)
        refuse_pipedream_text(path)
        data = serde.read_json(path)
        if not serde.is_hetplan_file(data) and isinstance(data, dict) and "devices" in data:
            return cluster_from_data(data, str(path))
        return serde.from_dict(data, source=str(path))
    if ref in presets():
        return load_cluster(ref)
    if path.suffix or "/" in ref:
        raise InputError(f"{ref}: no such file")
    raise HetplanError(f"{ref!r} is neither a file nor a cluster preset (presets: {', '.join(presets())})")


# ---- commands ---------------------------------------------------------------------------------

def cmd_info(args: argparse.Namespace) -> int:
    obj = load_any(args.target)
    if isinstance(obj, Graph):
        summary = graph_summary(obj)
    elif isinstance(obj, Cluster):
        summary = cluster_summary(obj)
    else:
        summary = plan_summary(obj)
    if args.json:
        _emit_json(summary)
        return 0
    console = _console()
    if isinstance(obj, Graph):
        tables.show_graph(console, obj)
    elif isinstance(obj, Cluster):
        tables.show_cluster(console, obj)
    else:
        tables.show_plan(console, obj)
    return 0


def cmd_import_pipedream(args: argparse.Namespace) -> int:
    graph = import_pipedream(args.path, name=args.name, device_type=args.device_type, batch_size=args.batch_size)
    serde.dump(graph, args.output)
    if args.json:
        _emit_json({"kind": "import", "output": str(args.output), **{
            k: v for k, v in graph_summary(graph).items() if k not in ("kind", "ops")}})
    else:
        _console().print(f"wrote {args.output}: graph {graph.name!r}, {len(graph.nodes)} nodes, "
                         f"{len(graph.edges)} edges, batch {graph.batch_size}, profiled on {graph.profiled_on}")
    return 0


def _options(args: argparse.Namespace) -> PlanOptions:
    return PlanOptions(
        microbatches=(None if args.microbatches in (None, "auto")
                      else _positive_int(args.microbatches, "--microbatches")),
        schedule=args.schedule, objective=args.objective, seed=args.seed, budget_s=args.budget_s,
        min_samples_per_s=args.min_samples_per_s, alpha=args.alpha, beta=args.beta, gamma=args.gamma,
        comm_tolerance=args.comm_tolerance, mem_tolerance=args.mem_tolerance, routing=args.routing,
        max_iters=args.max_iters,
        faithful=args.faithful,
    )


def _progress_bar():
    """A progress bar on stderr when it is a terminal, else nothing."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, highlight=False)
    if not console.is_terminal:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                    transient=True)


def _note_projections(args: argparse.Namespace, graph: Graph, cluster: Cluster) -> None:
    """Which device types' times are projected, not measured (a graph profiled on cpu-2t and
    planned on cpu-1t workers is otherwise silently a guess): one line, said after the command
    has succeeded (`main`), so that an error stays the only line."""
    projected = CostModel(graph, cluster).projected_types()
    if projected:
        pairs = ", ".join(f"{target} (from {source})" for target, source in projected.items())
        args.notes.append(f"graph '{graph.name}' has no times measured on {pairs}: they are projected by the "
                          "roofline model; profile on those devices to measure them")


def cmd_plan(args: argparse.Namespace) -> int:
    graph = load_graph(args.graph)
    cluster = load_cluster(args.cluster)
    _note_projections(args, graph, cluster)
    options = _options(args)
    bar = _progress_bar()
    if bar is None:
        plan = make_plan(graph, cluster, args.planner, options)
    else:
        with bar:
            task = bar.add_task(f"planning with {args.planner}", total=1.0)
            plan = make_plan(graph, cluster, args.planner, options,
                             progress=lambda done: bar.update(task, completed=done))
    curve_files = []
    if args.curve:
        from hetplan.report.curve import write_curve

        curve_files = write_curve(plan, args.curve)
    if args.output:
        serde.dump(plan, args.output)
    if args.json:
        _emit_json({**plan_summary(plan), "output": str(args.output) if args.output else None,
                    **({"curve_files": curve_files} if args.curve else {})})
        return 0
    console = _console()
    tables.show_plan(console, plan, graph, cluster)
    if args.output:
        console.print(f"wrote {args.output}")
    for f in curve_files:
        console.print(f"wrote {f}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from hetplan.planners.compare import compare

    graph = load_graph(args.graph)
    cluster = load_cluster(args.cluster)
    _note_projections(args, graph, cluster)
    options = _options(args)
    names = ([n.strip() for n in args.planners.split(",") if n.strip()] if args.planners
             else [n for n in PLANNERS if n not in RL_PLANNERS])
    for name in names:
        get_planner(name)
    bar = _progress_bar()
    if bar is None:
        result = compare(graph, cluster, names, options)
    else:
        with bar:
            task = bar.add_task("comparing", total=len(names))

            def step(name: str, done: float) -> None:
                bar.update(task, description=f"planning with {name}", completed=names.index(name) + done)

            result = compare(graph, cluster, names, options, progress=step)
    if args.json:
        _emit_json(result.to_json())
        return 0
    tables.show_comparison(_console(), result, graph, cluster)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from hetplan.runtime.run import RunSettings, prepare_run, run_plan

    plan = serde.load(args.plan, expect="plan")
    graph = load_graph(args.graph) if args.graph else None
    cluster_ref = args.cluster or plan.cluster
    if not cluster_ref:
        raise HetplanError("the plan does not name its cluster; pass --cluster C")
    cluster = load_cluster(cluster_ref)
    if graph is not None:
        _note_projections(args, graph, cluster)  # said only if the run succeeds
    settings = RunSettings(
        steps=args.steps, warmup=args.warmup, batch_size=args.batch_size, seq_len=args.seq_len,
        granularity=args.granularity, seed=args.seed, optimizer=args.optimizer, lr=args.lr, data=args.data,
        out_dir=args.out, timeout_s=args.timeout_s, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume)
    if args.dry_run:
        return _dry_run(args, prepare_run(plan, cluster, args.model, graph, settings, source=str(args.plan))[0])
    bar = _progress_bar()
    if bar is None:
        report = run_plan(plan, cluster, args.model, graph, settings, source=str(args.plan))
    else:
        with bar:
            task = bar.add_task(f"running {sum(len(st.devices) for st in plan.stages)} workers", total=args.steps)
            report = run_plan(plan, cluster, args.model, graph, settings, source=str(args.plan),
                              progress=lambda done, total: bar.update(task, completed=done))
    summary = report.summary(str(args.plan))
    if args.json:
        _emit_json(summary)
        return 0
    tables.show_run(_console(), summary, plan)
    return 0


def _dry_run(args: argparse.Namespace, spec: dict[str, Any]) -> int:
    from hetplan.runtime.launch import torchrun_commands, write_spec

    path = write_spec(spec)
    commands = torchrun_commands(path, spec)
    if args.json:
        _emit_json({"kind": "run", "dry_run": True, "run_json": str(path), "torchrun": commands})
        return 0
    console = _console()
    console.print(f"wrote {path}; copy it to the same path on every machine, then run, one per machine "
                  "(set --master-addr to the first machine's address):")
    for cmd in commands:
        console.print(f"  {cmd}", soft_wrap=True)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hetplan.runtime.calibrate import calibrate_cluster

    cluster = load_cluster(args.cluster)
    err = Console(stderr=True, highlight=False)
    calibrated, report = calibrate_cluster(cluster, steps=args.steps,
                                           say=(lambda msg: None) if args.json else err.print)
    serde.dump(calibrated, args.output)
    if args.json:
        _emit_json({"kind": "calibration", **report, "output": str(args.output)})
        return 0
    link = ""
    if "link_bandwidth_Bps" in report:
        link = (f"gloo between local workers {report['link_bandwidth_Bps'] / 1e9:.2f} GB/s, "
                f"{report['link_latency_s'] * 1e6:.0f} us latency; ")
    _console().print(f"{link}runtime overhead on {cluster.name}'s CPU workers: {report['action_overhead_s'] * 1e3:.2f} "
                     f"ms per pipeline action, {report['step_overhead_s'] * 1e3:.1f} ms per step; wrote {args.output} "
                     "(use it as --cluster)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from hetplan.demo import run_demo

    err = Console(stderr=True, highlight=False)
    summary = run_demo(args.out, steps=args.steps, budget_s=args.budget_s,
                       say=(lambda msg: None) if args.json else err.print)
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
                  f"{summary['speedup_over_best_baseline']:.2f}x; report in {args.out}/report.md")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from hetplan.report.summary import estimate_summary
    from hetplan.sim import simulate

    plan = serde.load(args.plan, expect="plan")
    graph = load_graph(args.graph)
    cluster = load_cluster(args.cluster)
    _note_projections(args, graph, cluster)
    validate_plan(plan, graph, cluster, source=str(args.plan))
    sim = simulate(graph, cluster, plan, routing=args.routing, timeline=bool(args.gantt or args.trace))
    est = sim.estimate
    if args.gantt:
        from hetplan.report.gantt import draw_gantt

        labels = {d: f"{d} ({cluster.device(d).type}) · stage {i}"
                  for i, stage in enumerate(plan.stages) for d in stage.devices}
        title = (f"{graph.name} on {cluster.name}: {plan.planner} plan, {len(plan.stages)} stages, "
                 f"{plan.microbatches} micro-batches, {plan.schedule}; step {fmt_seconds(est.step_s)}, "
                 f"bubble {est.bubble_fraction:.0%}")
        draw_gantt(sim.timeline, args.gantt, title=title, device_labels=labels)
    if args.trace:
        from hetplan.report.gantt import write_chrome_trace

        write_chrome_trace(sim.timeline, args.trace)
    if args.json:
        _emit_json({"kind": "simulation", "routing": args.routing, **estimate_summary(est),
                    "gantt": str(args.gantt) if args.gantt else None, "trace": str(args.trace) if args.trace else None})
        return 0
    console = _console()
    tables.show_simulation(console, plan, cluster, est)
    for what, path in (("Gantt chart", args.gantt), ("Chrome trace", args.trace)):
        if path:
            console.print(f"wrote {what} {path}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from hetplan.profile import profile_step
    from hetplan.zoo import load_model

    console = Console(stderr=True, highlight=False)
    zoo_model = load_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    with console.status("profiling", spinner="dots") as status:
        report = profile_step(
            zoo_model.step, zoo_model.batch, name=zoo_model.name, devices=args.device or ["cpu"],
            granularity=args.granularity,
            block_classes=args.block_class or zoo_model.block_classes or None,
            repeats=args.repeats, seed=args.seed, check=args.check, calibrate=args.calibrate,
            progress=(lambda msg: status.update(f"profiling {msg}")) if console.is_terminal else None,
        )
    graph = report.graph
    serde.dump(graph, args.output)
    summary = {**{k: v for k, v in graph_summary(graph).items() if k != "ops"}, "kind": "profile",
               "output": str(args.output), "profile_s": report.profile_s,
               "whole_step_s": dict(report.whole_step_s),
               "whole_step_range_s": {k: list(v) for k, v in report.whole_step_range_s.items()},
               "check_ratio": dict(report.check_ratio), "check_ratio_median": dict(report.check_ratio_median),
               "check_ratio_isolated": dict(report.check_ratio_isolated)}
    if args.json:
        _emit_json(summary)
        return 0
    out = _console()
    out.print(f"wrote {args.output}: graph {graph.name!r} at {graph.meta['granularity']} granularity, "
              f"{len(graph.nodes)} nodes, {len(graph.edges)} edges, batch {graph.batch_size}, "
              f"profiled on {', '.join(graph.device_types)} in {report.profile_s:.1f} s")
    for dtype, ratio in report.check_ratio.items():
        low, high = report.whole_step_range_s[dtype]
        before = f"{report.check_ratio_isolated[dtype]:.3f} before calibration; " if args.calibrate else ""
        out.print(f"check on {dtype}: sum of node times / measured whole step = {ratio:.3f} comparing the "
                  f"fastest runs, {report.check_ratio_median[dtype]:.3f} comparing medians; {before}"
                  f"whole step {_ms(report.whole_step_s[dtype])} median, {_ms(low)} to {_ms(high)}")
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def cmd_catalog(args: argparse.Namespace) -> int:
    types = [catalog.lookup(name) for name in catalog.CATALOG] + [catalog.cpu_type(1)]
    if args.json:
        _emit_json({
            "kind": "catalog",
            "device_types": [serde.plain(t) for t in types],
            "presets": list(presets()),
            "planners": {name: spec.summary for name, spec in PLANNERS.items()},
            "models": {name: entry.summary for name, entry in ZOO.items()},
        })
        return 0
    from rich.table import Table

    console = _console()
    table = Table(title="device types", title_justify="left")
    for col in ("name", "fp32", "fp16/bf16", "memory", "$/h", "what"):
        table.add_column(col)
    for t in types:
        name = "cpu (cpu-Nt)" if t.kind == "cpu" else t.name
        what = "per thread; memory is the default, set it per device" if t.kind == "cpu" else t.description
        table.add_row(name, fmt_flops(t.peak_flops), fmt_flops(t.peak_flops_fp16), fmt_bytes(t.mem_bytes),
                      f"{t.usd_per_hour:.2f}", what)
    console.print(table)
    console.print("cluster presets: " + ", ".join(presets()))
    console.print("planners: " + "; ".join(f"{n} ({s.summary})" for n, s in PLANNERS.items()))
    console.print("models (the zoo; or module.path:factory for your own): "
                  + "; ".join(f"{n} ({e.summary})" for n, e in ZOO.items()))
    return 0


def _positive_int(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise HetplanError(f"{flag}: {text!r} is not a whole number (or 'auto')") from None
    if value < 1:
        raise HetplanError(f"{flag}: {value} must be >= 1")
    return value


# ---- parser -------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    parser = argparse.ArgumentParser(prog="hetplan", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hetplan {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("info", parents=[common], help="summarise a graph, cluster or plan file, or a preset")
    p.add_argument("target", metavar="FILE|PRESET")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("import", help="import another tool's profile into a hetplan graph")
    fmt = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    q = fmt.add_parser("pipedream", parents=[common], help="a PipeDream profiler graph.txt")
    q.add_argument("path", type=Path, metavar="PATH/graph.txt")
    q.add_argument("-o", "--output", type=Path, required=True, help="the graph JSON to write")
    q.add_argument("--name", help="graph name (default: the profile's folder name)")
    q.add_argument("--device-type", default=DEFAULT_DEVICE_TYPE,
                   help=f"device type the profile was taken on (default: {DEFAULT_DEVICE_TYPE})")
    q.add_argument("--batch-size", type=int, help="batch size of the profile (read off image inputs if omitted)")
    q.set_defaults(func=cmd_import_pipedream)

    planning = argparse.ArgumentParser(add_help=False)
    planning.add_argument("graph", metavar="GRAPH", help="a graph JSON file")
    planning.add_argument("--cluster", required=True, metavar="C", help="a cluster file or preset")
    planning.add_argument("--microbatches", metavar="M|auto",
                          help="micro-batches per step (default: auto, the planner chooses)")
    planning.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (default: 1f1b)")
    planning.add_argument("--objective", default="time", choices=OBJECTIVES,
                          help="time: shortest step; cost: lowest price per sample above --min-samples-per-s; "
                               "mdpe: Trinity's runtime + communication + memory model (default: time)")
    planning.add_argument("--min-samples-per-s", type=float, metavar="X", help="throughput floor of --objective cost")
    planning.add_argument("--seed", type=int, default=0, help="seed of search planners (default: 0)")
    planning.add_argument("--budget-s", type=float, metavar="T",
                          help="time budget of search planners (default: 10 for local-search, 20 for the RL "
                               "planners, 60 with --faithful)")
    planning.add_argument("--max-iters", type=int, metavar="N",
                          help="iterations of search planners instead of a time budget (the same plan every run)")
    planning.add_argument("--faithful", action="store_true",
                          help="RL planners: the paper's set-up (cold start) instead of a warm start from dp")
    planning.add_argument("--routing", default="relay", choices=ROUTINGS,
                          help="how the simulator scoring plans sends tensors between stages (default: relay, "
                               "as the runtime does)")
    mdpe = planning.add_argument_group("mdpe objective")
    mdpe.add_argument("--alpha", type=float, default=0.5, help="weight of the step time (default: 0.5)")
    mdpe.add_argument("--beta", type=float, default=0.3, help="weight of communication over tolerance (default: 0.3)")
    mdpe.add_argument("--gamma", type=float, default=0.2, help="weight of memory over tolerance (default: 0.2)")
    mdpe.add_argument("--comm-tolerance", type=float, default=0.5,
                      help="busiest link's share of the step tolerated (default: 0.5)")
    mdpe.add_argument("--mem-tolerance", type=float, default=0.8,
                      help="share of a device's memory tolerated (default: 0.8)")

    p = sub.add_parser("plan", parents=[common, planning], help="split a graph over a cluster with a planner")
    p.add_argument("--planner", default="dp", choices=list(PLANNERS), metavar="NAME",
                   help=f"one of: {', '.join(PLANNERS)} (default: dp)")
    p.add_argument("-o", "--output", type=Path, help="the plan JSON to write")
    p.add_argument("--curve", type=Path, metavar="PREFIX",
                   help="RL planners: write the learning curve to PREFIX.csv and PREFIX.png (and TensorBoard "
                        "events under PREFIX-tb/ when tensorboard is installed)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("compare", parents=[common, planning], help="run several planners on one problem, side by side")
    p.add_argument("--planners", metavar="A,B,...",
                   help=f"planners to run, of: {', '.join(PLANNERS)} (default: all but the RL planners "
                        f"{', '.join(RL_PLANNERS)}, which take their budget each)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("simulate", parents=[common], help="predict a plan's step: time, memory, traffic, price",
                       description="Replay one training step of a plan with the event-driven simulator.")
    p.add_argument("plan", metavar="PLAN", help="a plan JSON file")
    p.add_argument("--graph", required=True, metavar="G", help="the graph JSON the plan was made for")
    p.add_argument("--cluster", required=True, metavar="C", help="a cluster file or preset")
    p.add_argument("--routing", default="relay", choices=ROUTINGS,
                   help="relay: only neighbouring stages talk, as in hetplan's runtime (default); "
                        "direct: each tensor goes straight to the stages that use it, branches run in parallel")
    p.add_argument("--gantt", type=Path, metavar="OUT.png", help="write a Gantt chart of the step (.png/.svg/.pdf)")
    p.add_argument("--trace", type=Path, metavar="OUT.json",
                   help="write the timeline as a Chrome trace (chrome://tracing, ui.perfetto.dev)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("run", parents=[common], help="train with a plan on workers; measured against predicted",
                       description="Run a plan for real: one worker process per stage replica, each "
                                   "running its stage's scheduled actions over gloo.")
    p.add_argument("plan", metavar="PLAN", help="a plan JSON file")
    p.add_argument("--model", required=True, help=f"the profiled model: a zoo model ({', '.join(zoo_names())}) "
                                                  "or module.path:factory")
    p.add_argument("--graph", metavar="G", help="the graph the plan was made for (for the prediction and the shapes)")
    p.add_argument("--cluster", metavar="C", help="cluster file or preset (default: the plan's, e.g. local)")
    p.add_argument("--batch-size", type=int, help="samples per step (default: the graph's)")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the graph's)")
    p.add_argument("--granularity", choices=GRANULARITIES, help="as profiled (default: the graph's)")
    p.add_argument("--steps", type=int, default=10, help="training steps (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (default: 2)")
    p.add_argument("--data", choices=("synthetic", "text"), default="synthetic",
                   help="synthetic random batches, or text: the Python standard library's sources, byte-level")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", type=Path, metavar="DIR")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="save every K steps")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    p.add_argument("--timeout-s", type=float, default=60.0, help="stop every worker when none moves for this long")
    p.add_argument("--out", type=Path, default=Path("out/run"), help="the run folder: logs, run.json, result")
    p.add_argument("--dry-run", action="store_true",
                   help="write the run folder's run.json and print the torchrun command of each machine")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("calibrate", parents=[common],
                       help="measure the runtime's cost per pipeline action on a cluster's CPU workers")
    p.add_argument("--cluster", default="local", metavar="C", help="a cluster file or preset (default: local)")
    p.add_argument("--steps", type=int, default=10, help="steps per probe run (default: 10)")
    p.add_argument("-o", "--output", type=Path, required=True, help="the calibrated cluster JSON to write")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("demo", parents=[common], help="profile, plan, simulate and run gpt2-tiny on this machine")
    p.add_argument("--out", type=Path, default=Path("out/demo/report"), help="the report folder")
    p.add_argument("--steps", type=int, default=12, help="training steps per run, 3 of them warm-up (default: 12)")
    p.add_argument("--budget-s", type=float, default=3.0, help="local-search's budget (default: 3)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("profile", parents=[common], help="profile a model's training step into a graph")
    p.add_argument("model", metavar="MODEL", help=f"a zoo model ({', '.join(zoo_names())}) or module.path:factory")
    p.add_argument("--batch-size", type=int, help="samples per batch (default: the zoo entry's)")
    p.add_argument("--seq-len", type=int, help="sequence length of language models (default: the zoo entry's)")
    p.add_argument("--device", action="append", metavar="D",
                   help="cpu, cpu:N (N threads), cuda or cuda:K; repeat to profile on several (default: cpu)")
    p.add_argument("--granularity", default="layer", choices=GRANULARITIES,
                   help="layer: one node per leaf module; block: one per repeated block (default: layer)")
    p.add_argument("--block-class", action="append", metavar="CLASS",
                   help="class name of the repeated block, for --granularity block on your own model")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per node; the median is kept (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and batch")
    p.add_argument("--calibrate", action="store_true",
                   help="scale the nodes' isolated times to the pieces' time run in sequence (experimental)")
    p.add_argument("--check", action="store_true",
                   help="also time the unsplit step and print the ratio of the sum of node times to it")
    p.add_argument("-o", "--output", type=Path, required=True, help="the graph JSON to write")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("catalog", parents=[common], help="list device types, cluster presets and planners")
    p.set_defaults(func=cmd_catalog)
    return parser


def _version() -> str:
    from hetplan import __version__

    return __version__


def _check_outputs(args: argparse.Namespace) -> None:
    """Every file a command will write is a regular file or a new path, and none of its inputs,
    checked before any work (`serde.check_output`), so that a refused command changes nothing."""
    inputs = [getattr(args, k, None) for k in ("path", "plan", "graph", "cluster", "target")]
    inputs = [i for i in inputs if isinstance(i, str | Path) and Path(i).exists()]  # a preset is a name
    outputs = [getattr(args, k, None) for k in ("output", "gantt", "trace")]
    curve = getattr(args, "curve", None)
    if curve:
        outputs += [f"{curve}.csv", f"{curve}.png"]
    for out in outputs:
        if out:
            serde.check_output(out, inputs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.notes = []
    try:
        _check_outputs(args)
        code = args.func(args)
        for note in args.notes:
            print(f"hetplan: note: {note}", file=sys.stderr)
        return code
    except HetplanError as exc:
        print(f"hetplan: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP during a run (runtime.supervise.Stopped)
        print(f"hetplan: {exc or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
