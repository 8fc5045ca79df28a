"""`hetplan report`: one self-contained HTML page per plan, comparison or run (the run's
page is checked in test_trace.py, on the traced run made there), opened in headless Chromium."""

import html
import json
import re
from pathlib import Path

import pytest

from browser import render
from hetplan.graph import Edge, Graph, Node
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.io.graphs import load_graph
from hetplan.sim import simulate
from hetplan.timeline.gantt import chrome_trace, timeline_from_trace

GRAPH_POINTS = "#fig-graph .scatterlayer .trace.scatter .point"
TIMELINE_BARS = "#fig-timeline .barlayer .point"


def figure_data(page: Path, name: str) -> dict:
    """The plotly figure the page inlines as JSON under id data-NAME."""
    found = re.search(rf'<script type="application/json" id="data-{name}">(.*?)</script>', page.read_text(), re.S)
    assert found, f"no {name} figure in {page}"
    return json.loads(found[1].replace("<\\/", "</"))


def bars(fig: dict) -> int:
    return sum(len(t["x"]) for t in fig["data"] if t["type"] == "bar")


def markers(fig: dict) -> list[str]:
    """The hover texts of the graph's nodes (marker traces)."""
    return [h for t in fig["data"] if t.get("mode") == "markers" for h in t["hovertext"]]


@pytest.fixture(scope="module")
def resnet(tmp_path_factory, profiles) -> Path:
    from hetplan.cli import main

    path = tmp_path_factory.mktemp("graphs") / "r50.json"
    assert main(["import", "pipedream", str(profiles / "resnet50" / "graph.txt"), "-o", str(path)]) == 0
    return path


def test_a_plans_page_draws_every_node_and_every_action_of_its_step(tmp_path, cli, resnet):
    plan_path, page = tmp_path / "plan.json", tmp_path / "plan.html"
    assert cli("plan", resnet, "--cluster", "hetero-4", "-o", plan_path).code == 0
    r = cli("report", plan_path, "-o", page, "--json")  # the plan names its graph and cluster
    assert r.code == 0 and r.json()["of"] == "plan", r.err
    graph, cluster, plan = load_graph(resnet), load_cluster("hetero-4"), serde.load(plan_path)
    spans = simulate(graph, cluster, plan).timeline.spans
    nodes = markers(figure_data(page, "graph"))
    assert len(nodes) == len(graph.nodes)
    assert {h.split("<b>")[1].split("</b>")[0] for h in nodes} == {n.id for n in graph.nodes}
    assert bars(figure_data(page, "timeline")) == len(spans)
    assert page.stat().st_size < 3e6

    shown = render(page, tmp_path / "plan.png", (GRAPH_POINTS, TIMELINE_BARS, "#devices tbody tr", "#fig-curve",
                                                 "#explain tbody tr"))
    assert shown.errors == []
    assert shown.counts[GRAPH_POINTS] == len(graph.nodes)
    assert shown.counts[TIMELINE_BARS] == len(spans)
    assert shown.counts["#devices tbody tr"] == sum(len(st.devices) for st in plan.stages)
    assert shown.counts["#fig-curve"] == 0
    assert shown.counts["#explain tbody tr"] == 1 + len(plan.meta["dp"]["explain"]["runners_up"])
    assert shown.screenshot.stat().st_size > 10_000


def test_a_comparisons_page_marks_the_best_sorts_and_draws_the_best_plan(tmp_path, cli, resnet):
    from playwright.sync_api import sync_playwright

    from browser import chromium

    out = cli("compare", resnet, "--cluster", "hetero-4", "--planners", "single,uniform,dp", "--json")
    assert out.code == 0, out.err
    comparison = tmp_path / "compare.json"
    comparison.write_text(out.out)
    page = tmp_path / "compare.html"
    assert cli("report", comparison, "-o", page).code == 0
    best = out.json()["best"]
    text = page.read_text()
    assert text.count('<tr class="best">') == 1 and f"★ {best}" in text

    shown = render(page, tmp_path / "compare.png", (GRAPH_POINTS, TIMELINE_BARS, "#comparison tbody tr"))
    assert shown.errors == [] and shown.counts["#comparison tbody tr"] == 3
    assert shown.counts[GRAPH_POINTS] > 0 and shown.counts[TIMELINE_BARS] > 0
    with sync_playwright() as p:  # a click on "step" sorts the rows by it, a second click the other way
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
        tab = browser.new_page()
        tab.goto(page.resolve().as_uri())
        tab.click("#comparison th:nth-child(5)")
        up = [float(v) for v in tab.eval_on_selector_all("#comparison tbody td:nth-child(5)",
                                                          "cells => cells.map(c => c.dataset.value)")]
        tab.click("#comparison th:nth-child(5)")
        down = [float(v) for v in tab.eval_on_selector_all("#comparison tbody td:nth-child(5)",
                                                            "cells => cells.map(c => c.dataset.value)")]
        browser.close()
    assert up == sorted(up) and down == sorted(up, reverse=True) and len(set(up)) > 1


