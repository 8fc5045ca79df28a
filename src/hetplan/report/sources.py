"""What `hetplan report PATH` reads: a plan file, a `compare --json` output, a run folder
(`hetplan run --out`) or a demo folder (`hetplan demo --out`), each made into `ReportData`.

A plan or comparison names its graph and cluster: `hetplan plan` and `hetplan compare` record the
files they were given (`graph_file`, `cluster_ref`), and `--graph` / `--cluster` override them. A run
folder holds its own copies (`graph.json`, `cluster.json`, written by `run_plan`), its spec
(`run.json`), the run's summary (`summary.json`) and, after `--trace`, the measured step
(`trace_measured.json`); a demo folder likewise (`demo.json`, `graph.json`, `cluster.json`, the plans
and the runs' folders).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError, InputError
from hetplan.graph import Graph
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.io.graphs import load_graph
from hetplan.plan import Plan, validate_plan
from hetplan.report.curve import curve_rows
from hetplan.report.page import RUN_ROW_KEYS, ReportData, facts_of
from hetplan.report.summary import CLUSTER_REF, GRAPH_FILE, estimate_notes
from hetplan.runtime.run import TRACE_FILES
from hetplan.runtime.stage_times import StageTime, replica_times
from hetplan.sim import simulate
from hetplan.timeline import Timeline
from hetplan.timeline.gantt import timeline_from_trace

WHAT = ("a plan file (hetplan plan -o), a compare --json output, a run folder (hetplan run --out) or a demo "
        "folder (hetplan demo --out)")


def _graph(given: str | None, recorded: Any, what: str) -> Graph:
    ref = given or recorded
    if not ref:
        raise HetplanError(f"{what} does not name its graph file; pass --graph G.json")
    if not given and not Path(str(ref)).is_file():
        raise InputError(f"{what} was made from {ref}, which is not there any more; pass --graph G.json")
    return load_graph(ref)


def _cluster(given: str | None, recorded: Any, what: str) -> Cluster:
    ref = given or recorded
    if not ref:
        raise HetplanError(f"{what} does not name its cluster; pass --cluster C")
    try:
        return load_cluster(ref)
    except HetplanError as exc:
        if given:
            raise
        raise HetplanError(f"{what} was made on cluster {ref!r}, which cannot be loaded here ({exc}); pass "
                           "--cluster C") from None


def _curve(plan: Plan) -> tuple[tuple[float | None, ...], ...]:
    try:
        return tuple(tuple(r) for r in curve_rows(plan))
    except HetplanError:  # only the RL planners keep one
        return ()


def plan_data(plan: Plan, graph: Graph, cluster: Cluster, source: str) -> ReportData:
    """The page of a plan: its stages on the graph and its simulated step."""
    validate_plan(plan, graph, cluster, source=source)
    sim = simulate(graph, cluster, plan, timeline=True)
    plan = replace(plan, predicted=sim.estimate)
    return ReportData(kind="plan", title=f"{graph.name} on {cluster.name}: the {plan.planner} plan", source=source,
                      graph=graph, cluster=cluster, plan=plan, predicted=sim.timeline, facts=facts_of(plan),
                      replicas=replica_times(plan, None, sim.timeline), curve=_curve(plan),
                      notes=(*estimate_notes(graph, cluster), *sim.estimate.violations))


def load_plan(path: Path, graph_ref: str | None, cluster_ref: str | None) -> ReportData:
    plan = serde.load(path, expect="plan")
    what = f"plan {path}"
    graph = _graph(graph_ref, plan.meta.get(GRAPH_FILE), what)
    cluster = _cluster(cluster_ref, plan.meta.get(CLUSTER_REF) or plan.cluster, what)
    return plan_data(plan, graph, cluster, str(path))


def comparison_data(comparison: Mapping[str, Any], graph: Graph | None, cluster: Cluster | None,
                    source: str) -> ReportData:
    """The page of a comparison: the table, and the best plan drawn when the graph is at hand."""
    rows = {r["planner"]: r for r in comparison.get("rows", ())}
    best = rows.get(comparison.get("best") or "", {}).get("plan")
    title = f"{comparison.get('graph', '')} on {comparison.get('cluster', '')}: the planners compared"
    if best is None or graph is None or cluster is None:
        return ReportData(kind="comparison", title=title, source=source, comparison=comparison,
                          notes=("The best plan is not drawn: pass --graph and --cluster.",) if best else ())
    page = plan_data(serde.from_dict(best, source=f"{source}: best plan"), graph, cluster, source)
    return replace(page, kind="comparison", title=title, comparison=comparison)


def load_comparison(path: Path, data: Mapping[str, Any], graph_ref: str | None,
                    cluster_ref: str | None) -> ReportData:
    """A comparison's table, with its best plan drawn when its graph can be found (a recorded
    graph that has moved leaves the table and a note; `--graph` finds it)."""
    what, recorded = f"comparison {path}", data.get(GRAPH_FILE)
    if not graph_ref and not (recorded and Path(str(recorded)).is_file()):
        page = comparison_data(data, None, None, str(path))
        if recorded and page.notes:
            page = replace(page, notes=(f"The best plan is not drawn: its graph {recorded} is not there any more; "
                                        "pass --graph and --cluster.",))
        return page
    graph = _graph(graph_ref, recorded, what)
    cluster = _cluster(cluster_ref, data.get(CLUSTER_REF) or data.get("cluster"), what)
    return comparison_data(data, graph, cluster, str(path))


def _read(folder: Path, name: str, kind: type = dict) -> Any:
    path = folder / name
    if not path.is_file():
        raise InputError(f"{folder}: no {name} in it; {WHAT} is what hetplan report takes")
    data = serde.read_json(path)
    if not isinstance(data, kind):
        raise InputError(f"{path}: not what hetplan writes there (a JSON {type(data).__name__})")
    return data


def _measured(folder: Path, summary: Mapping[str, Any]) -> Timeline | None:
    """The run's measured last step, when this run traced it (an earlier run's trace in the
    same folder is not this one's)."""
    path = folder / TRACE_FILES[0]
    if not summary.get("trace_files") or not path.is_file():
        return None
    return timeline_from_trace(serde.read_json(path), str(path))


