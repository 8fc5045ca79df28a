"""Running a plan from the library: what `hetplan run` does, as one call a user can make.

`run_plan` works out the settings a run needs from the graph (batch size, sequence length,
granularity) and the checkpoint folder (the step to resume from), launches the workers
(`hetplan.runtime.launch`), and returns a `RunReport`: the measured step as an `Estimate` with
`method="measured"` beside the simulator's prediction for the same plan, and per stage the busy
time and the share of the step spent communicating, both ways (`hetplan.runtime.stage_times`).
`prepare_run` stops before launching (for `--dry-run` and torchrun).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hetplan.cluster import Cluster
from hetplan.cost import usd_per_step
from hetplan.errors import HetplanError, shown
from hetplan.graph import Graph, at_batch, batch_size_problem
from hetplan.io import serde
from hetplan.io.serde import atomic_write_text
from hetplan.plan import Estimate, Plan, prediction_error, validate_plan
from hetplan.runtime.launch import RunResult, launch, read_result, run_spec, write_spec
from hetplan.runtime.settings import DEFAULTS, RunSettings
from hetplan.runtime.spec import RunSpec
from hetplan.runtime.stage_times import StageTime, replica_times, stages_of

TRACE_FILES = ("trace_measured.json", "gantt.png")  # what `--trace` writes into the run folder


@dataclass(frozen=True)
class RunReport:
    """A run's result, what was measured as an `Estimate`, and what the simulator predicted."""

    plan: Plan
    model: str
    result: RunResult
    measured: Estimate
    predicted: Estimate | None
    first_step: int
    trace_files: tuple[str, ...] = ()  # with `trace`: the measured Chrome trace and the two Gantt charts
    replicas: tuple[StageTime, ...] = ()  # per stage replica (one device each): busy time and share of the
    # step communicating, predicted and measured (`replica_times`)

    @property
    def stages(self) -> tuple[StageTime, ...]:
        """The same per stage, its replicas averaged (`stages_of`)."""
        return stages_of(self.plan, self.replicas)

    @property
    def relative_error(self) -> float | None:
        """measured / predicted - 1 of the step time; None without a prediction."""
        return prediction_error(self.measured.step_s, self.predicted.step_s if self.predicted else None)

    def summary(self, plan_path: str = "") -> dict[str, Any]:
        """The JSON object `hetplan run --json` prints."""
        r, m, p = self.result, self.measured, self.predicted
        return {
            "kind": "run", "plan": plan_path, "model": self.model, "workers": len(r.ranks), "steps": r.steps,
            "backend": r.ranks[0].get("backend") if r.ranks else None,  # torch.distributed's (`runtime.backend`)
            "first_step": self.first_step, "warmup": r.warmup, "measured_step_s": m.step_s,
            "measured_samples_per_s": m.samples_per_s if m.step_s > 0 else None,
            "predicted_step_s": p.step_s if p else None, "relative_error": self.relative_error,
            "measured_usd_per_1k_samples": m.usd_per_1k_samples if m.step_s > 0 else None,
            "predicted_usd_per_1k_samples": p.usd_per_1k_samples if p else None,
            "step_times_s": list(r.step_times_s), "losses": list(r.losses),
            "loss_first": r.losses[0] if r.losses else None, "loss_last": r.losses[-1] if r.losses else None,
            # the worker's tensors at their peak (CUDA's allocator, or on a CPU the rise of malloc's
            # memory in use plus the parameters: `worker._StageMemory`); the process's resident size
            "peak_mem_bytes": {f"{x['rank']}:{x['device']}": x["peak_mem_bytes"] for x in r.ranks},
            "rss_peak_bytes": {f"{x['rank']}:{x['device']}": x.get("rss_peak_bytes") for x in r.ranks},
            # on a CPU, what the math libraries keep between steps, left out of the above
            "library_bytes": {f"{x['rank']}:{x['device']}": x.get("library_bytes") for x in r.ranks},
            "predicted_peak_mem_bytes": dict(p.peak_mem_bytes) if p else None, "out_dir": r.out_dir,
            "trace_files": list(self.trace_files),
            "stages": [{**asdict(row), "devices": list(row.devices)} for row in self.stages],
            "replicas": [{**asdict(row), "devices": list(row.devices)} for row in self.replicas],
        }


