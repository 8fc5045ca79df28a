"""The report page: one self-contained HTML file per plan, run, comparison or demo.

`ReportData` is what a page shows; `render_html` writes it. Everything is inlined: the figures as
plotly JSON, and plotly.js itself, gzip-compressed and base64-encoded (1.5 of its 4.8 MB), which
the page inflates with the browser's own `DecompressionStream` before drawing. So the file opens
without a network and a 200-node graph's page stays near 2 MB. The tables are HTML (sortable by a
click on a column's header, printable as they are); when the figures are drawn, the page marks
`<body data-rendered="yes">` ("failed", and a line on the page, when they cannot be).
"""

from __future__ import annotations

import base64
import gzip
import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import plotly.io

from hetplan._frozen import freeze
from hetplan.cluster import Cluster
from hetplan.graph import Graph
from hetplan.io.serde import atomic_write_text
from hetplan.plan import Plan, prediction_error
from hetplan.report import figures, tables
from hetplan.runtime.stage_times import StageTime
from hetplan.timeline import Timeline
from hetplan.timeline.gantt import device_labels
from hetplan.units import fmt_seconds


@dataclass(frozen=True)
class ReportData:
    """What one page shows. `kind`: plan, run, comparison or demo; `plan`: the plan drawn on the
    graph and whose step is drawn; `facts`: the headline figures as (name, value) pairs;
    `replicas`: per stage replica (one device each), busy time and communication share
    (`hetplan.runtime.stage_times.replica_times`); `comparison`: `Comparison.to_json()`; `runs`:
    predicted-against-measured rows (label, stages, devices, microbatches, predicted_step_s,
    measured_step_s, loss_last); `curve`: an RL planner's learning curve (`hetplan.report.curve`
    rows); `notes`: what the reader should know."""

    kind: str
    title: str
    source: str
    graph: Graph | None = None
    cluster: Cluster | None = None
    plan: Plan | None = None
    predicted: Timeline | None = None
    measured: Timeline | None = None
    facts: tuple[tuple[str, str], ...] = ()
    replicas: tuple[StageTime, ...] = ()
    comparison: Mapping[str, Any] | None = None
    runs: tuple[Mapping[str, Any], ...] = ()
    curve: tuple[tuple[float | None, ...], ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.comparison is not None:
            object.__setattr__(self, "comparison", freeze(self.comparison))
        object.__setattr__(self, "runs", tuple(freeze(r) for r in self.runs))


def _cell(text: str, value: float | str | None = None, cls: str = "") -> str:
    sort = "" if value is None else f' data-value="{html.escape(str(value))}"'
    klass = f' class="{cls}"' if cls else ""
    return f"<td{sort}{klass}>{html.escape(text)}</td>"


def _txt(x: Any) -> str:
    return "-" if x is None else str(x)


def _num(x: float | None, fmt: str) -> str:
    if not isinstance(x, int | float) or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, fmt)


def _secs(x: float | None) -> str:
    return fmt_seconds(x) if isinstance(x, int | float) and math.isfinite(x) else "-"


