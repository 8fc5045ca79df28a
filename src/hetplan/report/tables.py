"""Rich tables for people at a terminal."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.cost.tensor import tp_times_s
from hetplan.graph import Graph
from hetplan.plan import Estimate, Plan
from hetplan.report.summary import cluster_summary, graph_summary
from hetplan.units import fmt_bandwidth, fmt_bytes, fmt_flops, fmt_seconds

MAX_MATRIX_DEVICES = 16


def show_graph(console: Console, graph: Graph) -> None:
    s = graph_summary(graph)
    table = Table(title=f"graph {graph.name}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("source", graph.source or "-")
    table.add_row("nodes / edges", f"{s['nodes']} / {s['edges']}")
    table.add_row("batch size", str(graph.batch_size))
    table.add_row("profiled on", ", ".join(graph.device_types))
    table.add_row("forward (sum of nodes)", fmt_seconds(s["fwd_s_total"]))
    table.add_row("backward (sum of nodes)", fmt_seconds(s["bwd_s_total"]))
    table.add_row("parameters", fmt_bytes(s["param_bytes_total"]))
    table.add_row("stashed activations", fmt_bytes(s["act_bytes_total"]))
    big = s["largest_activation"]
    table.add_row("largest activation", f"{fmt_bytes(big['bytes'])} ({big['node']}, {big['op']})")
    inputs = [n for n in graph.nodes if n.is_input]
    if inputs:
        load = sum(n.fwd_s[graph.profiled_on] for n in inputs)
        loading = f" (data loading {fmt_seconds(load)})" if load > 0 else ""
        table.add_row("input nodes", f"{', '.join(n.id for n in inputs)}{loading}")
    table.add_row("sources / sinks", f"{len(graph.sources)} / {len(graph.sinks)}")
    table.add_row("widest fan-out", str(s["max_out_degree"]))
    skips = graph.skip_edges
    if skips:
        shown = ", ".join(f"{a} -> {b}" for a, b in skips[:3])
        table.add_row("skip edges", f"{len(skips)} (residual, skip or branch joins), e.g. {shown}")
    table.add_row("ops", ", ".join(f"{op} x{k}" for op, k in list(s["ops"].items())[:8]))
    console.print(table)


def show_cluster(console: Console, cluster: Cluster) -> None:
    s = cluster_summary(cluster)
    table = Table(title=f"cluster {cluster.name}: {len(cluster.devices)} devices on "
                        f"{len(cluster.hosts)} host{'s' if len(cluster.hosts) > 1 else ''}",
                  title_justify="left")
    for col in ("id", "type", "host", "memory", "fp32", "fp16/bf16", "mem bw", "$/h", "binding"):
        table.add_column(col, justify="right" if col in ("memory", "fp32", "fp16/bf16", "mem bw", "$/h") else "left")
    for d in s["devices"]:
        table.add_row(d["id"], d["type"], d["host"], fmt_bytes(d["mem_bytes"]), fmt_flops(d["peak_flops"]),
                      fmt_flops(d["peak_flops_fp16"]), fmt_bandwidth(d["mem_bw_Bps"]),
                      f"{d['usd_per_hour']:.2f}", d["binding"] or "-")
    console.print(table)
    console.print(f"total price: ${s['usd_per_hour_total']:.2f}/h; links: inside a host "
                  f"{fmt_bandwidth(cluster.intra_host.bandwidth_Bps)}, "
                  f"{fmt_seconds(cluster.intra_host.latency_s)}; between hosts "
                  f"{fmt_bandwidth(cluster.inter_host.bandwidth_Bps)}, {fmt_seconds(cluster.inter_host.latency_s)}")
    if len(cluster.hosts) > 1:
        console.print("hosts' network interfaces: " + ", ".join(f"{h} {fmt_bandwidth(cluster.nic_Bps(h))}"
                                                                  for h in cluster.hosts))
    cal = cluster.calibration
    console.print(f"calibrated: {cal.source}; all-reduce curves for "
                  f"{', '.join(str(c.replicas) for c in cal.allreduce) or 'no'} workers; CPU workers side by side: "
                  f"{', '.join(f'{k} x{v:.2f}' for k, v in cal.corun_slowdown) or '-'}" if cal is not None
                  else "not calibrated (`hetplan calibrate` measures links, all-reduces, optimizer steps and the "
                       "runtime's costs on the machine)")
    if len(cluster.devices) <= MAX_MATRIX_DEVICES:
        matrix = Table(title="bandwidth between devices", title_justify="left")
        matrix.add_column("")
        for d in cluster.ids:
            matrix.add_column(d, justify="right")
        for a in cluster.ids:
            matrix.add_row(a, *("-" if a == b else fmt_bandwidth(cluster.link(a, b).bandwidth_Bps)
                                for b in cluster.ids))
        console.print(matrix)


def show_plan(console: Console, plan: Plan, graph: Graph | None = None, cluster: Cluster | None = None) -> None:
    title = (f"plan by {plan.planner}: {len(plan.stages)} stage{'s' if len(plan.stages) > 1 else ''}, "
             f"{plan.microbatches} micro-batch{'es' if plan.microbatches > 1 else ''}, {plan.schedule}, "
             f"{plan.precision}")
    table = Table(title=title, title_justify="left")
    for col in ("stage", "devices", "nodes", "first .. last"):
        table.add_column(col)
    scored = graph is not None and cluster is not None
    if scored:
        cm = CostModel(graph, cluster)
        table.add_column("fwd+bwd", justify="right")
        table.add_column("memory", justify="right")
    for i, stage in enumerate(plan.stages):
        marks = [word for word, on in ((tp_mark(stage), stage.tp > 1), (_recompute_mark(stage), stage.recomputes),
                                       (f"zero-{stage.shard}", stage.shard)) if on]
        row = [f"{i} ({', '.join(marks)})" if marks else str(i), _devices_cell(stage.all_devices, cluster),
               str(len(stage.nodes)),
               f"{stage.nodes[0]} .. {stage.nodes[-1]}"]
        if scored:
            row.append(_per_replica([fmt_seconds(sum(tp_times_s(cm, stage.nodes, cluster.device(g[0]).type, g)[:2]))
                                     for g in stage.groups]))
            memory = cm.stage_replicas_memory_bytes(plan, i)
            row.append(_per_replica([fmt_bytes(memory[d]) for d in stage.devices]))
        table.add_row(*row)
    console.print(table)
    if plan.predicted is not None:
        show_estimate(console, plan.predicted)
    show_search(console, plan)


def tp_mark(stage) -> str:
    """`tp2` for replicas of two devices each; `tp 1,1,4` where they differ; ` sp` after it where
    the groups are sequence-parallel too."""
    sp = " sp" if stage.sequence_parallel else ""
    if len(set(stage.degrees)) == 1:
        return f"tp{stage.tp}{sp}"
    return "tp " + ",".join(map(str, stage.degrees)) + sp


def _recompute_mark(stage) -> str:
    """`recompute` for a stage rebuilt whole, `recompute per block` for one rebuilt a node at a time,
    `recompute selective` for one whose nodes keep their products' outputs."""
    return {"block": "recompute per block", "selective": "recompute selective"}.get(stage.recompute, "recompute")