def _blocks(graph: Graph | None, s: RunSettings) -> tuple[str, ...]:
    """The block classes the graph was profiled with (`profile --block-class`), unless given."""
    recorded = graph.meta.get("block_classes", "") if graph is not None else ""
    return tuple(s.block_classes) or tuple(c for c in str(recorded).split(",") if c)


def _sizes(graph: Graph | None, model: str, s: RunSettings, plan: Plan) -> tuple[int, int | None, str]:
    """Batch size (given, else the plan's, else the graph's, else the zoo's), sequence length and
    granularity (given, else the graph's)."""
    from hetplan.zoo import ZOO

    problem = None if s.batch_size is None else batch_size_problem(s.batch_size)
    if problem:
        raise HetplanError(f"--batch-size: {shown(s.batch_size)} {problem}")
    planned = plan.meta.get("batch_size")
    planned = planned if isinstance(planned, int) and not isinstance(planned, bool) and planned >= 1 else None
    batch_size = s.batch_size or planned or (graph.batch_size if graph is not None else None)
    if batch_size is None:
        batch_size = ZOO[model].default_batch_size if model in ZOO else None
    if batch_size is None:
        raise HetplanError("give --batch-size N (or --graph G, whose batch size is used)")
    seq_len = s.seq_len
    if seq_len is None and graph is not None:
        seq_len = int(graph.meta["seq_len"]) if "seq_len" in graph.meta else None
        if seq_len is None:  # graphs profiled before meta.seq_len existed say it in their input shapes
            shapes = re.search(r"input_ids\[(\d+)x(\d+)\]", str(graph.meta.get("inputs", "")))
            seq_len = int(shapes[2]) if shapes else None
    granularity = s.granularity or (graph.meta.get("granularity") if graph is not None else None) or "layer"
    if s.data == "text" and model in ZOO and not ZOO[model].language_model:
        raise HetplanError(f"--data text is for language models; {model} takes --data synthetic")
    return batch_size, seq_len, granularity


def _resume_step(plan: Plan, s: RunSettings, model: str, batch_size: int, seq_len: int | None) -> int:
    """The step of the checkpoint a resumed run starts at: the folder's latest whole one, written
    by any plan of the same training (`checkpoint.SAME_TRAINING`)."""
    from hetplan.runtime.checkpoint import SAME_TRAINING, latest_step, legacy, read_meta, step_dir

    if not s.resume:
        return 0
    if not s.checkpoint_dir:
        raise HetplanError("--resume needs --checkpoint-dir DIR")
    found = latest_step(s.checkpoint_dir)
    if found is None and legacy(s.checkpoint_dir):
        raise HetplanError(f"{s.checkpoint_dir}: the checkpoint is of an earlier hetplan (a file per stage, loadable "
                           "onto its own plan only); resume it with the version that wrote it, or start afresh "
                           "without --resume")
    if found is None:
        raise HetplanError(f"{s.checkpoint_dir}: no whole checkpoint (a step-N folder with every worker's file) "
                           "to resume from")
    if found >= s.steps:
        raise HetplanError(f"{s.checkpoint_dir}: the checkpoint is at step {found} already; ask for more steps "
                           f"(--steps {found + s.steps}) to go on")
    meta = read_meta(step_dir(s.checkpoint_dir, found)) or {}
    now = {"model": model, "optimizer": s.optimizer, "batch_size": batch_size, "seq_len": seq_len, "seed": s.seed,
           "data": s.data}
    differs = [k for k in SAME_TRAINING if meta.get(k) != now[k]]
    if differs:
        k = differs[0]
        raise HetplanError(f"{s.checkpoint_dir}: the checkpoint trained with {k} {meta.get(k)!r} and this run has "
                           f"{now[k]!r}; resume the same training (any plan, any cluster), or start afresh "
                           "without --resume")
    return found