def _run_row(label: str, plan: Plan, summary: Mapping[str, Any]) -> dict[str, Any]:
    row = {"label": label, "stages": len(plan.stages), "devices": len(plan.devices), "microbatches": plan.microbatches}
    return {k: row.get(k, summary.get(k)) for k in RUN_ROW_KEYS}


def _stage_rows(rows: list[Mapping[str, Any]]) -> tuple[StageTime, ...]:
    return tuple(StageTime(**{**r, "devices": tuple(r["devices"])}) for r in rows)


def load_run(folder: Path) -> ReportData:
    """The page of a run: the plan on the graph, predicted above measured, the device table."""
    spec, summary = _read(folder, "run.json"), _read(folder, "summary.json")
    plan = serde.from_dict(spec.get("plan"), source=str(folder / "run.json"), expect="plan")
    title, measured_s = f"{summary.get('model', '')}: a run of the {plan.planner} plan", summary.get("measured_step_s")
    base = ReportData(kind="run", title=title, source=str(folder), plan=plan, measured=_measured(folder, summary),
                      runs=(_run_row(plan.planner, plan, summary),), replicas=_stage_rows(summary.get("replicas", [])))
    if not (folder / "graph.json").is_file():  # the plan file's own estimate may be for another cluster: not shown
        return replace(base, facts=facts_of(replace(plan, predicted=None), measured_s),
                       notes=("No graph was given to the run (--graph), so nothing was predicted.",))
    graph = load_graph(folder / "graph.json")
    page = plan_data(plan, graph, load_cluster(folder / "cluster.json"), str(folder))
    return replace(page, kind="run", title=title, measured=base.measured, runs=base.runs,
                   replicas=base.replicas or page.replicas, facts=facts_of(page.plan, measured_s))


def load_demo(folder: Path) -> ReportData:
    """The page of `hetplan demo`: the chosen plan (run 0) with its runs and the planners' table."""
    demo = _read(folder, "demo.json")
    run = load_run(folder / "run-0")
    runs = tuple({k: r.get(k) for k in RUN_ROW_KEYS} for r in demo.get("runs", ()))
    speedup = demo.get("speedup_over_best_baseline")
    facts = (*run.facts, ("measured speed-up over the faster baseline",
                          f"{speedup:.2f}x" if isinstance(speedup, float) and math.isfinite(speedup) else "-"))
    return replace(run, kind="demo", title=f"hetplan demo: {demo.get('model', '')} on {demo.get('cluster', '')}",
                   source=str(folder), runs=runs, comparison=demo.get("comparison"), facts=facts)


def _run_folder(path: Path, data: Mapping[str, Any]) -> Path:
    """The folder `hetplan run --json`'s output names: as written (from where the run was
    started), else beside the JSON file."""
    named = Path(str(data.get("out_dir")))
    for folder in (named, path.parent / named):
        if folder.is_dir():
            return folder
    raise InputError(f"{path}: names the run folder {named}, which is not there (from here or beside the file)")


def _load(path: Path, graph_ref: str | None, cluster_ref: str | None) -> ReportData:
    if path.is_dir():
        return load_demo(path) if (path / "demo.json").is_file() else load_run(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file or folder")
    data = serde.read_json(path)
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "plan":
        return load_plan(path, graph_ref, cluster_ref)
    if kind == "comparison":
        return load_comparison(path, data, graph_ref, cluster_ref)
    if kind == "run" and data.get("out_dir"):
        return load_run(_run_folder(path, data))
    what = f"a {kind} file" if isinstance(kind, str) else f"a JSON {type(data).__name__}"
    raise InputError(f"{path}: {what}, not {WHAT}")


def load_report(path: str | Path, graph_ref: str | None = None, cluster_ref: str | None = None) -> ReportData:
    """What the page of PATH shows (see the module docstring); one-line errors otherwise, a
    file hetplan did not write as it does included."""
    path = Path(path)
    try:
        return _load(path, graph_ref, cluster_ref)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, HetplanError):
            raise
        raise InputError(f"{path}: not as hetplan writes it ({type(exc).__name__}: {exc}); {WHAT} is what "
                         "hetplan report takes") from None