def _devices_cell(devices: tuple[str, ...], cluster: Cluster | None) -> str:
    """A stage's devices: all of them, or past 4 their count, types and first and last."""
    if len(devices) <= 4:
        return ", ".join(devices)
    if cluster is None:
        return f"{len(devices)} devices: {devices[0]} .. {devices[-1]}"
    types = sorted({cluster.device(d).type for d in devices})
    return f"{len(devices)} x {', '.join(types)}: {devices[0]} .. {devices[-1]}"


def _per_replica(cells: list[str]) -> str:
    """One value per replica, runs of equal values written once with their count (`157 s x32`)."""
    out: list[list] = []
    for c in cells:
        if out and out[-1][0] == c:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return " / ".join(c if n == 1 else f"{c} x{n}" for c, n in out)


def show_search(console: Console, plan: Plan) -> None:
    """What an RL planner's run did, in one or two lines (nothing for other planners)."""
    body = plan.meta.get(plan.planner) if plan.meta else None
    if not body or "iterations" not in body:
        return
    mode = "paper's set-up (--faithful)" if body.get("faithful") else f"warm start from {body.get('warm_start')}"
    console.print(f"search: {body['iterations']:,} iterations in {body['seconds']:.1f} s, "
                  f"{body['fast_evaluations']:,} plans scored by the fast path, {body['event_simulations']} "
                  f"simulated; {mode}")
    if body.get("skipped_updates"):
        console.print(f"  {body['skipped_updates']} policy updates skipped: their loss or gradients were not finite "
                      "(the learning rate was halved each time)")
    if body.get("returned") == "warm start":
        console.print(f"  returned the warm start: nothing {plan.planner} sampled was better "
                      "(a larger --budget-s or --max-iters searches longer)")


