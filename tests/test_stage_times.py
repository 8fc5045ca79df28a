"""`hetplan run`'s stage table: per stage, compute busy time and the share of
the step spent communicating, predicted (simulated timeline) against measured (every run)."""

import json

from hetplan.io import serde
from hetplan.pieces.split import split_step
from hetplan.plan import Plan, Stage
from hetplan.report import tables
from hetplan.runtime.launch import RunResult
from hetplan.runtime.stage_times import StageTime, predicted_replica, replica_times, stage_times
from hetplan.runtime.worker import step_busy_comm
from hetplan.timeline import Span, Timeline
from hetplan.zoo import load_model
from test_executor import chain_plan
from test_runtime import graph_of

PLAN = Plan((Stage(("a",), ("d0",)), Stage(("b",), ("d1", "d2"))), 2, "gpipe", "test")


def test_a_workers_step_splits_into_compute_and_communication():
    spans = [("F", 1, 0, 0.0, 0.25, 0), ("F", 1, 0, 0.0, 1.0, -1),  # F0 waited 0.25 s for its input
             ("B", 1, 0, 1.0, 3.0, -1)]  # the last stage's B: nothing received
    busy, comm = step_busy_comm(spans, (3.0, 3.5, 4.0))  # all-reduce 0.5 s, optimizer 0.5 s
    assert (busy, comm) == (0.75 + 2.0 + 0.5, 0.25 + 0.5)
    assert step_busy_comm([], (1.0, 1.0, 1.0)) == (0.0, 0.0)


def timeline() -> Timeline:
    """Stage 0 on d0; stage 1 on d1 and d2 (one micro-batch each), all-reducing; step 8 s."""
    spans = [Span("d0", "F", 0, 0, 0.0, 1.0), Span("d0", "F", 0, 1, 1.0, 2.0), Span("d0", "B", 0, 0, 5.0, 6.0),
             Span("d0", "B", 0, 1, 6.0, 7.0), Span("d0", "OPT", 0, -1, 7.0, 7.5),
             Span("d0->d1", "F", 0, 0, 1.0, 1.5, 1), Span("d1->d0", "B", 1, 0, 4.5, 5.0, 0),
             Span("d1", "F", 1, 0, 1.5, 2.5), Span("d1", "B", 1, 0, 2.5, 4.5), Span("d1", "AR", 1, -1, 4.5, 5.5),
             Span("d1", "OPT", 1, -1, 5.5, 6.0),
             Span("d2", "F", 1, 1, 2.5, 3.5), Span("d2", "B", 1, 1, 3.5, 4.5), Span("d2", "AR", 1, -1, 4.5, 5.5),
             Span("d2", "OPT", 1, -1, 5.5, 6.0)]
    return Timeline(tuple(spans), ("d0", "d1", "d2"), ("d0->d1", "d1->d0"), 8.0)


def test_predicted_busy_is_compute_and_optimizer_and_communication_the_rest_until_the_all_reduce_ends():
    t = timeline()
    assert predicted_replica(t, [0], "d0") == (4.5, 3.0)  # waits 3 s for B0's gradients; no all-reduce
    assert predicted_replica(t, [1], "d1") == (3.5, 2.5)  # 1.5 s for F0's input, then 1 s all-reducing
    assert predicted_replica(t, [1], "d2") == (2.5, 3.5)
    assert predicted_replica(t, [1], "d0") == (0.0, 0.0)  # holds no part of stage 1


def result(ranks) -> RunResult:
    return RunResult(steps=3, warmup=1, step_times_s=(10.0, 4.0, 4.0), losses=(), peak_mem_bytes={},
                     out_dir="out", ranks=tuple(ranks))


