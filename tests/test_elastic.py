"""`hetplan run --elastic` (`runtime.elastic`): a worker of a 4-stage mlp run dies at step 6; the
launcher re-plans (dp) on the 3 devices left, goes on from the last checkpoint (written by the
4-stage plan, loaded by the new one), finishes every step, exit 0, and says what it lost. The
losses after the change are those of the run that never lost a worker (pipelined training
equals one process's whatever the plan)."""

import contextlib
import json
import os
import signal
import threading
import time

import pytest

from hetplan.runtime.elastic import Change, run_elastic
from hetplan.runtime.launch import WorkerFailure, _died

CLUSTER = {"name": "four", "devices": [
    {"id": f"c{i}", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"} for i in range(4)]}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    from hetplan.cli import main

    tmp = tmp_path_factory.mktemp("elastic")
    (tmp / "four.json").write_text(json.dumps(CLUSTER))
    assert main(["profile", "mlp", "--batch-size", "8", "-o", str(tmp / "g.json")]) == 0
    assert main(["plan", str(tmp / "g.json"), "--cluster", str(tmp / "four.json"), "--planner", "uniform",
                 "--max-replicas", "1", "-o", str(tmp / "p.json")]) == 0
    return tmp


def test_a_run_that_loses_a_worker_replans_and_finishes_with_the_same_losses(planned, tmp_path, monkeypatch, cli):
    g, p, four = planned / "g.json", planned / "p.json", planned / "four.json"
    flags = ["--model", "mlp", "--graph", g, "--cluster", four, "--steps", "12", "--optimizer", "sgd", "--json"]
    whole = cli("run", p, *flags, "--out", tmp_path / "whole")
    assert whole.code == 0, whole.err
    monkeypatch.setenv("HETPLAN_FAULT", "die:3:6")  # the last stage's worker, as step 6 begins
    r = cli("run", p, *flags, "--out", tmp_path / "elastic", "--checkpoint-dir", tmp_path / "ck",
            "--checkpoint-every", "4", "--elastic")
    assert r.code == 0, r.err
    out = r.json()
    [change] = out["changes"]
    assert change["lost"] == ["c3"] and change["at_step"] == 6 and change["from_step"] == 4
    assert change["steps_lost"] == 2 and change["workers"] <= 3 and change["restart_s"] > 0
    assert "lost c3 at step 6; re-planned on 3 devices, going on from step 4" in r.err
    assert out["losses"] == pytest.approx(whole.json()["losses"][4:], rel=1e-5)


def _grow_when_training(out, path, step):
    """A thread that writes the 4-device cluster file once a worker's heartbeat reaches `step`."""
    def watch():
        for _ in range(6000):
            for beat in out.glob("heartbeat.*"):
                with contextlib.suppress(OSError, ValueError):
                    if json.loads(beat.read_text()).get("step", -1) >= step:
                        time.sleep(0.05)
                        path.write_text(json.dumps(CLUSTER))
                        return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_devices_added_to_the_cluster_file_are_taken_where_worth_the_restart(planned, tmp_path, monkeypatch, cli):
    """Two devices, then four (the cluster file rewritten while the run trains): where
    `availability.decide` finds it worth the restart (forced here: on this VM's tiny steps it is
    not), the run stops at a checkpoint a few steps on and finishes under dp's plan for the four,
    with the losses of the run that never changed."""
    import hetplan.availability

    g, p2 = planned / "g.json", tmp_path / "p2.json"
    two = tmp_path / "two.json"
    two.write_text(json.dumps({**CLUSTER, "devices": CLUSTER["devices"][:2]}))
    assert cli("plan", g, "--cluster", two, "--planner", "uniform", "--max-replicas", "1", "-o", p2).code == 0
    # steps of milliseconds: enough of them that dp's plan for the four is made well before the end
    flags = ["--model", "mlp", "--graph", g, "--steps", "60", "--optimizer", "sgd", "--json"]
    whole = cli("run", p2, *flags, "--cluster", two, "--out", tmp_path / "whole")
    monkeypatch.setattr(hetplan.availability, "decide", lambda *a: True)
    grows = tmp_path / "grows.json"
    grows.write_text(two.read_text())
    _grow_when_training(tmp_path / "elastic", grows, 3)
    r = cli("run", p2, *flags, "--cluster", grows, "--out", tmp_path / "elastic", "--checkpoint-dir",
            tmp_path / "ck", "--checkpoint-every", "10", "--elastic")
    assert r.code == 0, r.err
    out = r.json()
    assert len(out["changes"]) == 1, r.err
    [change] = out["changes"]
    assert change["added"] == ["c2", "c3"] and change["lost"] == [] and change["at_step"] == change["from_step"]
    assert "stopping at step" in r.err
    assert out["losses"] == pytest.approx(whole.json()["losses"][change["from_step"]:], rel=1e-5)


def test_a_growth_is_weighed_by_the_replays_rule_and_stops_two_steps_past_the_furthest_begun(planned, tmp_path):
    """`_Growth` without workers: the cluster file grows from 2 devices to 4; with a restart of
    an hour the gain over 30 steps of milliseconds is not worth it (said, nothing asked of the
    workers), and SIGUSR1 to the launcher has it weigh the same file again; with no restart it is
    worth it, and the stop is asked two steps past the furthest heartbeat."""
    from hetplan.graph import at_batch
    from hetplan.io.clusters import load_cluster
    from hetplan.io.graphs import load_graph
    from hetplan.planners import replan
    from hetplan.runtime.elastic import _Growth, _poked_by_sigusr1
    from hetplan.runtime.supervise import stop_step

    graph = at_batch(load_graph(planned / "g.json"), 8)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**CLUSTER, "devices": CLUSTER["devices"][:2]}))
    two = load_cluster(path)
    plan = _plan_of(graph, two)
    for restart_s, taken in ((3600.0, False), (0.0, True)):
        said, out = [], tmp_path / f"run{int(restart_s)}"
        out.mkdir()
        (out / "heartbeat.0").write_text(json.dumps({"step": 7}))
        (out / "heartbeat.1").write_text(json.dumps({"step": 6}))
        path.write_text(json.dumps({**CLUSTER, "devices": CLUSTER["devices"][:2]}))
        grow = _Growth(str(path), two, plan, graph, 30, out, restart_s, said.append, replan, 2)
        grow.check(5)  # nothing changed yet
        assert said == [] and grow.next is None
        time.sleep(0.01)
        path.write_text(json.dumps(CLUSTER))
        grow.check(7)
        if taken:  # asked already; a poke (SIGUSR1) reads the file again, but asks once
            grow.poke()
            grow.check(8)
            assert len(said) == 1
        if not taken:
            assert grow.next is None and stop_step(out) is None
            assert said[0].startswith("added c2, c3: a plan for them") and "not worth a restart of 3600 s" in said[0]
            grow.check(8)  # unchanged: not weighed again
            assert len(said) == 1
            with _poked_by_sigusr1(grow):
                os.kill(os.getpid(), signal.SIGUSR1)
            grow.check(9)
            assert len(said) == 2 and said[1].startswith("added c2, c3") and "not worth a restart" in said[1]
        else:
            assert grow.next[2] == ("c2", "c3") and stop_step(out) == 9 and "stopping at step 9" in said[0]
            assert sorted(grow.next[0].ids) == ["c0", "c1", "c2", "c3"]


def _plan_of(graph, cluster):
    from hetplan.planners import make_plan

    return make_plan(graph, cluster, "dp")


def test_elastic_needs_a_graph_and_a_checkpoint_folder_and_replans_only_for_a_death(tmp_path):
    from hetplan.errors import HetplanError
    from hetplan.runtime.settings import RunSettings

    with pytest.raises(HetplanError, match="give the run its graph"):
        run_elastic(None, None, "mlp", None, RunSettings(), None)
    with pytest.raises(HetplanError, match="give --checkpoint-dir DIR"):
        run_elastic(None, None, "mlp", object(), RunSettings(), None)
    assert [_died(c) for c in (-9, 3, 1, 2, 4, 0, None)] == [True, True, False, False, False, False, False]
    assert WorkerFailure("hung").devices == ()
    line = Change(("c3",), 17, 15, 2, 3, 0.0261, 0.0, 3.8).line()
    assert line == ("lost c3 at step 17: re-planned on 3 workers (2 stages, predicted 26.1 ms a step), went on "
                    "from step 15 (2 steps lost), training again 3.8 s after the failure")