EXPLAIN_HEADERS = ("rank", "source", "shape", "micro-batches", "model", "fast path", "simulated", "why it lost")
EXPLAIN_TIMES = ("model_s", "fast_s", "sim_s")  # the candidate's keys the three time columns show
EXPLAIN_NUMBERS = ("micro-batches", "model", "fast path", "simulated")
EXPLAIN_HEADERS_FOLDED = {"micro-batches": "micro-\nbatches", "fast path": "fast\npath"}  # fits 120 columns


def explanation(plan: Plan) -> Mapping[str, Any] | None:
    """Why a planner chose its plan, where it records it: under its own entry of the plan's meta
    (dp's: `hetplan.planners.candidates`); None for the planners that record none, and for one
    without what the table reads (meta is free JSON: a plan file edited by hand still loads)."""
    body = plan.meta.get(plan.planner) if plan.meta else None
    explain = body.get("explain") if isinstance(body, Mapping) else None
    return explain if _well_formed(explain) else None


def _well_formed(explain: Any) -> bool:
    if not isinstance(explain, Mapping) or not {"winner", "runners_up", "candidates", "simulated"} <= explain.keys():
        return False
    winner, others = explain["winner"], explain["runners_up"]
    if not isinstance(others, Sequence) or not all(isinstance(c, Mapping) and "lost" in c for c in others):
        return False
    return all(isinstance(c, Mapping) and {"source", "shape", "microbatches"} <= c.keys() for c in (winner, *others))


def explained(explain: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], str]]:
    """(rank, candidate, why it lost) of the winner ("winner", "chosen"), then of each runner-up."""
    return [("winner", explain["winner"], "chosen"),
            *((str(k), c, c["lost"]) for k, c in enumerate(explain["runners_up"], 1))]


def explain_cells(rank: str, candidate: Mapping[str, Any], why: str) -> tuple[str, ...]:
    """One row of the table, in EXPLAIN_HEADERS' order."""
    times = (candidate.get(k) for k in EXPLAIN_TIMES)
    return (rank, candidate["source"], candidate["shape"], str(candidate["microbatches"]),
            *(fmt_seconds(t) if isinstance(t, int | float) and math.isfinite(t) else "-" for t in times), why)


def explain_headline(plan: Plan, explain: Mapping[str, Any]) -> str:
    return f"{plan.planner} compared {explain['candidates']} candidates, simulated {explain['simulated']}"