def _table(table_id: str, headers: Sequence[str], rows: Sequence[str], caption: str = "") -> str:
    head = "".join(f'<th title="sort by {html.escape(h)}">{html.escape(h)}</th>' for h in headers)
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    return (f'<table class="sortable" id="{table_id}">{cap}<thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


COMPARISON_HEADERS = ("planner", "stages", "devices", "micro-batches", "step", "samples/s", "$ per 1,000 samples",
                      "peak memory share", "fits", "planning time", "gain over best baseline")


def _comparison_row(r: Mapping[str, Any], best: str | None) -> str:
    if r.get("step_s") is None:
        return (f'<tr class="failed">{_cell(_txt(r.get("planner")))}'
                f'<td class="text" colspan="{len(COMPARISON_HEADERS) - 1}">'
                f'{html.escape(str(r.get("error") or "no plan"))}</td></tr>')
    is_best = r.get("planner") == best
    cells = [
        _cell(("★ " if is_best else "") + _txt(r.get("planner")), r.get("planner")),
        *(_cell(_txt(r.get(k)), r.get(k)) for k in ("stages", "devices", "microbatches")),
        _cell(_secs(r.get("step_s")), r.get("step_s")),
        _cell(_num(r.get("samples_per_s"), ",.1f"), r.get("samples_per_s")),
        _cell(_num(r.get("usd_per_1k_samples"), ".4g"), r.get("usd_per_1k_samples")),
        _cell(_num(r.get("peak_mem_share"), ".0%"), r.get("peak_mem_share")),
        _cell("yes" if r.get("fits_memory") else "no"), _cell(_secs(r.get("planning_s")), r.get("planning_s")),
        _cell(_num(r.get("gain_over_best_baseline"), "+.0%"), r.get("gain_over_best_baseline")),
    ]
    return f'<tr class="{"best" if is_best else ""}">{"".join(cells)}</tr>'


def comparison_table(comparison: Mapping[str, Any]) -> str:
    best = comparison.get("best")
    rows = [_comparison_row(r, best) for r in comparison.get("rows", ())]
    caption = (f"{comparison.get('graph', '')} on {comparison.get('cluster', '')}, objective: "
               f"{comparison.get('objective_is') or comparison.get('objective', '')}; ★ best")
    return _table("comparison", COMPARISON_HEADERS, rows, caption)


RUN_ROW_KEYS = ("label", "stages", "devices", "microbatches", "predicted_step_s", "measured_step_s", "loss_last")


def runs_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """A row per run (`RUN_ROW_KEYS`): predicted against measured step time."""
    rows = []
    for r in runs:
        p, m = r.get("predicted_step_s"), r.get("measured_step_s")
        error = prediction_error(m, p) if all(isinstance(v, int | float) for v in (m, p)) else None
        loss = r.get("loss_last")
        rows.append("<tr>" + "".join([
            *(_cell(_txt(r.get(k)), r.get(k)) for k in ("label", "stages", "devices", "microbatches")),
            _cell(_secs(p), p), _cell(_secs(m), m), _cell(_num(error, "+.0%"), error),
            _cell(_num(loss, ".3f"), loss)]) + "</tr>")
    return _table("runs", ("plan", "stages", "workers", "micro-batches", "predicted step", "measured step",
                           "error", "last loss"), rows, "predicted against measured step time")


def replicas_table(replicas: Sequence[StageTime]) -> str:
    rows = []
    for s in replicas:
        rows.append("<tr>" + "".join([
            _cell(str(s.stage), s.stage), _cell(", ".join(s.devices), cls="text"),
            _cell(_secs(s.predicted_busy_s), s.predicted_busy_s), _cell(_secs(s.measured_busy_s), s.measured_busy_s),
            _cell(_num(s.predicted_comm_share, ".0%"), s.predicted_comm_share),
            _cell(_num(s.measured_comm_share, ".0%"), s.measured_comm_share)]) + "</tr>")
    return _table("devices", ("stage", "device", "busy, predicted", "busy, measured", "communicating, predicted",
                             "communicating, measured"), rows,
                  "per device: compute busy time per step and the share of the step spent communicating (TAPP's "
                  "measure: receiving, waits included, and the all-reduce); measured: the median over the run's "
                  "steps after the warm-up")


EXPLAIN_TEXT_COLUMNS = ("source", "shape", "why it lost")


def _explain_row(rank: str, candidate: Mapping[str, Any], why: str) -> str:
    values = (0 if rank == "winner" else int(rank), None, None, candidate["microbatches"],
              *(candidate.get(k) for k in tables.EXPLAIN_TIMES), None)
    texts = tables.explain_cells(rank, candidate, why)
    cells = (_cell(text, value, "text" if col in EXPLAIN_TEXT_COLUMNS else "")
             for col, text, value in zip(tables.EXPLAIN_HEADERS, texts, values, strict=True))
    return f'<tr class="{"chosen" if rank == "winner" else ""}">{"".join(cells)}</tr>'


def explain_section(plan: Plan | None) -> str:
    """"Why this plan": where the planner's winner came from and why its best runners-up lost, as
    `hetplan plan --explain` prints it; empty for a plan whose planner records none."""
    explain = tables.explanation(plan) if plan is not None else None
    if explain is None:
        return ""
    lines = [tables.explain_headline(plan, explain), tables.explain_note(plan, explain)]
    rows = [_explain_row(*row) for row in tables.explained(explain)]
    table = _table("explain", tables.EXPLAIN_HEADERS, rows,
                   "the step as the planner's own model, the fast path and the event simulator put it")
    said = "".join(f"<p>{html.escape(line)}</p>" for line in lines if line)
    return f'<section id="section-explain"><h2>Why this plan</h2>{said}{table}</section>'


def _figure_json(fig) -> str:
    # "</" would end the <script> element the JSON sits in
    return plotly.io.to_json(fig, validate=False, pretty=False).replace("</", "<\\/")


def _plotly_bundle() -> str:
    from plotly.offline import get_plotlyjs

    return base64.b64encode(gzip.compress(get_plotlyjs().encode(), 6)).decode()


def _figures(data: ReportData) -> list[tuple[str, str, object]]:
    """(id, caption, figure) of each figure the data has."""
    out: list[tuple[str, str, object]] = []
    if data.graph is not None:
        out.append(("graph", "Each node is a piece of the model, coloured by its stage; red "
                    "edges cross stages and carry the bytes shown. Hover for a node's times and sizes; drag to zoom, "
                    "double-click to see it all.", figures.graph_figure(data.graph, data.plan, data.cluster)))
    charts = [(t, title) for t, title in ((data.predicted, "predicted (simulator)"),
                                          (data.measured, "measured (last step of the run)")) if t is not None]
    if charts:
        charts = [(t, f"{title}: step {fmt_seconds(t.step_s)}") for t, title in charts]
        out.append(("timeline", "One row per device, then one per link; hover a bar for its action, "
                    "micro-batch, start and duration.",
                    figures.timeline_figure(charts, device_labels(data.plan, data.cluster))))
    if data.curve and data.plan is not None:
        out.append(("curve", f"{data.plan.planner}'s learning curve: the objective of the plans it sampled, per "
                    "iteration, and of the best plan that fits so far.",
                    figures.curve_figure(data.curve, data.plan)))
    return out


SECTION_OF = MappingProxyType({"graph": "The plan on the model", "timeline": "The step", "curve": "The search"})


def _body(data: ReportData) -> str:
    parts = [f"<header><h1>{html.escape(data.title)}</h1><p class=source>{html.escape(data.source)}</p></header>"]
    if data.notes:
        parts.append("<ul class=notes>" + "".join(f"<li>{html.escape(n)}</li>" for n in data.notes) + "</ul>")
    if data.facts:
        parts.append("<dl class=facts>" + "".join(f"<div><dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd></div>"
                                                  for k, v in data.facts) + "</dl>")
    figures_ = _figures(data)
    for fig_id, caption, fig in figures_:
        parts.append(f'<section id="section-{fig_id}"><h2>{SECTION_OF[fig_id]}</h2><p>{html.escape(caption)}</p>'
                     f'<div class="figure" id="fig-{fig_id}" data-figure="data-{fig_id}"></div>'
                     f'<script type="application/json" id="data-{fig_id}">{_figure_json(fig)}</script>')
        if fig_id == "timeline" and data.replicas:
            parts.append(replicas_table(data.replicas))
        parts.append("</section>")
    if data.replicas and not any(fig_id == "timeline" for fig_id, _, _ in figures_):
        parts.append(f'<section id="section-devices"><h2>The step</h2>{replicas_table(data.replicas)}</section>')
    parts.append(explain_section(data.plan))  # empty without an explanation
    if data.comparison or data.runs:
        parts.append('<section id="section-comparison"><h2>The comparison</h2><p>Click a column\'s header to '
                     "sort by it.</p>")
        parts.append(runs_table(data.runs) if data.runs else "")
        parts.append(comparison_table(data.comparison) if data.comparison else "")
        parts.append("</section>")
    return "\n".join(parts)


STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; color: #222;
       margin: 24px auto; max-width: 1280px; padding: 0 16px; }