def test_an_rl_plans_page_has_its_learning_curve(tmp_path, cli, resnet):
    plan_path, page = tmp_path / "plan.json", tmp_path / "plan.html"
    assert cli("plan", resnet, "--cluster", "hetero-4", "--planner", "reinforce", "--max-iters", "4",
               "-o", plan_path).code == 0
    assert cli("report", plan_path, "-o", page).code == 0
    curve = figure_data(page, "curve")
    assert [len(t["x"]) for t in curve["data"]] == [4, 4]


def chain_graph(n: int) -> Graph:
    """n nodes in a chain with a skip edge every third node, sizes of a real layer."""
    nodes = [Node(f"n{i}", "Linear", {"v100-16gb": 1e-3}, {"v100-16gb": 2e-3}, flops=1e9, param_bytes=4 << 20,
                  out_bytes=1 << 20, act_bytes=2 << 20) for i in range(n)]
    edges = [Edge(f"n{i}", f"n{i + 1}", 1 << 20) for i in range(n - 1)]
    edges += [Edge(f"n{i}", f"n{i + 3}", 1 << 20) for i in range(0, n - 3, 3)]
    return Graph("chain", tuple(nodes), tuple(edges), batch_size=32, profiled_on="v100-16gb")


def test_the_page_of_a_240_node_graph_stays_under_three_mb(tmp_path, cli):
    graph = tmp_path / "g.json"
    serde.dump(chain_graph(240), graph)
    plan, page = tmp_path / "plan.json", tmp_path / "plan.html"
    assert cli("plan", graph, "--cluster", "hetero-4", "--planner", "uniform", "--microbatches", "8",
               "-o", plan).code == 0
    assert cli("report", plan, "-o", page).code == 0
    assert len(markers(figure_data(page, "graph"))) == 240
    assert page.stat().st_size < 3e6, page.stat().st_size


def test_a_dp_plans_page_says_why_this_plan_and_a_baselines_does_not(tmp_path, cli):
    graph = tmp_path / "g.json"
    serde.dump(chain_graph(12), graph)
    for planner in ("dp", "uniform"):
        plan, page = tmp_path / f"{planner}.json", tmp_path / f"{planner}.html"
        assert cli("plan", graph, "--cluster", "hetero-4", "--planner", planner, "-o", plan).code == 0
        assert cli("report", plan, "-o", page).code == 0
        text = page.read_text()
        if planner == "uniform":
            assert 'id="section-explain"' not in text and "Why this plan" not in text
            continue
        explain = serde.read_json(plan)["meta"]["dp"]["explain"]
        section = re.search(r'<section id="section-explain"><h2>Why this plan</h2>(.*?)</section>', text, re.S)
        assert section, "no Why this plan section"
        assert f"<p>dp compared {explain['candidates']} candidates, simulated {explain['simulated']}</p>" in section[1]
        rows = re.findall(r"<tr class=\"(\w*)\">(.*?)</tr>", section[1])
        assert len(rows) == 1 + len(explain["runners_up"]) and [cls for cls, _ in rows] == ["chosen"] + [""] * (
            len(rows) - 1)
        cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for _, row in rows]
        assert cells[0][:2] == ["winner", explain["winner"]["source"]] and cells[0][-1] == "chosen"
        assert [c[-1] for c in cells[1:]] == [html.escape(r["lost"]) for r in explain["runners_up"]]