def explain_note(plan: Plan, explain: Mapping[str, Any]) -> str | None:
    """A line when the plan's simulated step is not its winner's: the schedule, recomputation or
    sharding the options asked for are applied after the planner chose (`make_plan`)."""
    sim_s, est = explain["winner"].get("sim_s"), plan.predicted
    if est is None or not isinstance(sim_s, int | float) or math.isclose(est.step_s, sim_s, rel_tol=1e-3):
        return None
    return (f"the schedule, recomputation or sharding asked for changed the winner after {plan.planner} chose it: "
            f"{fmt_seconds(est.step_s)} a step, not {fmt_seconds(sim_s)}")


def no_explanation(plan: Plan) -> str:
    return f"the {plan.planner} planner records no explanation; dp does"


def show_explanation(console: Console, plan: Plan) -> None:
    """Where the plan came from and why the best others lost, or a line saying the planner
    records none."""
    explain = explanation(plan)
    if explain is None:
        console.print(no_explanation(plan))
        return
    console.print(explain_headline(plan, explain))
    table = Table(title="why this plan", title_justify="left")
    for col in EXPLAIN_HEADERS:
        table.add_column(EXPLAIN_HEADERS_FOLDED.get(col, col),
                         justify="right" if col in EXPLAIN_NUMBERS else "left")
    for rank, candidate, why in explained(explain):
        # shapes read "2 x [t4-16gb x1]": text, not rich markup
        table.add_row(*map(escape, explain_cells(rank, candidate, why)), style="bold" if rank == "winner" else None)
    console.print(table)
    note = explain_note(plan, explain)
    if note:
        console.print(escape(note))


def show_estimate(console: Console, est: Estimate) -> None:
    how = {"event": "event-driven simulator", "fast": "batched fast path",
           "measured": "measured"}.get(est.method, est.method)
    console.print(f"estimate ({how}):")
    console.print(f"  step {fmt_seconds(est.step_s)}, {est.samples_per_s:,.1f} samples/s, "
                  f"bubble {est.bubble_fraction:.0%}, ${est.usd_per_step:.3g} per step "
                  f"(${est.usd_per_1k_samples:.3g} per 1,000 samples)")
    if est.bottleneck_s > 0:
        console.print(f"  steady state (PipeDream's measure, never flushing): {fmt_seconds(est.bottleneck_s)} per "
                      "batch at its slowest stage or cut")
    peak = est.peak_link
    if peak is not None and peak[1] > 0:
        busy = est.link_busy_s.get(peak[0], 0.0)
        console.print(f"  busiest link {peak[0]}: {fmt_bytes(peak[1])} per step, busy {busy / est.step_s:.0%} "
                      "of the step")
    if est.feasible:
        console.print("  feasible: yes (fits in memory)")
    else:
        console.print("  [bold red]feasible: no[/]")
        for v in est.violations:
            console.print(f"  - {v}")


def show_simulation(console: Console, plan: Plan, cluster: Cluster, est: Estimate) -> None:
    """Per device and per link: what the step does with it."""
    step = est.step_s or 1.0
    stages: dict[str, list[str]] = {}
    for i, stage in enumerate(plan.stages):
        for d in stage.devices:
            stages.setdefault(d, []).append(str(i))
    table = Table(title=f"simulated step of a {plan.planner} plan: {len(plan.stages)} stages, "
                        f"{plan.microbatches} micro-batches, {plan.schedule}", title_justify="left")
    for col, justify in (("device", "left"), ("type", "left"), ("stage", "left"), ("busy", "right"),
                         ("utilisation", "right"), ("peak memory", "right"), ("of", "right")):
        table.add_column(col, justify=justify)
    rows: list[list] = []  # devices in a row whose cells read the same are one row
    for d in plan.devices:
        device = cluster.device(d)
        need = est.peak_mem_bytes.get(d, 0)
        mem = fmt_bytes(need) if need <= device.mem_bytes else f"[bold red]{fmt_bytes(need)}[/]"
        busy = est.busy_s.get(d, 0.0)
        cells = (device.type, ", ".join(stages[d]), fmt_seconds(busy), f"{busy / step:.0%}", mem,
                 fmt_bytes(device.mem_bytes))
        if rows and rows[-1][2] == cells:
            rows[-1][1] = d
        else:
            rows.append([d, d, cells])
    for first, last, cells in rows:
        table.add_row(first if first == last else f"{first} .. {last}", *cells)
    console.print(table)
    if est.link_bytes:
        links = Table(title="links", title_justify="left")
        for col in ("link", "bytes per step", "busy", "utilisation"):
            links.add_column(col, justify="left" if col == "link" else "right")
        busiest = sorted(est.link_bytes, key=lambda k: -est.link_busy_s.get(k, 0.0))
        for key in busiest[:SHOWN_LINKS] if len(busiest) > SHOWN_LINKS + 1 else busiest:
            busy = est.link_busy_s.get(key, 0.0)
            links.add_row(key, fmt_bytes(est.link_bytes[key]), fmt_seconds(busy), f"{busy / step:.0%}")
        if len(busiest) > SHOWN_LINKS + 1:
            links.add_row(f"... {len(busiest) - SHOWN_LINKS} more", "", "", "")
        console.print(links)
    show_estimate(console, est)