h1 { font-size: 22px; margin: 0; }
h2 { font-size: 18px; margin: 28px 0 6px; border-bottom: 1px solid #ddd; }
.source { color: #666; margin: 2px 0 12px; }
.notes { background: #fff8e1; border-left: 4px solid #f0b400; padding: 8px 8px 8px 28px; }
.facts { display: flex; flex-wrap: wrap; gap: 10px; margin: 12px 0; }
.facts div { border: 1px solid #ddd; border-radius: 6px; padding: 6px 12px; }
.facts dt { color: #666; font-size: 12px; }
.facts dd { margin: 0; font-size: 17px; font-weight: 600; }
table { border-collapse: collapse; margin: 10px 0; font-variant-numeric: tabular-nums; max-width: 100%; }
caption { text-align: left; color: #666; padding: 4px 0; }
th, td { border-bottom: 1px solid #e5e5e5; padding: 4px 10px; text-align: right; white-space: nowrap; }
th:first-child, td:first-child, td.text { text-align: left; }
td.text { white-space: normal; }
th { cursor: pointer; background: #f6f6f6; user-select: none; white-space: normal; vertical-align: bottom; }
tr.best td, tr.chosen td { font-weight: 600; background: #eef6ee; }
tr.failed td { color: #999; }
.figure { width: 100%; min-height: 120px; }
#status { color: #b00; }
@media print {
  body { max-width: none; margin: 0; }
  th { cursor: auto; }
  section, .figure { break-inside: avoid; }
}
"""

# Sorting a table by a click on its header; then inflating plotly.js and drawing each figure.
SCRIPT = """
function sortTable(th) {
  const body = th.closest('table').tBodies[0];
  const k = [...th.parentNode.children].indexOf(th);
  const up = th.dataset.dir !== 'up';
  th.dataset.dir = up ? 'up' : 'down';
  const key = row => {
    const cell = row.children[k];
    if (!cell) return '';
    const v = cell.dataset.value;
    return v !== undefined && v !== '' && !isNaN(+v) ? +v : (v ?? cell.textContent);
  };
  [...body.rows].sort((a, b) => (key(a) > key(b) ? 1 : key(a) < key(b) ? -1 : 0) * (up ? 1 : -1))
    .forEach(row => body.appendChild(row));
}
document.querySelectorAll('table.sortable th').forEach(th => th.addEventListener('click', () => sortTable(th)));

(async () => {
  try {
    const raw = atob(document.getElementById('plotly-gz').textContent.trim());
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    const gunzip = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
    const script = document.createElement('script');
    script.textContent = await new Response(gunzip).text();
    document.head.appendChild(script);
    for (const el of document.querySelectorAll('[data-figure]')) {
      const fig = JSON.parse(document.getElementById(el.dataset.figure).textContent);
      await Plotly.newPlot(el, fig.data, fig.layout, {responsive: true, displaylogo: false});
    }
    document.body.dataset.rendered = 'yes';
  } catch (e) {
    document.getElementById('status').textContent = 'The figures could not be drawn here: ' + e;
    document.body.dataset.rendered = 'failed';
    throw e;
  }
})();
"""


def render_html(data: ReportData) -> str:
    """The page as one string (no file or network is read when it is opened)."""
    return (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(data.title)}</title>"
            f'<meta name=viewport content="width=device-width,initial-scale=1"><style>{STYLE}</style></head>'
            f'<body data-kind="{data.kind}"><p id="status"></p>{_body(data)}'
            f'<script type="application/octet-stream" id="plotly-gz">{_plotly_bundle()}</script>'
            f"<script>{SCRIPT}</script></body></html>")


def write_page(data: ReportData, path: str | Path) -> Path:
    path = Path(path)
    atomic_write_text(path, render_html(data))
    return path


def facts_of(plan: Plan, measured_step_s: float | None = None) -> tuple[tuple[str, str], ...]:
    """The headline figures of a plan (and of its run)."""
    est = plan.predicted
    out = [("planner", plan.planner), ("stages", str(len(plan.stages))), ("devices", str(len(plan.devices))),
           ("micro-batches", f"{plan.microbatches} ({plan.schedule})"), ("precision", plan.precision)]
    for label, chosen in (("stages recomputing", [s.recomputes for s in plan.stages]),
                          ("stages sharding (ZeRO level)", [s.shard for s in plan.stages])):
        if any(chosen):
            out.append((label, ", ".join(str(k) if c is True else f"{k} ({c})" for k, c in enumerate(chosen) if c)))
    if est is not None:
        out += [("predicted step", fmt_seconds(est.step_s)), ("predicted samples/s", f"{est.samples_per_s:,.1f}"),
                ("$ per 1,000 samples", f"{est.usd_per_1k_samples:.4g}"), ("bubble", f"{est.bubble_fraction:.0%}"),
                ("fits in memory", "yes" if est.feasible else "no")]
    if measured_step_s:
        out.append(("measured step", fmt_seconds(measured_step_s)))
        error = prediction_error(measured_step_s, est.step_s if est is not None else None)
        if error is not None:
            out.append(("measured / predicted", f"{error:+.0%}"))
    return tuple(out)
