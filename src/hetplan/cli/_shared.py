"""What the commands share: output (a console for tables, one JSON object), loading any input
file or preset, the planning options, the progress bar and the notes said after success."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from rich.console import Console

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError, InputError, shown
from hetplan.graph import Graph, at_batch, batch_size_problem
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


WHOLE_OR_AUTO = ("microbatches", "max_tp")  # flags that take a whole number, or auto where the field takes None


def _options(args: argparse.Namespace) -> PlanOptions:
    """The planning flags as `PlanOptions`: each flag's default is its field's (`cli.parser`), so
    a flag not given arrives as the field's default."""
    given = {f.name: getattr(args, f.name) for f in fields(PlanOptions) if hasattr(args, f.name)}
    for name in WHOLE_OR_AUTO:
        if name in given:
            given[name] = _whole_or_auto(given[name], name)
    return PlanOptions(**given)


def allows_none(name: str) -> bool:
    """Whether a field of `PlanOptions` takes None (then its flag takes `auto` for it)."""
    return type(None) in get_args(get_type_hints(PlanOptions)[name])


def _whole_or_auto(value: object, name: str) -> int | None:
    """A flag's text as a whole number >= 1, or `auto` as None where the field takes None; the
    default (the field's own, not text) as it is."""
    if not isinstance(value, str):
        return value
    flag, auto = "--" + name.replace("_", "-"), allows_none(name)
    if value == "auto":
        if not auto:
            raise HetplanError(f"{flag}: auto is not allowed; give a whole number >= 1")
        return None
    try:
        number = int(value)
    except ValueError:
        raise HetplanError(f"{flag}: {shown(value)} is not a whole number{' (or auto)' if auto else ''}") from None
    if number < 1:
        raise HetplanError(f"{flag}: {number} must be >= 1")
    return number


def graph_at_batch(graph: Graph, batch: int | None) -> Graph:
    """The graph at the batch the user trains with (`--global-batch`), or as profiled."""
    if batch is None:
        return graph
    return at_batch(graph, checked_batch(batch, "--global-batch"))


def checked_batch(batch: int, flag: str) -> int:
    """A batch size a flag gives, refused in one line when it is not one (`graph.batch_size_problem`)."""
    problem = batch_size_problem(batch)
    if problem:
        raise HetplanError(f"{flag}: {shown(batch)} {problem}")
    return batch


def in_precision(graph: Graph, precision: str | None) -> Graph:
    """The graph, checked to be in the precision asked for (`--precision`; None: whatever it is):
    a precision changes every time and size in it, so it is profiled, not converted."""
    if precision is not None and precision != graph.precision:
        how = (f"hetplan profile {graph.name} --roofline ... --precision {precision}" if graph.source == "analytic"
               else f"hetplan profile MODEL --precision {precision}")
        raise HetplanError(f"--precision {precision}: graph {graph.name!r} was profiled in {graph.precision}; "
                           f"profile it in {precision} ({how}) and plan from that graph")
    return graph


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