def test_a_chrome_trace_reads_back_as_the_timeline_it_was_written_from(resnet):
    graph, cluster = load_graph(resnet), load_cluster("hetero-4")
    from hetplan.planners import make_plan

    timeline = simulate(graph, cluster, make_plan(graph, cluster, "uniform")).timeline
    back = timeline_from_trace(json.loads(json.dumps(chrome_trace(timeline))))
    assert back.devices == timeline.devices and back.links == timeline.links
    assert len(back.spans) == len(timeline.spans)
    for a, b in zip(back.spans, timeline.spans, strict=True):
        assert (a.resource, a.kind, a.stage, a.microbatch, a.to_stage) == (b.resource, b.kind, b.stage, b.microbatch,
                                                                           b.to_stage)
        assert a.start_s == pytest.approx(b.start_s, abs=1e-12) and a.end_s == pytest.approx(b.end_s, abs=1e-12)


def test_bad_input_is_one_line_and_status_2(tmp_path, cli, resnet):
    (tmp_path / "empty").mkdir()
    (tmp_path / "list.json").write_text("[1, 2]")
    plan = tmp_path / "plan.json"
    assert cli("plan", resnet, "--cluster", "hetero-4", "--planner", "single", "-o", plan).code == 0
    moved = tmp_path / "moved.json"
    data = json.loads(plan.read_text())
    data["meta"]["graph_file"] = str(tmp_path / "gone.json")
    moved.write_text(json.dumps(data))
    for path, says in ((resnet, "a graph file, not a plan file"), (tmp_path / "list.json", "not a plan file"),
                       (tmp_path / "empty", "no run.json in it"), (tmp_path / "none", "no such file or folder"),
                       (moved, "which is not there any more; pass --graph")):
        r = cli("report", path, "-o", tmp_path / "x.html")
        assert r.code == 2 and r.out == "" and len(r.err.strip().splitlines()) == 1, (path, r.err)
        assert says in r.err, r.err
    assert not (tmp_path / "x.html").exists()
    r = cli("report", moved, "--graph", resnet, "-o", tmp_path / "x.html")  # --graph says where it is now
    assert r.code == 0, r.err


def test_a_plan_that_does_not_fit_says_why_on_its_page(tmp_path, cli):
    from hetplan.plan import Plan, Stage

    graph = chain_graph(30)
    big = Graph("big", tuple(Node(n.id, n.op, n.fwd_s, n.bwd_s, param_bytes=1 << 30) for n in graph.nodes),
                graph.edges, 32, "v100-16gb")
    g, plan = tmp_path / "big.json", tmp_path / "plan.json"
    serde.dump(big, g)
    serde.dump(Plan((Stage(big.topo_order, ("t0",)),), 1, "1f1b", "hand"), plan)
    r = cli("report", plan, "--graph", g, "--cluster", "hetero-4", "-o", tmp_path / "p.html")
    assert r.code == 0, r.err
    text = (tmp_path / "p.html").read_text()
    assert "<dt>fits in memory</dt><dd>no</dd>" in text and "stage 0 on t0 (t4-16gb) needs" in text


def test_a_bar_on_a_link_says_what_it_carries_between_which_stages():
    from hetplan.report.figures import span_hover
    from hetplan.timeline import Span

    assert span_hover(Span("a->b", "B", 2, 3, 0.0, 1.0, 1)) == "gradients of micro-batch 3, stage 2 → stage 1"
    assert span_hover(Span("a", "F", 0, 1, 0.0, 1.0)) == "stage 0: forward of micro-batch 1"
    assert span_hover(Span("a", "AR", 0, -1, 0.0, 1.0)) == "stage 0: gradient all-reduce"


