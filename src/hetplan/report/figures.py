"""The report page's figures, as plotly figures: the plan on the model's graph, the step's
timelines (predicted above measured, one time axis) and an RL planner's learning curve.

plotly draws them in the browser (zoom, hover) from data: nothing here draws by hand. The graph
is laid out in layers, one per topological generation (`networkx.topological_generations`), left
to right; within a layer, nodes keep the graph's order. Colours of the timelines are the Gantt
chart's (`hetplan.timeline.gantt.COLOURS`), so the PNG and the page read alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import networkx as nx
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from hetplan.cluster import Cluster
from hetplan.graph import Graph, Node
from hetplan.plan import Plan
from hetplan.timeline import ALLREDUCE, OPTIMIZER, Span, Timeline
from hetplan.timeline.gantt import COLOURS, NAMES, device_name
from hetplan.units import fmt_bytes, fmt_seconds

STAGE_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
                 "#CCB974", "#64B5CD")
CUT_COLOUR = "#C44E52"
FONT = MappingProxyType({"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", "size": 12})


WRAP = 36  # topological generations per row at most: a longer graph turns back under itself


def _layout(graph: Graph) -> dict[str, tuple[float, float]]:
    """(x, y) per node: x its topological generation, y its place in it, centred on the row's
    line. Past `WRAP` generations the graph continues on the next row down, right to left, then
    left to right again (as a snake: the row's last node sits just above the next row's first),
    the rows of equal length, so that resnet50's 169 generations fill five rows of 34 instead
    of one thin band."""
    g = nx.DiGraph()
    g.add_nodes_from(n.id for n in graph.nodes)
    g.add_edges_from((e.src, e.dst) for e in graph.edges)
    order = {n: k for k, n in enumerate(graph.topo_order)}
    layers = [sorted(layer, key=order.__getitem__) for layer in nx.topological_generations(g)]
    rows = -(-len(layers) // WRAP)
    tallest, width = max(len(layer) for layer in layers), -(-len(layers) // rows)  # rows of equal length
    pos = {}
    for x, layer in enumerate(layers):
        row, col = divmod(x, width)
        col = width - 1 - col if row % 2 else col
        for y, node in enumerate(layer):
            pos[node] = (float(col), (len(layer) - 1) / 2 - y - row * (tallest + 1.5))
    return pos


def _times(times: Mapping[str, float]) -> str:
    return ", ".join(f"{fmt_seconds(t)} on {dtype}" for dtype, t in times.items()) or "-"


def node_hover(node: Node, where: str) -> str:
    """What hovering over a node shows: its operator, place in the plan, times and sizes."""
    return (f"<b>{node.id}</b> ({node.op})<br>{where}<br>forward: {_times(node.fwd_s)}<br>"
            f"backward: {_times(node.bwd_s)}<br>parameters: {fmt_bytes(node.param_bytes)}<br>"
            f"activations kept: {fmt_bytes(node.act_bytes)}; output: {fmt_bytes(node.out_bytes)}")


def stage_label(plan: Plan, k: int, cluster: Cluster | None) -> str:
    """'stage k: dev (type), ...' as the legend and hovers name a stage."""
    return f"stage {k}: {', '.join(device_name(d, cluster) for d in plan.stages[k].devices)}"


def _edge_traces(graph: Graph, pos: Mapping[str, tuple[float, float]], stage_of: Mapping[str, int]) -> list:
    """Edges inside a stage in grey; edges between stages in red, with their bytes at the middle."""
    inside: tuple[list, list] = ([], [])
    cut: tuple[list, list] = ([], [])
    mids: tuple[list, list, list] = ([], [], [])
    for e in graph.edges:
        (x0, y0), (x1, y1) = pos[e.src], pos[e.dst]
        crosses = stage_of.get(e.src) != stage_of.get(e.dst)
        xs, ys = cut if crosses else inside
        xs += [x0, x1, None]
        ys += [y0, y1, None]
        if crosses:
            mids[0].append((x0 + x1) / 2)
            mids[1].append((y0 + y1) / 2)
            mids[2].append(fmt_bytes(e.bytes))
    traces = [go.Scatter(x=inside[0], y=inside[1], mode="lines", line={"color": "#B0B0B0", "width": 1},
                         hoverinfo="skip", showlegend=False)]
    if mids[0]:
        traces.append(go.Scatter(x=cut[0], y=cut[1], mode="lines", line={"color": CUT_COLOUR, "width": 2.5},
                                 hoverinfo="skip", name="edge between stages"))
        traces.append(go.Scatter(x=mids[0], y=mids[1], mode="text", text=mids[2], textposition="top center",
                                 textfont={"color": CUT_COLOUR, "size": 11}, hovertext=[f"sends {b} per batch"
                                                                                        for b in mids[2]],
                                 hoverinfo="text", showlegend=False))
    return traces


def graph_figure(graph: Graph, plan: Plan | None = None, cluster: Cluster | None = None) -> go.Figure:
    """The model's graph, nodes coloured by the plan's stage (legend: the stage's devices)."""
    pos = _layout(graph)
    stage_of = plan.stage_of() if plan is not None else {}
    groups: dict[int, list[Node]] = {}
    for node in graph.nodes:
        groups.setdefault(stage_of.get(node.id, -1), []).append(node)
    fig = go.Figure(_edge_traces(graph, pos, stage_of))
    for k in sorted(groups):
        name = stage_label(plan, k, cluster) if plan is not None and k >= 0 else "not in the plan"
        nodes = groups[k]
        fig.add_trace(go.Scatter(
            x=[pos[n.id][0] for n in nodes], y=[pos[n.id][1] for n in nodes], mode="markers", name=name,
            marker={"size": 10, "color": STAGE_COLOURS[k % len(STAGE_COLOURS)] if k >= 0 else "#FFFFFF",
                    "line": {"color": "#333333", "width": 0.8}},
            hovertext=[node_hover(n, name) for n in nodes], hoverinfo="text"))
    order = {n: i for i, n in enumerate(graph.topo_order)}
    for k, nodes in groups.items():  # each stage named at its first node (a printed page has no hover)
        if plan is not None and k >= 0:
            x, y = pos[min((n.id for n in nodes), key=order.__getitem__)]
            fig.add_annotation(x=x, y=y, text=f"<b>stage {k}</b>: {', '.join(plan.stages[k].devices)}",
                               showarrow=True, arrowhead=0, ax=0, ay=-28, xanchor="left",
                               font={"color": STAGE_COLOURS[k % len(STAGE_COLOURS)], "size": 12})
    low, high = min(y for _, y in pos.values()), max(y for _, y in pos.values())
    fig.update_layout(
        font=dict(FONT), height=int(200 + 30 * min(high - low, 40)), margin={"l": 10, "r": 10, "t": 30, "b": 10},
        plot_bgcolor="white", hovermode="closest", legend={"orientation": "h", "y": -0.02, "yanchor": "top"},
        xaxis={"visible": False}, yaxis={"visible": False, "range": [low - 0.6, high + 1.2]})
    return fig


def _rows(timeline: Timeline, labels: Mapping[str, str]) -> list[str]:
    return [labels.get(d, d) for d in timeline.devices] + [link.replace("->", " → ") for link in timeline.links]


def span_hover(s: Span) -> str:
    """What a bar is: the stage's action, or on a link what is sent from which stage to which."""
    if "->" in s.resource:
        sent = "activations" if s.kind == "F" else "gradients"
        return f"{sent} of micro-batch {s.microbatch}, stage {s.stage} → stage {s.to_stage}"
    if s.kind in (ALLREDUCE, OPTIMIZER):
        return f"stage {s.stage}: {NAMES[s.kind]}"
    return f"stage {s.stage}: {NAMES[s.kind].split(' / ')[0]} of micro-batch {s.microbatch}"


def _bar_traces(timeline: Timeline, labels: Mapping[str, str], seen: set[str]) -> list[go.Bar]:
    """One horizontal bar trace per kind of action (times in ms)."""
    traces = []
    for kind in COLOURS:
        spans = [s for s in timeline.spans if s.kind == kind]
        if not spans:
            continue
        rows = [labels.get(s.resource, s.resource.replace("->", " → ")) for s in spans]
        what = [span_hover(s) for s in spans]
        traces.append(go.Bar(
            y=rows, x=[(s.end_s - s.start_s) * 1e3 for s in spans], base=[s.start_s * 1e3 for s in spans],
            orientation="h", marker={"color": COLOURS[kind], "line": {"width": 0}}, name=NAMES[kind],
            legendgroup=kind, showlegend=kind not in seen,
            customdata=[[w, s.start_s * 1e3, (s.end_s - s.start_s) * 1e3] for w, s in zip(what, spans, strict=True)],
            hovertemplate="%{y}<br>%{customdata[0]}<br>start %{customdata[1]:.3f} ms, "
                          "takes %{customdata[2]:.3f} ms<extra></extra>"))
        seen.add(kind)
    return traces


def timeline_figure(charts: Sequence[tuple[Timeline, str]], labels: Mapping[str, str] | None = None) -> go.Figure:
    """Each (timeline, title) in a panel of its own, one above the other on one time axis."""
    labels = labels or {}
    heights = [len(_rows(t, labels)) for t, _ in charts]
    # every panel lists its rows in the first panel's order (a run's links come in the order received)
    first_seen = {row: k for k, row in enumerate(dict.fromkeys(r for t, _ in charts for r in _rows(t, labels)))}
    fig = make_subplots(rows=len(charts), cols=1, shared_xaxes=True, vertical_spacing=0.12 / len(charts),
                        subplot_titles=[title for _, title in charts], row_heights=[max(h, 1) for h in heights])
    fig.update_annotations(x=0.0, xanchor="left", font={"size": 13})  # the panels' titles, clear of the legend
    seen: set[str] = set()
    for k, (timeline, _) in enumerate(charts, start=1):
        for trace in _bar_traces(timeline, labels, seen):
            fig.add_trace(trace, row=k, col=1)
        fig.update_yaxes(categoryorder="array", autorange="reversed",
                         categoryarray=sorted(_rows(timeline, labels), key=first_seen.__getitem__),
                         row=k, col=1)
    fig.update_xaxes(title_text="time (ms)", row=len(charts), col=1, showgrid=True, gridcolor="#E5E5E5")
    plot_px = 60 + 28 * sum(heights) + 40 * len(charts)
    # the legend under the time axis, where no panel's title can meet it whatever the page's width
    fig.update_layout(font=dict(FONT), barmode="overlay", bargap=0.25, height=plot_px + 130, plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": 40, "b": 90},
                      legend={"orientation": "h", "y": -55 / plot_px, "yanchor": "top", "x": 0.0})
    return fig


def curve_figure(rows: Sequence[Sequence[float | None]], plan: Plan) -> go.Figure:
    """An RL planner's learning curve (`hetplan.report.curve` rows): the iteration's mean objective
    and the best plan that fits so far, log scale."""
    iters = [r[0] for r in rows]
    fig = go.Figure([
        go.Scatter(x=iters, y=[r[3] for r in rows], mode="lines", name="mean of the iteration's plans",
                   line={"width": 1, "color": "#4C72B0"}, opacity=0.7),
        go.Scatter(x=iters, y=[r[4] for r in rows], mode="lines", name="best so far (fits in memory)",
                   line={"width": 2.5, "color": "#DD8452"}),
    ])
    fig.update_layout(font=dict(FONT), height=360, margin={"l": 10, "r": 10, "t": 10, "b": 40}, plot_bgcolor="white",
                      xaxis={"title": "iteration", "gridcolor": "#E5E5E5"},
                      yaxis={"title": f"{plan.objective} (fast path; lower is better)", "type": "log",
                             "gridcolor": "#E5E5E5"},
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"})
    return fig
