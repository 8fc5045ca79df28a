"""`hetplan run --elastic` (`runtime.elastic`): a worker of a 4-stage mlp run dies at step 6; the
launcher re-plans (dp) on the 3 devices left, goes on from the last checkpoint (written by the
4-stage plan, loaded by the new one), finishes every step, exit 0, and says what it lost. The
losses after the change are those of the run that never lost a worker (pipelined training
equals one process's whatever the plan)."""

import json

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