SHOWN_LINKS = 16  # the busiest links a simulation's table lists
# Columns of `hetplan compare` that a narrow terminal goes without, least useful first.
OPTIONAL_COMPARE_COLUMNS = ("planning", "memory", "vs baselines", "stages/devices", "m")
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
_PRICE_UNITS = (("1k", "thousand", 1e3), ("1M", "million", 1e6), ("1G", "billion", 1e9))


def show_comparison(console: Console, result, graph: Graph, cluster: Cluster) -> None:
    """One row per planner; the best by the objective marked. Narrow terminals get a compact
    table without the least useful columns rather than cells cut short."""
    from hetplan.planners import BASELINES, objectives

    ests = [r.plan.predicted for r in result.rows if r.plan is not None and r.plan.predicted is not None]
    step_unit = _time_unit(max((e.step_s for e in ests), default=1.0))
    price_unit = _price_unit(max((e.usd_per_1k_samples / 1e3 for e in ests), default=0.0))
    columns = _comparison_columns(step_unit[0], price_unit[0])
    rows = [_comparison_row(result, r, step_unit[1], price_unit[2]) for r in result.rows]
    title = f"{graph.name} on {cluster.name}: {objectives.describe(result.options)}, {result.options.schedule}"
    table, hidden = _fit_table(console, title, columns, rows)
    console.print(table)
    for r in result.rows:
        if r.plan is None or r.plan.predicted is None:
            console.print(r.error if r.error and r.error.startswith(f"{r.planner}:") else f"{r.planner}: {r.error}")
    if result.best is None:
        console.print("[bold red]no planner found a feasible plan[/]")
    else:
        notes = [f"best: {result.best.planner} (*)", f"$/{price_unit[0]}: dollars per {price_unit[1]} samples"]
        notes += [note for col, note in (("m", "m: micro-batches"), ("memory", "memory: the fullest device's share"),
                                         ("vs baselines", "vs baselines: how much lower the objective is than the "
                                                          f"best of {', '.join(BASELINES)}")) if col not in hidden]
        console.print("; ".join(notes))
    if hidden:
        console.print(f"left out at this width: {', '.join(hidden)} (a wider terminal or --json shows them)")


def show_replay(console: Console, runs, title: str) -> None:
    """One row per policy of `hetplan replay` (`availability.PolicyRun`)."""
    columns = [("policy", "policy", "left"), ("samples", "samples (M)", "right"), ("usd", "$", "right"),
               ("per", "$ per M samples", "right"), ("lost", "lost to changes", "right"),
               ("stopped", "stopped", "right"), ("restarts", "restarts", "right")]
    rows = [{"policy": r.policy, "samples": f"{r.samples / 1e6:,.2f}", "usd": f"{r.usd:,.0f}",
             "per": _num(r.usd_per_million_samples), "lost": fmt_seconds(r.lost_s),
             "stopped": fmt_seconds(r.stopped_s), "restarts": str(r.restarts)} for r in runs]
    console.print(_table(title, False, columns, rows))


