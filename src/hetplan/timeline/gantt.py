"""Gantt chart of a simulated (or measured) step, and the timeline as a Chrome trace.

One row per device (its compute) and one per directed link (its transfers); forward passes and
activations in blue, backward passes and gradients in orange, gradient all-reduce in grey; each
bar carries its micro-batch number when it is wide enough to hold it. The Chrome trace
(chrome://tracing or https://ui.perfetto.dev) holds the same spans for zooming in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from hetplan.cluster import Cluster
from hetplan.errors import InputError
from hetplan.io.serde import atomic_write, atomic_write_text
from hetplan.plan import Plan
from hetplan.timeline import ALLREDUCE, OPTIMIZER, Span, Timeline

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#8172B3", ALLREDUCE: "#9A9A9A",
           OPTIMIZER: "#55A868"}
NAMES = {"F": "forward / activations", "B": "backward / gradients", "I": "backward for inputs",
         "W": "backward for weights", ALLREDUCE: "gradient all-reduce", OPTIMIZER: "optimizer step"}


def device_name(device: str, cluster: Cluster | None) -> str:
    """'dev (type)', or the id alone where the cluster is not known."""
    return f"{device} ({cluster.device(device).type})" if cluster is not None and device in cluster.ids else device


def device_labels(plan: Plan | None, cluster: Cluster | None) -> dict[str, str]:
    """'dev (type) · stage k' per device of the plan, as the timelines' rows name them ('stages
    0, 2' for a device that holds several): the Gantt chart's and the report page's."""
    if plan is None:
        return {}
    stages: dict[str, list[int]] = {}
    for k, stage in enumerate(plan.stages):
        for d in stage.devices:
            stages.setdefault(d, []).append(k)
    return {d: f"{device_name(d, cluster)} · stage{'s' if len(ks) > 1 else ''} {', '.join(map(str, ks))}"
            for d, ks in stages.items()}


def _rows(timeline: Timeline, device_labels: Mapping[str, str] | None) -> list[tuple[str, str]]:
    labels = device_labels or {}
    rows = [(d, labels.get(d, d)) for d in timeline.devices]
    rows += [(link, link.replace("->", " → ")) for link in timeline.links]
    return rows


def draw_gantt(timeline: Timeline, path: str | Path, title: str = "",
               device_labels: Mapping[str, str] | None = None) -> Path:
    """Write the chart as an image (PNG, SVG or PDF by the file's suffix)."""
    return draw_gantts([(timeline, title)], path, device_labels)


def draw_gantts(charts: list[tuple[Timeline, str]], path: str | Path,
                device_labels: Mapping[str, str] | None = None) -> Path:
    """Several charts one above the other on one time axis (a prediction above a run)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise InputError(f"{path}: the chart is written as .png, .svg or .pdf; name the file so")
    heights = [len(_rows(t, device_labels)) for t, _ in charts]
    step_s = max(max(t.step_s for t, _ in charts), 1e-12)
    fig = Figure(figsize=(15.0, sum(1.2 + 0.45 * h for h in heights)), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(charts), 1, squeeze=False, sharex=True, height_ratios=[1.2 + 0.45 * h for h in heights])
    for ax, (timeline, title) in zip(axes[:, 0], charts, strict=True):
        _draw_axis(ax, timeline, title, device_labels, step_s, 15.0)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=path.suffix[1:].lower()), "the chart")
    return path


def _draw_axis(ax, timeline: Timeline, title: str, device_labels: Mapping[str, str] | None, step_s: float,
               width_in: float) -> None:
    from matplotlib.patches import Patch

    rows = _rows(timeline, device_labels)
    index = {key: k for k, (key, _) in enumerate(rows)}
    scale, unit = (1e3, "ms") if step_s < 10 else (1.0, "s")
    span_max = step_s * scale
    # a label fits when the bar is wider than about two characters at this size
    min_label = span_max * 0.22 / width_in
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for s in timeline.spans:
        start, width = s.start_s * scale, (s.end_s - s.start_s) * scale
        bars.setdefault((index[s.resource], s.kind), []).append((start, width))
        if s.kind not in (ALLREDUCE, OPTIMIZER) and width >= min_label:
            ax.text(start + width / 2, index[s.resource], str(s.microbatch), ha="center", va="center",
                    fontsize=7, color="white", clip_on=True)
    for (row, kind), xs in bars.items():
        is_link = row >= len(timeline.devices)
        ax.broken_barh(xs, (row - (0.3 if is_link else 0.4), 0.6 if is_link else 0.8),
                       facecolors=COLOURS[kind], edgecolor="white", linewidth=0.0 if is_link else 0.4,
                       alpha=0.75 if is_link else 1.0)
    ax.set_yticks(range(len(rows)), [label for _, label in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    if timeline.links:
        ax.axhline(len(timeline.devices) - 0.5, color="#444444", linewidth=0.8)
    ax.set_xlim(0, span_max)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    kinds = [k for k in COLOURS if any(s.kind == k for s in timeline.spans)]
    ax.legend(handles=[Patch(color=COLOURS[k], label=NAMES[k]) for k in kinds], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), ncol=len(kinds), frameon=False, fontsize=8)
    if title:
        ax.set_title(title, fontsize=10, loc="left")


def chrome_trace(timeline: Timeline) -> dict:
    """The timeline in the Chrome trace event format (times in microseconds)."""
    rows = _rows(timeline, None)
    events: list[dict] = [{"ph": "M", "pid": 0, "tid": k, "name": "thread_name", "args": {"name": label}}
                          for k, (_, label) in enumerate(rows)]
    index = {key: k for k, (key, _) in enumerate(rows)}
    for s in timeline.spans:
        events.append({"ph": "X", "pid": 0, "tid": index[s.resource], "name": s.label,
                       "cat": NAMES[s.kind], "ts": s.start_s * 1e6, "dur": (s.end_s - s.start_s) * 1e6,
                       "args": {"stage": s.stage, "microbatch": s.microbatch, "to_stage": s.to_stage}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def timeline_from_trace(trace: dict, source: str = "<trace>") -> Timeline:
    """The Timeline a `chrome_trace` holds (a row named "a → b" is the link a->b); the inverse of
    `chrome_trace`, so that a run's measured step can be drawn again (`hetplan report`)."""
    kinds = {name: kind for kind, name in NAMES.items()}
    try:
        rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
        spans = [Span(rows[e["tid"]].replace(" → ", "->"), kinds[e["cat"]], int(e["args"]["stage"]),
                      int(e["args"]["microbatch"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
                      int(e["args"].get("to_stage", -1)))
                 for e in trace["traceEvents"] if e.get("ph") == "X"]
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{source}: not a trace hetplan wrote ({type(exc).__name__}: {exc})") from None
    names = [rows[t].replace(" → ", "->") for t in sorted(rows)]
    return Timeline(tuple(spans), tuple(n for n in names if "->" not in n), tuple(n for n in names if "->" in n),
                    max((s.end_s for s in spans), default=0.0))


def write_chrome_trace(timeline: Timeline, path: str | Path) -> Path:
    path = Path(path)
    atomic_write_text(path, json.dumps(chrome_trace(timeline)))
    return path
