"""The commands that plan and predict: `plan`, `compare` (several planners side by side),
`replay` (a trace of devices coming and going, three policies) and `simulate` (a plan's step,
with its Gantt chart or Chrome trace)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from hetplan.cli._shared import (
    _console,
    _emit_json,
    _note_estimates,
    _options,
    _progress_bar,
    graph_at_batch,
    in_precision,
)
from hetplan.errors import HetplanError
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.io.graphs import load_graph
from hetplan.plan import validate_plan
from hetplan.planners import PLANNERS, RL_PLANNERS, get_planner, make_plan
from hetplan.report import tables
from hetplan.report.summary import input_refs, plan_summary
from hetplan.units import fmt_seconds


def cmd_plan(args: argparse.Namespace) -> int:
    graph = graph_at_batch(in_precision(load_graph(args.graph), args.precision), args.global_batch)
    cluster = load_cluster(args.cluster)
    _note_estimates(args, graph, cluster)
    options = _options(args)
    bar = _progress_bar(args)
    if bar is None:
        plan = make_plan(graph, cluster, args.planner, options)
    else:
        with bar:
            task = bar.add_task(f"planning with {args.planner}", total=1.0)
            plan = make_plan(graph, cluster, args.planner, options,
                             progress=lambda done: bar.update(task, completed=done))
    plan = replace(plan, meta={**plan.meta, **input_refs(args.graph, args.cluster)})  # for `hetplan report`
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
    if args.explain:
        tables.show_explanation(console, plan)
    if args.output:
        console.print(f"wrote {args.output}")
    for f in curve_files:
        console.print(f"wrote {f}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from hetplan.planners.compare import compare

    graph = graph_at_batch(in_precision(load_graph(args.graph), args.precision), args.global_batch)
    cluster = load_cluster(args.cluster)
    _note_estimates(args, graph, cluster)
    options = _options(args)
    names = ([n.strip() for n in args.planners.split(",") if n.strip()] if args.planners is not None
             else [n for n in PLANNERS if n not in RL_PLANNERS and (n != "milp" or args.objective == "throughput")])
    if not names:
        raise HetplanError(f"--planners {args.planners!r}: names no planner; give a comma-separated list of "
                           f"{', '.join(PLANNERS)}, or leave the flag out for the usual set")
    for name in names:
        get_planner(name)
    bar = _progress_bar(args)
    if bar is None:
        result = compare(graph, cluster, names, options)
    else:
        with bar:
            task = bar.add_task("comparing", total=len(names))

            def step(name: str, done: float) -> None:
                bar.update(task, description=f"planning with {name}", completed=names.index(name) + done)

            result = compare(graph, cluster, names, options, progress=step)
    if args.json:
        _emit_json({**result.to_json(), **input_refs(args.graph, args.cluster)})
        return 0
    tables.show_comparison(_console(), result, graph, cluster)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from hetplan.availability import Costs, load_availability, plan_cache, replay

    graph = graph_at_batch(in_precision(load_graph(args.graph), args.precision), args.global_batch)
    cluster = load_cluster(args.cluster)
    trace = load_availability(args.trace)
    if not (args.restart_s >= 0 and args.checkpoint_every_s > 0):
        raise HetplanError("--restart-s takes seconds >= 0 and --checkpoint-every-s seconds > 0")
    options = _options(args)
    plan_for = plan_cache(cluster, lambda there: make_plan(graph, there, args.planner, options))
    runs = replay(trace, plan_for, Costs(args.restart_s, args.checkpoint_every_s))
    if args.json:
        _emit_json({"kind": "replay", "runs": [{**asdict(r), "usd_per_million_samples": r.usd_per_million_samples}
                                               for r in runs], **input_refs(args.graph, args.cluster)})
        return 0
    tables.show_replay(_console(), runs, f"{graph.name} on {cluster.name} through {args.trace} "
                       f"({fmt_seconds(trace.horizon_s)}, {len(trace.times_s)} points), {args.planner}'s plans")
    return 0


def _checked_lowering(graph, cluster, plan):
    from hetplan.lowering import check_lowered
    from hetplan.sim import lowered_step

    lowered = lowered_step(graph, cluster, plan)
    check_lowered(lowered)
    return lowered


def cmd_simulate(args: argparse.Namespace) -> int:
    from hetplan.report.summary import estimate_summary
    from hetplan.sim import simulate

    plan = serde.load(args.plan, expect="plan")
    graph = graph_at_batch(in_precision(load_graph(args.graph), args.precision or plan.precision),
                           plan.meta.get("batch_size") if args.global_batch is None else args.global_batch)
    cluster = load_cluster(args.cluster)
    _note_estimates(args, graph, cluster)
    validate_plan(plan, graph, cluster, source=str(args.plan))
    sim = simulate(graph, cluster, plan, routing=args.routing, timeline=bool(args.gantt or args.trace))
    est = sim.estimate
    if args.gantt:
        from hetplan.timeline.gantt import device_labels, draw_gantt

        labels = device_labels(plan, cluster)
        title = (f"{graph.name} on {cluster.name}: {plan.planner} plan, {len(plan.stages)} stages, "
                 f"{plan.microbatches} micro-batches, {plan.schedule}; step {fmt_seconds(est.step_s)}, "
                 f"bubble {est.bubble_fraction:.0%}")
        draw_gantt(sim.timeline, args.gantt, title=title, device_labels=labels)
    if args.trace:
        from hetplan.timeline.gantt import write_chrome_trace

        write_chrome_trace(sim.timeline, args.trace)
    lowered = _checked_lowering(graph, cluster, plan) if args.actions else None
    if args.json:
        _emit_json({"kind": "simulation", "routing": args.routing, **estimate_summary(est),
                    "gantt": str(args.gantt) if args.gantt else None, "trace": str(args.trace) if args.trace else None,
                    **({"actions": [[lowered.shown(op) for op in ops] for ops in lowered.ops]} if lowered else {})})
        return 0
    console = _console()
    tables.show_simulation(console, plan, cluster, est)
    if lowered:
        console.print("each worker's actions (torch's format; -> sends to, <- receives from a rank):")
        for line in lowered.lines():
            console.print(line, highlight=False, soft_wrap=True)
    for what, path in (("Gantt chart", args.gantt), ("Chrome trace", args.trace)):
        if path:
            console.print(f"wrote {what} {path}")
    return 0