def _time_unit(seconds: float) -> tuple[str, float]:
    """The unit of the longest time, for a column that shows its unit once, in the header."""
    return next((u for u in _TIME_UNITS if seconds >= u[1]), _TIME_UNITS[-1])


def _price_unit(usd_per_sample: float) -> tuple[str, str, float]:
    """Price per 1k, 1M or 1G samples: the fewest samples that bring the dearest plan to a cent,
    so that small models' prices are not a row of zeros after the point (free clusters: per 1k)."""
    return next((u for u in _PRICE_UNITS if usd_per_sample * u[2] >= 0.01 or usd_per_sample == 0), _PRICE_UNITS[-1])


def _num(x: float) -> str:
    """Three significant digits, trailing zeros kept so that 0.100 does not look rounder than 0.104;
    from 100 up every digit of the integer part, where .3g would switch to an exponent at 1,000."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:#.3g}"


def _comparison_columns(step_unit: str, price_unit: str) -> list[tuple[str, str, str]]:
    """(name, header, justify) per column; units sit in the header, which keeps the cells narrow."""
    return [("planner", "planner", "left"), ("stages/devices", "stages/\ndevices", "right"), ("m", "m", "right"),
            ("step", f"step\n{step_unit}", "right"), ("samples/s", "samples\nper s", "right"),
            ("price", f"$/{price_unit}", "right"), ("memory", "memory", "right"), ("feasible", "feasible", "left"),
            ("planning", "planning", "right"), ("vs baselines", "vs\nbaselines", "right")]


def _comparison_row(result, r, step_scale: float, samples_per_usd: float) -> dict[str, str]:
    mark = "*" if r is result.best else " "
    if r.plan is None or r.plan.predicted is None:
        return {"planner": f"{mark} {r.planner}", "feasible": "[red]no plan[/]"}
    est = r.plan.predicted
    gain = result.gain_over_baselines(r)
    feasible = "yes" if math.isfinite(r.value) else "[red]no: memory[/]" if not est.feasible else "[red]no: slow[/]"
    cells = {"planner": f"{mark} {r.planner}", "stages/devices": f"{len(r.plan.stages)} / {len(r.plan.devices)}",
             "m": str(r.plan.microbatches), "step": _num(est.step_s / step_scale),
             "samples/s": _num(est.samples_per_s), "price": _num(est.usd_per_1k_samples / 1e3 * samples_per_usd),
             "memory": f"{r.plan.meta.get('peak_mem_share', 0.0):.0%}", "feasible": feasible,
             "planning": fmt_seconds(r.planning_s or 0.0), "vs baselines": "-" if gain is None else f"{gain:+.1%}"}
    return {k: f"[bold]{v}[/]" for k, v in cells.items()} if mark == "*" else cells


def _fit_table(console: Console, title: str, columns: list[tuple[str, str, str]],
               rows: list[dict[str, str]]) -> tuple[Table, tuple[str, ...]]:
    """The fullest table that fits the console: the usual boxed one, else a compact one without
    borders, which then leaves out optional columns one by one. Past the narrowest, rich folds
    cells onto a second line, which keeps every digit, where its default would cut them."""
    tries = [(False, ())] + [(True, OPTIONAL_COMPARE_COLUMNS[:k]) for k in range(len(OPTIONAL_COMPARE_COLUMNS) + 1)]
    for compact, hidden in tries:
        table = _table(title, compact, [c for c in columns if c[0] not in hidden], rows)
        # measured as if the console were unbounded: rich clamps a measurement to the console
        if console.measure(table, options=console.options.update_width(10_000)).maximum <= console.width:
            break
    return table, hidden


def _table(title: str, compact: bool, columns: list[tuple[str, str, str]], rows: list[dict[str, str]]) -> Table:
    style = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "collapse_padding": True} if compact else {}
    table = Table(title=title, title_justify="left", **style)
    for _, header, justify in columns:
        table.add_column(header, justify=justify, vertical="bottom", overflow="fold")
    for row in rows:
        table.add_row(*(row.get(name, "-") for name, _, _ in columns))
    return table


def show_run(console: Console, s: dict, plan: Plan) -> None:
    """Measured against predicted, per run."""
    table = Table(title=f"{s['model']}: {len(plan.stages)} stages, {plan.microbatches} micro-batches, {plan.schedule}; "
                        f"{s['steps']} steps from step {s['first_step']}, {s['warmup']} of them warm-up",
                  title_justify="left")
    for col in ("", "measured", "predicted", "error"):
        table.add_column(col, justify="left" if not col else "right")
    pred = s["predicted_step_s"]
    table.add_row("step (median)", fmt_seconds(s["measured_step_s"]), fmt_seconds(pred) if pred else "-",
                  f"{s['relative_error']:+.1%}" if s["relative_error"] is not None else "-")
    table.add_row("samples/s", f"{s['measured_samples_per_s']:,.1f}", "-", "-")
    paid, priced = s.get("measured_usd_per_1k_samples"), s.get("predicted_usd_per_1k_samples")
    if paid is not None:
        table.add_row("$ per 1,000 samples", f"{paid:.6f}", f"{priced:.6f}" if priced is not None else "-",
                      f"{paid / priced - 1:+.1%}" if priced else "-")
    console.print(table)
    mem = Table(title="peak memory per worker: its tensors (CUDA's allocator; on a CPU, what malloc handed out "
                      "over the step, plus the weights, less what the math libraries keep between steps)",
                title_justify="left")
    for col in ("worker", "measured", "predicted (model state + activations)", "libraries' own", "process RSS"):
        mem.add_column(col, justify="left" if col == "worker" else "right")
    predicted, rss = s.get("predicted_peak_mem_bytes") or {}, s.get("rss_peak_bytes") or {}
    library = s.get("library_bytes") or {}
    for key, value in s["peak_mem_bytes"].items():
        device = key.split(":", 1)[1]
        mem.add_row(key, fmt_bytes(value), fmt_bytes(predicted[device]) if device in predicted else "-",
                    fmt_bytes(library[key]) if library.get(key) is not None else "-",
                    fmt_bytes(rss[key]) if rss.get(key) else "-")
    console.print(mem)
    if s.get("stages"):
        console.print(_stage_times(s["stages"]))
    if s["losses"]:
        console.print(f"loss: {s['loss_first']:.4f} at the first step, {s['loss_last']:.4f} at the last")
    console.print(f"logs and results in {s['out_dir']}")


def _stage_times(rows: list[dict]) -> Table:
    """Per stage (replicas averaged): compute busy time and share of the step spent communicating
    (receiving, waits included, and the gradient all-reduce; `hetplan.runtime.stage_times`)."""
    table = Table(title="per stage, replicas averaged: compute busy time per step and share of the step "
                        "communicating (receives, waits included, and all-reduce)", title_justify="left")
    for col in ("stage", "devices", "busy predicted", "busy measured", "comm share predicted",
                "comm share measured"):
        table.add_column(col, justify="left" if col in ("stage", "devices") else "right")

    def secs(v: float | None) -> str:
        return fmt_seconds(v) if v is not None else ""

    def share(v: float | None) -> str:
        return f"{v:.1%}" if v is not None else ""

    for r in rows:
        table.add_row(str(r["stage"]), ", ".join(r["devices"]), secs(r["predicted_busy_s"]),
                      secs(r["measured_busy_s"]), share(r["predicted_comm_share"]), share(r["measured_comm_share"]))
    return table