def prepare_run(plan: Plan, cluster: Cluster, model: str, graph: Graph | None = None,
                settings: RunSettings = DEFAULTS, source: str | None = None) -> tuple[RunSpec, int]:
    """The workers' spec (RUN.json) and the step the run starts at; checks everything first
    (`source`: the plan's file, named in an invalid plan's message)."""
    s = settings
    batch_size, seq_len, granularity = _sizes(graph, model, s, plan)
    if graph is not None:
        validate_plan(plan, at_batch(graph, batch_size), cluster, source=source)
    first = _resume_step(plan, s, model, batch_size, seq_len)
    resolved = replace(s, batch_size=batch_size, seq_len=seq_len, granularity=granularity,
                       block_classes=_blocks(graph, s), resume_step=first)
    return run_spec(plan, cluster, model, resolved, graph=graph), first


def measured_estimate(result: RunResult, plan: Plan, cluster: Cluster, batch_size: int) -> Estimate:
    """What a run measured, as an Estimate: step time, samples per second, peak memory per device
    and the price of the step. Busy times and link traffic are not measured (left empty), nor the
    bubble (0.0 here means "not measured", not "none")."""
    step = result.measured_step_s
    return Estimate(step_s=step, samples_per_s=batch_size / step if step > 0 else 0.0, busy_s={},
                    peak_mem_bytes=result.peak_mem_bytes, bubble_fraction=0.0, link_bytes={},
                    usd_per_step=usd_per_step(cluster, plan.devices, step), feasible=True, method="measured")


def run_plan(plan: Plan, cluster: Cluster, model: str, graph: Graph | None = None,
             settings: RunSettings = DEFAULTS, progress=None, source: str | None = None) -> RunReport:
    """Train `model` under `plan` on `cluster`'s bound devices and compare with the prediction."""
    spec, first = prepare_run(plan, cluster, model, graph, settings, source)
    graph = at_batch(graph, spec.settings.batch_size) if graph is not None else None  # predicted at the batch it runs
    report = _report(spec, first, launch(spec, progress=progress), graph, cluster)
    keep(report, spec.settings.out_dir, graph, cluster, source)
    return report


def faithful_warnings(spec: RunSpec) -> list[str]:
    """Why this run's step differs from one process's on the whole batch (`hetplan.zoo.faithful`);
    a model that does not run on its example batch is said here, before any worker starts."""
    from hetplan.runtime.rank import spec_rows
    from hetplan.runtime.stages import check_names_modules
    from hetplan.zoo import load_model
    from hetplan.zoo.faithful import loss_parts, pipeline_warnings, switch_off_dropout

    s = spec.settings
    zm = load_model(spec.model, batch_size=s.batch_size, seq_len=s.seq_len, seed=s.seed)
    check_names_modules(zm.step, spec.plan)
    if spec.settings.no_dropout:
        switch_off_dropout(zm.step)
    parts = loss_parts(spec_rows(spec, spec.plan))
    try:
        return pipeline_warnings(zm.step, zm.batch, parts)
    except HetplanError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's model, failing on its own batch
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise HetplanError(f"{spec.model}: the model does not run on its example batch ({type(exc).__name__}: "
                           f"{first}); check the batch the factory returns against the model") from None


def _report(spec: RunSpec, first: int, result: RunResult, graph: Graph | None, cluster: Cluster) -> RunReport:
    """What a run measured beside what the simulator predicts for it (with a graph)."""
    predicted, sim_timeline = None, None
    if graph is not None:
        from hetplan.sim import simulate

        sim = simulate(graph, cluster, spec.plan, timeline=True)  # the stage table's prediction needs it
        predicted, sim_timeline = sim.estimate, sim.timeline
    measured = measured_estimate(result, spec.plan, cluster, spec.settings.batch_size)
    files = write_trace(result, spec, sim_timeline) if spec.settings.trace else ()
    return RunReport(plan=spec.plan, model=spec.model, result=result, measured=measured, predicted=predicted,
                     first_step=first, trace_files=files, replicas=replica_times(spec.plan, result, sim_timeline))


