"""`hetplan run --trace`: the measured timeline of the last step, per worker,
in the simulator's format and order."""

import json
from pathlib import Path

import pytest

from hetplan.cluster import Cluster
from hetplan.io.clusters import cluster_from_spec
from hetplan.pieces.split import split_step
from hetplan.runtime.run import RunSettings, run_plan
from hetplan.runtime.trace import measured_timeline
from hetplan.schedule import schedule_order
from hetplan.zoo import load_model
from test_executor import chain_plan
from test_runtime import graph_of

TWO_CPUS: Cluster = cluster_from_spec({"name": "two", "devices": [
    {"id": f"c{i}", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"} for i in range(2)]}, "two")


M = 2


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The perceptron in two stages on two CPU workers, its last step traced; the run folder and report."""
    batch, out = 4, tmp_path_factory.mktemp("traced") / "run"
    zm = load_model("mlp", batch_size=batch, seq_len=16, seed=0)
    split = split_step(zm.step, zm.batch)
    plan = chain_plan([p.name for p in split.pieces], [1, 1], M, "1f1b")
    settings = RunSettings(steps=2, warmup=1, batch_size=batch, seq_len=16, granularity="layer", out_dir=out,
                           trace=True)
    return out, run_plan(plan, TWO_CPUS, "mlp", graph_of(split, batch), settings)


def test_a_traced_run_records_every_action_once_per_worker_in_the_simulators_order(traced):
    run_dir, report = traced
    m = M
    orders = schedule_order("1f1b", 2, m)
    timeline = measured_timeline(report.result, report_spec(run_dir))
    assert timeline.devices == ("c0", "c1") and set(timeline.links) == {"c0->c1", "c1->c0"}
    for stage, device in enumerate(("c0", "c1")):
        actions = sorted((s for s in timeline.spans if s.resource == device and s.kind in "FB"),
                         key=lambda s: s.start_s)
        assert [f"{s.stage}{s.kind}{s.microbatch}" for s in actions] == [str(a) for a in orders[stage]]
        assert all(a.end_s <= b.start_s for a, b in zip(actions, actions[1:], strict=False))
        assert [s.kind for s in timeline.spans if s.resource == device and s.kind == "OPT"] == ["OPT"]
    # activations go 0 -> 1 and gradients 1 -> 0, one message per micro-batch each
    received = sorted((s.resource, s.kind, s.microbatch) for s in timeline.spans if "->" in s.resource)
    assert received == [("c0->c1", "F", j) for j in range(m)] + [("c1->c0", "B", j) for j in range(m)]
    # a message is received within the action that waits for it
    for s in (s for s in timeline.spans if "->" in s.resource):
        user = next(a for a in timeline.spans if a.resource == s.resource.split("->")[1] and a.kind == s.kind
                    and a.microbatch == s.microbatch and "->" not in a.resource)
        assert user.start_s <= s.start_s <= s.end_s <= user.end_s
    trace, gantt = report.trace_files
    events = json.loads(Path(trace).read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(timeline.spans)
    assert Path(gantt).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.summary()["trace_files"] == [trace, gantt]


def report_spec(run_dir):
    from hetplan.runtime.spec import RunSpec

    return RunSpec.from_json((run_dir / "run.json").read_text())


def test_the_page_of_a_traced_run_draws_the_prediction_above_what_was_measured(traced, tmp_path, cli):
    from browser import render
    from hetplan.io.graphs import load_graph
    from hetplan.sim import simulate
    from hetplan.units import fmt_seconds
    from test_report_page import GRAPH_POINTS, TIMELINE_BARS, bars, figure_data, markers

    run_dir, report = traced
    page = tmp_path / "run.html"
    r = cli("report", run_dir, "-o", page, "--json")  # the run folder holds its graph, cluster and summary
    assert r.code == 0 and r.json()["of"] == "run", r.err
    graph = load_graph(run_dir / "graph.json")
    predicted = simulate(graph, TWO_CPUS, report.plan).timeline
    measured = measured_timeline(report.result, report_spec(run_dir))
    fig = figure_data(page, "timeline")
    assert [a["text"].split(":")[0] for a in fig["layout"]["annotations"]] == [
        "predicted (simulator)", "measured (last step of the run)"]
    panel = {axis: sum(len(t["x"]) for t in fig["data"] if t["yaxis"] == axis) for axis in ("y", "y2")}
    assert panel == {"y": len(predicted.spans), "y2": len(measured.spans)}
    assert len(markers(figure_data(page, "graph"))) == len(graph.nodes)
    text = page.read_text()
    for row in report.replicas:  # the device table: predicted and measured busy time per device
        assert f">{fmt_seconds(row.measured_busy_s)}<" in text and f">{fmt_seconds(row.predicted_busy_s)}<" in text

    shown = render(page, tmp_path / "run.png", (GRAPH_POINTS, TIMELINE_BARS, "#runs tbody tr", "#devices tbody tr"))
    assert shown.errors == []
    assert shown.counts[TIMELINE_BARS] == bars(fig) and shown.counts[GRAPH_POINTS] == len(graph.nodes)
    assert shown.counts["#runs tbody tr"] == 1 and shown.counts["#devices tbody tr"] == 2


def test_a_demo_folders_page_shows_its_runs_and_the_chosen_plans_step(traced, tmp_path, cli):
    """What `hetplan demo` leaves (demo.json, and run-0, the chosen plan's traced run), read back."""
    import shutil

    from test_report_page import figure_data

    run_dir, report = traced
    demo = tmp_path / "demo"
    shutil.copytree(run_dir, demo / "run-0")
    runs = [{"label": "chosen: test", "stages": 2, "devices": 2, "microbatches": M, "predicted_step_s": 0.02,
             "measured_step_s": 0.03, "loss_last": 5.0},
            {"label": "uniform", "stages": 2, "devices": 2, "microbatches": 4, "predicted_step_s": 0.04,
             "measured_step_s": 0.035, "loss_last": None}]
    (demo / "demo.json").write_text(json.dumps({"kind": "demo", "model": "gpt2-tiny", "cluster": "two",
                                                "speedup_over_best_baseline": 1.17, "runs": runs}))
    r = cli("report", demo, "--json")  # the page goes into the folder by default
    assert r.code == 0 and r.json() == {"kind": "report", "of": "demo", "output": str(demo / "report.html"),
                                        "bytes": (demo / "report.html").stat().st_size}, r.err
    text = (demo / "report.html").read_text()
    assert text.count("<tr><td data-value=\"chosen: test\">") == 1 and ">+50%<" in text and ">-12%<" in text
    assert "1.17x" in text and len(figure_data(demo / "report.html", "timeline")["layout"]["annotations"]) == 2