def test_a_long_graph_snakes_down_in_rows_each_node_beside_the_next():
    from hetplan.report.figures import WRAP, _layout

    graph = Graph("chain", tuple(Node(f"n{i}", "Linear", {"cpu": 1.0}, {"cpu": 1.0}) for i in range(100)),
                  tuple(Edge(f"n{i}", f"n{i + 1}") for i in range(99)), 1, "cpu")
    pos = _layout(graph)
    rows = -(-100 // WRAP)  # 3 rows of 34, 34 and 32 columns
    assert len(set(pos.values())) == 100 and len({y for _, y in pos.values()}) == rows == 3
    assert {x for x, _ in pos.values()} == {float(c) for c in range(34)}
    for i in range(99):  # along a row one column on; at a turn straight down
        (x0, y0), (x1, y1) = pos[f"n{i}"], pos[f"n{i + 1}"]
        assert (abs(x1 - x0), y1 - y0) in ((1.0, 0.0), (0.0, -2.5)), i


def kept_run(folder: Path, losses: tuple[float, ...], traced: bool):
    """A run folder as `run_plan` leaves it, from a made-up result (no workers): two stages on
    cpu0 and cpu1 of `local`, no graph given."""
    from hetplan.plan import Estimate, Plan, Stage
    from hetplan.runtime.launch import RunResult
    from hetplan.runtime.run import RunReport, keep
    from hetplan.runtime.settings import RunSettings
    from hetplan.runtime.spec import RunSpec

    plan = Plan((Stage(("a",), ("cpu0",)), Stage(("b",), ("cpu1",))), 2, "1f1b", "hand",
                predicted=Estimate(0.348, 23.0, {}, {}, 0.0, {}, 0.0, True))  # for another cluster, say
    ranks = tuple({"rank": k, "stage": k, "device": f"cpu{k}", "busy_s": [0.01, 0.02], "comm_s": [0.005, 0.005],
                   "peak_mem_bytes": 1 << 20}
                  for k in range(2))
    result = RunResult(2, 0, (0.03, 0.03), losses, {}, str(folder), ranks)
    measured = Estimate(0.03, 266.7, {}, {}, 0.0, {}, 0.0, True, method="measured")
    from hetplan.runtime.stage_times import replica_times

    report = RunReport(plan, "mlp", result, measured, None, 0, ("trace",) if traced else (),
                       replicas=replica_times(plan, result))
    folder.mkdir(parents=True, exist_ok=True)
    spec = RunSpec(plan, "mlp", RunSettings(batch_size=8, granularity="layer", out_dir=folder), ((1.0,), (1.0,)), ())
    (folder / "run.json").write_text(spec.to_json())
    keep(report, folder, None, load_cluster("local"), "p.json")
    return report


def test_a_run_without_a_graph_shows_what_was_measured_and_predicts_nothing(tmp_path, cli):
    folder = tmp_path / "run"
    (folder).mkdir()
    (folder / "trace_measured.json").write_text("{}")  # an earlier traced run's, in the same folder
    (folder / "graph.json").write_text("{}")
    kept_run(folder, (5.5, float("nan")), traced=False)  # the loss went NaN: the summary still is JSON
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["losses"] == [5.5, None] and summary["loss_last"] is None
    assert not (folder / "trace_measured.json").exists() and not (folder / "graph.json").exists()
    r = cli("report", folder, "-o", tmp_path / "run.html")
    assert r.code == 0, r.err
    text = (tmp_path / "run.html").read_text()
    assert "<dt>predicted step</dt>" not in text and "nothing was predicted" in text  # not the plan file's estimate
    assert 'id="section-devices"' in text
    assert text.count("15 ms") == 2  # each device's measured busy time (the median of 10 and 20 ms)
    assert 'id="fig-timeline"' not in text


def test_a_shared_device_is_named_with_every_stage_it_holds():
    from hetplan.plan import Plan, Stage
    from hetplan.report.page import device_labels

    plan = Plan((Stage(("a",), ("cpu0",)), Stage(("b",), ("cpu1",)), Stage(("c",), ("cpu0",))), 2, "gpipe",
                "hand", shared_devices=True)
    assert device_labels(plan, load_cluster("local")) == {"cpu0": "cpu0 (cpu-1t) · stages 0, 2",
                                                          "cpu1": "cpu1 (cpu-1t) · stage 1"}


def test_files_hetplan_did_not_write_are_one_line_too(tmp_path, cli):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.json").write_text("[]")
    (folder / "summary.json").write_text("{}")
    rows = tmp_path / "compare.json"
    rows.write_text(json.dumps({"kind": "comparison", "rows": [{"no": "planner"}]}))
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps({"kind": "comparison", "best": "dp", "graph_file": str(tmp_path / "gone.json"),
                                 "rows": [{"planner": "dp", "plan": {"kind": "plan"}}]}))
    run_out = tmp_path / "out.json"
    run_out.write_text(json.dumps({"kind": "run", "out_dir": "nowhere"}))
    for path, says in ((folder, "not what hetplan writes there (a JSON list)"),
                       (rows, "not as hetplan writes it (KeyError"), (run_out, "names the run folder nowhere")):
        r = cli("report", path, "-o", tmp_path / "x.html")
        assert r.code == 2 and len(r.err.strip().splitlines()) == 1 and says in r.err, r.err
    r = cli("report", moved, "-o", tmp_path / "x.html")  # the table, and a note that the plan is not drawn
    assert r.code == 0 and "its graph " in (tmp_path / "x.html").read_text(), r.err
