"""The commands that describe: `info` (a graph, cluster or plan file, or a preset), `import
pipedream` (another tool's profile into a graph) and `catalog` (what hetplan knows)."""

from __future__ import annotations

import argparse

from hetplan import catalog
from hetplan.cli._shared import _console, _emit_json, load_any
from hetplan.cluster import Cluster
from hetplan.graph import Graph
from hetplan.io import serde
from hetplan.io.clusters import presets
from hetplan.io.pipedream import import_pipedream
from hetplan.planners import PLANNERS
from hetplan.report import tables
from hetplan.report.summary import cluster_summary, graph_summary, plan_summary
from hetplan.schedule import SCHEDULES
from hetplan.units import fmt_bytes, fmt_flops
from hetplan.zoo import ZOO


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
    graph = import_pipedream(args.path, name=args.name, device_type=args.device_type, batch_size=args.batch_size,
                             input_time=args.input_time)
    serde.dump(graph, args.output)
    if args.json:
        _emit_json({"kind": "import", "output": str(args.output), **{
            k: v for k, v in graph_summary(graph).items() if k not in ("kind", "ops")}})
    else:
        _console().print(f"wrote {args.output}: graph {graph.name!r}, {len(graph.nodes)} nodes, "
                         f"{len(graph.edges)} edges, batch {graph.batch_size}, profiled on {graph.profiled_on}")
    return 0


def cmd_catalog(args: argparse.Namespace) -> int:
    types = [catalog.lookup(name) for name in catalog.CATALOG] + [catalog.cpu_type(1)]
    if args.json:
        _emit_json({
            "kind": "catalog",
            "device_types": [serde.plain(t) for t in types],
            "presets": list(presets()),
            "planners": {name: spec.summary for name, spec in PLANNERS.items()},
            "schedules": {name: {"summary": k.summary, "torch_class": k.torch_class} for name, k in SCHEDULES.items()},
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
    console.print("schedules (--schedule; auto: the best for the plan): "
                  + "; ".join(f"{n} ({k.summary}; torch's {k.torch_class})" for n, k in SCHEDULES.items()))
    console.print("models (the zoo; or module.path:factory for your own): "
                  + "; ".join(f"{n} ({e.summary})" for n, e in ZOO.items()))
    return 0