def write_for_elsewhere(spec: RunSpec, graph: Graph | None, cluster: Cluster) -> Path:
    """`hetplan run --dry-run`: the run folder for workers started by torchrun: run.json, and the
    cluster and graph (at the run's batch) that rank 0 predicts with at the end (`finish_elsewhere`)."""
    from hetplan.runtime.supervise import run_folder_lock

    with run_folder_lock(spec.settings.out_dir):  # never into the folder of a run still going
        path = write_spec(spec)
        serde.dump(cluster, spec.settings.out_dir / "cluster.json")
        if graph is not None:
            serde.dump(at_batch(graph, spec.settings.batch_size), spec.settings.out_dir / "graph.json")
        for name in (["graph.json"] if graph is None else []) + ["summary.json", *TRACE_FILES]:  # an earlier run's
            (spec.settings.out_dir / name).unlink(missing_ok=True)
    return path


def finish_elsewhere(spec: RunSpec) -> str:
    """For a run that torchrun started (`hetplan run --dry-run`): what the local launcher does at
    its end, done by rank 0 from the run folder (the cluster and graph `--dry-run` left there),
    so that `hetplan report DIR` draws it; returns the line to print."""
    from hetplan.io.clusters import load_cluster
    from hetplan.io.graphs import load_graph

    folder = spec.settings.out_dir
    cluster_file, graph_file = folder / "cluster.json", folder / "graph.json"
    result = read_result(folder, spec)
    if not cluster_file.is_file():
        return (f"hetplan: run finished: {result.measured_step_s * 1e3:.1f} ms a step; {folder}/result.json "
                "(no cluster.json beside run.json, so no summary for hetplan report)")
    graph = load_graph(graph_file) if graph_file.is_file() else None
    cluster = load_cluster(cluster_file)
    report = _report(spec, spec.settings.resume_step, result, graph, cluster)
    keep(report, folder, graph, cluster, str(folder / "run.json"))
    said = f"predicted {report.predicted.step_s * 1e3:.1f} ms, " if report.predicted else ""
    loss = f", loss {result.losses[0]:.4g} -> {result.losses[-1]:.4g}" if result.losses else ""
    return (f"hetplan: run finished: {report.measured.step_s * 1e3:.1f} ms a step measured ({said}"
            f"{result.steps} step{'s' if result.steps != 1 else ''}{loss}); `hetplan report {folder}` draws it")


def keep(report: RunReport, out_dir: Path, graph: Graph | None, cluster: Cluster, source: str | None) -> None:
    """What the run folder keeps beside run.json for `hetplan report` to draw it again: the summary
    (summary.json, a NaN loss as null) and the graph and cluster it was predicted on (graph.json,
    cluster.json). What an earlier run in the folder left and this one did not make goes."""
    summary = serde.finite_or_null(report.summary(source or ""))
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=1, allow_nan=False))
    serde.dump(cluster, out_dir / "cluster.json")
    if graph is not None:
        serde.dump(graph, out_dir / "graph.json")
    stale = (["graph.json"] if graph is None else []) + ([] if report.trace_files else list(TRACE_FILES))
    for name in stale:
        (out_dir / name).unlink(missing_ok=True)


def write_trace(result: RunResult, spec: RunSpec, predicted=None) -> tuple[str, ...]:
    """The last step's measured timeline as a Chrome trace (`trace_measured.json`) and a Gantt
    chart (`gantt.png`) with the simulator's timeline above it when there is one."""
    from hetplan.runtime.trace import measured_timeline
    from hetplan.timeline.gantt import draw_gantts, write_chrome_trace

    measured = measured_timeline(result, spec)
    trace = write_chrome_trace(measured, spec.settings.out_dir / TRACE_FILES[0])
    charts = [(measured, f"measured, last step ({measured.step_s * 1e3:.1f} ms)")]
    if predicted is not None:
        charts.insert(0, (predicted, f"predicted ({predicted.step_s * 1e3:.1f} ms)"))
    gantt = draw_gantts(charts, spec.settings.out_dir / TRACE_FILES[1])
    return str(trace), str(gantt)