def test_stage_rows_average_replicas_and_take_the_median_after_warm_up():
    ranks = [{"rank": 0, "stage": 0, "busy_s": [9.0, 2.0, 3.0], "comm_s": [9.0, 1.0, 1.0]},
             {"rank": 1, "stage": 1, "busy_s": [9.0, 1.0, 1.0], "comm_s": [9.0, 2.0, 2.0]},
             {"rank": 2, "stage": 1, "busy_s": [9.0, 2.0, 2.0], "comm_s": [9.0, 1.0, 1.0]}]
    rows = stage_times(PLAN, result(ranks), timeline())
    assert rows == (StageTime(0, ("d0",), 4.5, 2.5, 3.0 / 8, 1.0 / 4),
                    StageTime(1, ("d1", "d2"), 3.0, 1.5, 3.0 / 8, 1.5 / 4))
    # without a graph nothing is predicted; without the workers' numbers nothing is measured
    assert stage_times(PLAN, result(ranks))[1] == StageTime(1, ("d1", "d2"), None, 1.5, None, 1.5 / 4)
    # per replica (the report page's device table): each worker's own row, named by its device or,
    # when it does not say, by its place among the stage's ranks
    assert replica_times(PLAN, result(ranks), timeline())[1:] == (
        StageTime(1, ("d1",), 3.5, 1.0, 2.5 / 8, 2.0 / 4), StageTime(1, ("d2",), 2.5, 2.0, 3.5 / 8, 1.0 / 4))
    named = [{**ranks[0], "device": "d0"}, {**ranks[2], "device": "d1"}, {**ranks[1], "device": "d2"}]
    assert [r.measured_busy_s for r in replica_times(PLAN, result(named))] == [2.5, 2.0, 1.0]
    assert replica_times(PLAN, None, timeline())[0] == StageTime(0, ("d0",), 4.5, None, 3.0 / 8, None)
    bare = [{"rank": r["rank"], "stage": r["stage"]} for r in ranks]
    assert stage_times(PLAN, result(bare), timeline())[0] == StageTime(0, ("d0",), 4.5, None, 3.0 / 8, None)


def test_hetplan_run_prints_predicted_against_measured_per_stage(cli, tmp_path, monkeypatch):
    batch, m = 4, 2
    zm = load_model("gpt2-tiny", batch_size=batch, seq_len=16, seed=0)
    split = split_step(zm.step, zm.batch)
    g, p, c, out = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "two.json", tmp_path / "run"
    serde.dump(graph_of(split, batch), g)
    serde.dump(chain_plan([piece.name for piece in split.pieces], [1, 1], m, "1f1b"), p)
    c.write_text(json.dumps({"name": "two", "devices": [
        {"id": f"c{i}", "type": "cpu-1t", "threads": 1, "binding": "cpu", "host": "here"} for i in range(2)]}))
    shown = []
    show_run = tables.show_run
    monkeypatch.setattr(tables, "show_run", lambda console, s, plan: (shown.append(s), show_run(console, s, plan)))
    r = cli("run", p, "--model", "gpt2-tiny", "--graph", g, "--cluster", c, "--steps", "3", "--warmup", "1",
            "--seq-len", "16", "--out", out)
    assert r.code == 0, r.err
    (s,) = shown
    assert [row["stage"] for row in s["stages"]] == [0, 1] and [row["devices"] for row in s["stages"]] == [["c0"],
                                                                                                           ["c1"]]
    for row in s["stages"]:
        assert row["measured_busy_s"] > 0 and 0 < row["measured_comm_share"] < 1
        assert row["measured_busy_s"] + row["measured_comm_share"] * s["measured_step_s"] <= 1.1 * s["measured_step_s"]
        assert row["predicted_busy_s"] > 0 and 0 < row["predicted_comm_share"] < 1
    assert "comm share measured" in r.out and "busy predicted" in r.out
    row0 = next(line for line in r.out.splitlines() if line.strip("│┃ ").startswith("0 ") and "c0" in line)
    assert f"{s['stages'][0]['measured_comm_share']:.1%}" in row0
    # a run without a graph leaves the predicted columns blank
    blank = {**s, "stages": [{**row, "predicted_busy_s": None, "predicted_comm_share": None} for row in s["stages"]]}
    from rich.console import Console

    console = Console(record=True, width=200)
    show_run(console, blank, serde.load(p, expect="plan"))
    text = console.export_text()
    line = next(line for line in text.splitlines() if "c1" in line and line.strip("│ ").startswith("1 "))
    assert line.count("%") == 1 and "-" not in line.split("c1", 1)[1]

