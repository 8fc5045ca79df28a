"""`hetplan run --elastic` (`runtime.elastic`): a worker of a 4-stage mlp run dies at step 6; the
launcher re-plans (dp) on the 3 devices left, goes on from the last checkpoint (written by the
4-stage plan, loaded by the new one), finishes every step, exit 0, and says what it lost. The
losses after the change are those of the run that never lost a worker (pipelined training
equals one process's whatever the plan)."""

import contextlib
import json
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


@pytest.mark.parametrize("worth", [True, False])
def test_devices_added_to_the_cluster_file_are_taken_where_worth_the_restart(planned, tmp_path, monkeypatch, cli,
                                                                              worth):
    """Two devices, then four (the cluster file rewritten while the run trains): where
    `availability.decide` finds it worth the restart (forced here: on this VM's tiny steps it is
    not), the run stops at a checkpoint a few steps on and finishes under dp's plan for the four,
    with the losses of the run that never changed; where not, it says why and goes on."""
    import hetplan.availability

    g, p2 = planned / "g.json", tmp_path / "p2.json"
    two = tmp_path / "two.json"
    two.write_text(json.dumps({**CLUSTER, "devices": CLUSTER["devices"][:2]}))
    assert cli("plan", g, "--cluster", two, "--planner", "uniform", "--max-replicas", "1", "-o", p2).code == 0
    flags = ["--model", "mlp", "--graph", g, "--steps", "30", "--optimizer", "sgd", "--json"]
    whole = cli("run", p2, *flags, "--cluster", two, "--out", tmp_path / "whole")
    monkeypatch.setattr(hetplan.availability, "decide", lambda *a, real=hetplan.availability.decide: worth)
    grows = tmp_path / "grows.json"
    grows.write_text(two.read_text())
    _grow_when_training(tmp_path / "elastic", grows, 3)
    r = cli("run", p2, *flags, "--cluster", grows, "--out", tmp_path / "elastic", "--checkpoint-dir",
            tmp_path / "ck", "--checkpoint-every", "10", "--elastic")
    assert r.code == 0, r.err
    out = r.json()
    if not worth:
        assert out["changes"] == [] and "added c2, c3: a plan for them" in r.err and "not worth a restart" in r.err
        assert out["losses"] == pytest.approx(whole.json()["losses"], rel=1e-5)
        return
    assert len(out["changes"]) == 1, r.err
    [change] = out["changes"]
    assert change["added"] == ["c2", "c3"] and change["lost"] == [] and change["at_step"] == change["from_step"]
    assert "stopping at step" in r.err
    assert out["losses"] == pytest.approx(whole.json()["losses"][change["from_step"]:], rel=1e-5)


def test_elastic_needs_a_graph_and_a_checkpoint_folder_and_replans_only_for_a_death(tmp_path):
    from hetplan.errors import HetplanError
    from hetplan.runtime.settings import RunSettings

    with pytest.raises(HetplanError, match="give the run its graph"):
        run_elastic(None, None, "mlp", None, RunSettings())
    with pytest.raises(HetplanError, match="give --checkpoint-dir DIR"):
        run_elastic(None, None, "mlp", object(), RunSettings())
    assert [_died(c) for c in (-9, 3, 1, 2, 4, 0, None)] == [True, True, False, False, False, False, False]
    assert WorkerFailure("hung").devices == ()
    line = Change(("c3",), 17, 15, 2, 3, 0.0261, 0.0, 3.8).line()
    assert line == ("lost c3 at step 17: re-planned on 3 workers (2 stages, predicted 26.1 ms a step), went on "
                    "from step 15 (2 steps lost), training again 3.8 s after the failure")
