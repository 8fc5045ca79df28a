"""The availability replay (`hetplan.availability`): three policies over a trace of devices
coming and going, worked out by hand on a small trace; the trace's checks; the devices there;
`hetplan replay` on a real problem."""

import json

import pytest

from hetplan.availability import Availability, Choice, Costs, available, decide, load_availability, replay
from hetplan.errors import HetplanError
from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan, Stage


def made(name: str, uses: dict, samples_per_s: float, usd_per_s: float) -> Choice:
    return Choice(Plan((Stage((name,), (name,)),), 1, "gpipe", name), uses, samples_per_s, usd_per_s)


FOUR, TWO = made("four", {"a": 4}, 40.0, 4.0), made("two", {"a": 2}, 25.0, 2.0)
# 4 devices, 2 for a while (the four-device plan loses two from under it), 4 again
TRACE = Availability((0.0, 100.0, 200.0), ({"a": 4}, {"a": 2}, {"a": 4}), 300.0)


def plan_for(counts):
    return {4: FOUR, 2: TWO}.get(counts["a"])


def test_three_policies_worked_out_by_hand():
    static, every, worth = replay(TRACE, plan_for, Costs(restart_s=10.0, checkpoint_every_s=20.0))
    # static: 100 s at 40/s; stopped by the loss (10 s of work again: -400), 100 s stopped; a
    # restart of 10 s, then 90 s at 40/s
    assert (static.samples, static.lost_s, static.stopped_s, static.restarts) == (4000 - 400 + 3600, 20.0, 100.0, 1)
    assert static.usd == 4.0 * 100 + 4.0 * 100
    # every change: the loss (-400), then the two-device plan after a restart (90 s at 25/s), then
    # the four-device plan after another (90 s at 40/s)
    assert (every.samples, every.lost_s, every.stopped_s, every.restarts) == (4000 - 400 + 2250 + 3600, 30.0, 0.0, 2)
    assert every.usd == 4.0 * 100 + 2.0 * 100 + 4.0 * 100
    # worth it: (40 - 25) x 100 s (the mean interval so far) > 40 x 10 s: the same changes
    assert worth.samples == every.samples


def test_a_change_not_worth_its_restart_is_not_made():
    every, worth = replay(TRACE, plan_for, Costs(restart_s=50.0, checkpoint_every_s=20.0),
                          ("every-change", "when-worth-it"))
    # a gain of (40 - 25) x 100 = 1,500 samples against 40 x 50 = 2,000 lost restarting: stay on two
    assert worth.samples == 4000 - 400 + 25 * 50 + 25 * 100 and worth.restarts == 1
    assert every.samples == 4000 - 400 + 25 * 50 + 40 * 50 and every.restarts == 2
    assert worth.samples > every.samples


def test_a_free_restart_is_still_a_restart():
    static, every, _ = replay(TRACE, plan_for, Costs(restart_s=0.0, checkpoint_every_s=20.0))
    assert (static.restarts, every.restarts) == (1, 2) and every.lost_s == 10.0  # the work redone only
    assert every.samples == 4000 - 400 + 2500 + 4000


def test_decide():
    assert decide("when-worth-it", None, False, TWO, 10.0, 100.0)  # nothing running: start
    assert decide("when-worth-it", FOUR, False, TWO, 10.0, 100.0)  # the running plan lost devices
    assert not decide("when-worth-it", TWO, True, FOUR, 50.0, 100.0)
    assert decide("every-change", TWO, True, FOUR, 50.0, 100.0)
    assert not decide("every-change", FOUR, True, FOUR, 0.0, 100.0)  # the same plan: nothing to change
    assert not decide("static", TWO, True, FOUR, 0.0, 100.0)
    assert not decide("when-worth-it", FOUR, False, None, 0.0, 100.0)  # nothing fits: stop


@pytest.mark.parametrize("points,horizon,said", [
    ([{"t_s": 5, "counts": {"a": 1}}], 10, "starts at t_s 0"),
    ([{"t_s": 0, "counts": {"a": 1}}, {"t_s": 0, "counts": {"a": 2}}], 10, "go forward in time"),
    ([{"t_s": 0, "counts": {"a": 1}}], 0, "end before its horizon_s"),
    ([{"t_s": 0, "counts": {"a": -1}}], 10, "whole numbers, 0 or more"),
    ([{"t_s": 0, "counts": {"a": 1.5}}], 10, "whole numbers, 0 or more"),
    ([{"t_s": 0}], 10, "not an availability trace"),
])
def test_a_bad_trace_is_refused_in_one_line(tmp_path, points, horizon, said):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"horizon_s": horizon, "points": points}))
    with pytest.raises(HetplanError, match=said) as err:
        load_availability(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_the_devices_there_are_the_first_of_each_type():
    cluster = load_cluster("hetero-4")
    there = available(cluster, {"t4-16gb": 1, "a100-40gb": 1, "v100-32gb": 0})
    assert sorted(there.ids) == ["a0", "t0"]
    assert available(cluster, {"t4-16gb": 0}) is None
    with pytest.raises(HetplanError, match="the trace has 3 devices of type 't4-16gb' but cluster hetero-4 only 2"):
        available(cluster, {"t4-16gb": 3})


def test_hetplan_replay_on_resnet50_over_hetero_4(tmp_path, profiles, cli):
    graph, trace = tmp_path / "r50.json", tmp_path / "trace.json"
    assert cli("import", "pipedream", profiles / "resnet50" / "graph.txt", "-o", graph).code == 0
    full = {"a100-40gb": 1, "v100-32gb": 1, "t4-16gb": 2}
    trace.write_text(json.dumps({"horizon_s": 7200, "points": [
        {"t_s": 0, "counts": full}, {"t_s": 1800, "counts": {**full, "a100-40gb": 0}},
        {"t_s": 3600, "counts": {**full, "t4-16gb": 1}}, {"t_s": 5400, "counts": full}]}))
    r = cli("replay", graph, "--cluster", "hetero-4", "--trace", trace, "--restart-s", "60", "--json")
    assert r.code == 0, r.err
    runs = {run["policy"]: run for run in r.json()["runs"]}
    assert set(runs) == {"static", "every-change", "when-worth-it"}
    # dp's first plan takes all four GPUs: static stops while the A100 is gone and while a T4 is,
    # the others go on with what is there
    plan = cli("plan", graph, "--cluster", "hetero-4", "--json").json()
    assert sum(len(stage["devices"]) for stage in plan["stages"]) == 4
    assert runs["static"]["stopped_s"] == 3600 and runs["every-change"]["stopped_s"] == 0
    assert runs["when-worth-it"]["samples"] >= runs["static"]["samples"]
    r = cli("replay", graph, "--cluster", "hetero-4", "--trace", trace)
    assert r.code == 0 and "when-worth-it" in r.out and "$ per M samples" in r.out
