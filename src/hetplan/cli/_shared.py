"""What the commands share: output (a console for tables, one JSON object), loading any input
file or preset, the planning options, the progress bar and the notes said after success."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError, InputError
from hetplan.graph import Graph, at_batch
from hetplan.io import serde
from hetplan.io.clusters import cluster_from_data, load_cluster, presets
from hetplan.io.graphs import refuse_pipedream_text
from hetplan.plan import Plan
from hetplan.planners import PlanOptions


def _console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=120)
    return console


def _emit_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(serde.finite_or_null(obj), indent=1, allow_nan=False) + "\n")


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


def _options(args: argparse.Namespace) -> PlanOptions:
    return PlanOptions(
        microbatches=(None if args.microbatches in (None, "auto")
                      else _positive_int(args.microbatches, "--microbatches")),
        schedule=args.schedule, objective=args.objective, seed=args.seed, budget_s=args.budget_s,
        min_samples_per_s=args.min_samples_per_s, alpha=args.alpha, beta=args.beta, gamma=args.gamma,
        comm_tolerance=args.comm_tolerance, mem_tolerance=args.mem_tolerance, routing=args.routing,
        max_iters=args.max_iters, max_replicas=args.max_replicas, max_tp=args.max_tp,
        faithful=args.faithful, recompute=args.recompute, shard=args.shard,
    )


def graph_at_batch(graph: Graph, batch: int | None) -> Graph:
    """The graph at the batch the user trains with (`--global-batch`), or as profiled."""
    if batch is None:
        return graph
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise HetplanError(f"--global-batch: {batch!r} must be a whole number of samples >= 1")
    return at_batch(graph, batch)


def in_precision(graph: Graph, precision: str | None) -> Graph:
    """The graph, checked to be in the precision asked for (`--precision`; None: whatever it is):
    a precision changes every time and size in it, so it is profiled, not converted."""
    if precision is not None and precision != graph.precision:
        how = (f"hetplan profile {graph.name} --roofline ... --precision {precision}" if graph.source == "analytic"
               else f"hetplan profile MODEL --precision {precision}")
        raise HetplanError(f"--precision {precision}: graph {graph.name!r} was profiled in {graph.precision}; "
                           f"profile it in {precision} ({how}) and plan from that graph")
    return graph


def _positive_int(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise HetplanError(f"{flag}: {text!r} is not a whole number (or 'auto')") from None
    if value < 1:
        raise HetplanError(f"{flag}: {value} must be >= 1")
    return value


def _progress_bar(args: argparse.Namespace | None = None):
    """A progress bar with the time spent and an estimate of the time left, on stderr when it is
    a terminal and the command's output is not `--json`, else None (nothing is shown)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True, highlight=False)
    if not console.is_terminal or getattr(args, "json", False):
        return None
    return Progress(TextColumn("{task.description:.36}"), BarColumn(), TimeElapsedColumn(), TextColumn("spent,"),
                    TimeRemainingColumn(), TextColumn("left"), console=console, transient=True)


def _note_estimates(args: argparse.Namespace, graph: Graph, cluster: Cluster) -> None:
    """`estimate_notes`, a line each, said after the command has succeeded (`main`), so that an
    error stays the only line."""
    from hetplan.report.summary import estimate_notes

    args.notes.extend(estimate_notes(graph, cluster, getattr(args, "cluster", None)))
