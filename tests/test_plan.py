import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetplan.errors import PlanError
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan, Stage, plan_problems, validate_plan
from strategies import clusters, graphs, plans_for

V = "v100-16gb"


@pytest.fixture
def diamond():
    nodes = tuple(Node(i, "Linear", {V: 1.0}, {V: 1.0}) for i in "abcd")
    edges = (Edge("a", "b"), Edge("a", "c"), Edge("b", "d"), Edge("c", "d"))
    return Graph("diamond", nodes, edges, batch_size=8, profiled_on=V)


@pytest.fixture
def v4():
    return load_cluster("v100x4")


def plan(*stages, m=2, **kw):
    return Plan(tuple(Stage(tuple(n), tuple(d)) for n, d in stages), m, "1f1b", "test", **kw)


def test_a_valid_plan(diamond, v4):
    p = plan(("a", ["v0"]), ("bc", ["v1", "v2"]), ("d", ["v3"]))
    validate_plan(p, diamond, v4)
    assert plan_problems(p, diamond, v4) == []
    assert p.devices == ("v0", "v1", "v2", "v3")
    # Branches b and c in separate stages: each is convex and no edge goes backwards.
    validate_plan(plan(("ab", ["v0"]), ("c", ["v1"]), ("d", ["v2"])), diamond, v4)


def _one(p, graph, cluster):
    problems = plan_problems(p, graph, cluster)
    assert len(problems) >= 1
    with pytest.raises(PlanError) as err:
        validate_plan(p, graph, cluster)
    assert "\n" not in str(err.value)
    return problems


def test_missing_and_duplicate_and_unknown_nodes(diamond, v4):
    assert _one(plan(("abc", ["v0"])), diamond, v4) == ["no stage holds node d"]
    problems = _one(plan(("abc", ["v0"]), ("cd", ["v1"])), diamond, v4)
    assert "node 'c' is in stage 0 and in stage 1; each node goes in one stage" in problems
    problems = _one(plan(("abcd", ["v0"]), ("x", ["v1"])), diamond, v4)
    assert problems == ["stage 1 names node 'x', which graph 'diamond' does not have"]


def test_non_convex_stage_is_named_with_its_path(diamond, v4):
    problems = _one(plan(("ad", ["v0"]), ("bc", ["v1"])), diamond, v4)
    assert any(p.startswith("stage 0 is not convex: the path a -> ") and p.endswith("-> d leaves it and comes back")
               for p in problems)


def test_backward_edge_is_named(diamond, v4):
    problems = _one(plan(("b", ["v0"]), ("a", ["v1"]), ("cd", ["v2"])), diamond, v4)
    assert "edge a -> b goes backwards, from stage 1 to stage 0" in problems


def test_devices_must_exist_and_not_be_shared(diamond, v4):
    assert _one(plan(("abcd", ["gpu9"])), diamond, v4)[0].startswith("stage 0 uses device 'gpu9', which cluster")
    problems = _one(plan(("ab", ["v0"]), ("cd", ["v0"])), diamond, v4)
    assert problems == ["device 'v0' holds stage 0 and stage 1; set shared_devices to allow it"]
    validate_plan(plan(("ab", ["v0"]), ("cd", ["v0"]), shared_devices=True), diamond, v4)
    assert "lists a device twice" in _one(plan(("abcd", ["v0", "v0"])), diamond, v4)[0]


def test_interleaved_stages_take_turns_on_groups_apart(diamond, v4):
    def il(*stages, m=4):
        return Plan(tuple(Stage(tuple(n), tuple(d)) for n, d in stages), m, "interleaved-1f1b", "test")

    good = il(("a", ["v0"]), ("b", ["v1", "v2"]), ("c", ["v0"]), ("d", ["v1", "v2"]))
    validate_plan(good, diamond, v4)  # devices hold two stages without shared_devices: one worker each
    assert good.ranks == 2 and plan(("abcd", ["v0"])).ranks == 1
    assert _one(il(("a", ["v0"]), ("b", ["v1"]), ("c", ["v1"]), ("d", ["v0"])), diamond, v4) == [
        "stage 2 runs on v1, but under interleaved-1f1b stage 2 runs on the devices of stage 0: v0",
        "stage 3 runs on v0, but under interleaved-1f1b stage 3 runs on the devices of stage 1: v1"]
    problems = _one(il(("a", ["v0"]), ("b", ["v0", "v1"]), ("c", ["v0"]), ("d", ["v0", "v1"])), diamond, v4)
    assert problems == ["stages 0 and 1 share a device but not all their devices; under interleaved-1f1b each "
                        "rank's devices are its own"]
    assert "5 micro-batches in 2 rounds" in _one(il(("a", ["v0"]), ("b", ["v1"]), ("c", ["v0"]), ("d", ["v1"]), m=5),
                                                 diamond, v4)[0]
    assert "3 stages on 2 rank(s)" in _one(il(("ab", ["v0"]), ("c", ["v1"]), ("d", ["v0"])), diamond, v4)[0]
    assert "use n >= 2 ranks" in _one(il(("abcd", ["v0"])), diamond, v4)[0]


def test_too_many_microbatches(diamond, v4):
    assert _one(plan(("abcd", ["v0"]), m=9), diamond, v4) == [
        "9 micro-batches for a batch of 8 samples; use at most 8"]


def test_plan_fields_are_checked():
    with pytest.raises(PlanError, match="schedule 'zigzag' is unknown"):
        Plan((Stage(("a",), ("v0",)),), 1, "zigzag", "x")
    with pytest.raises(PlanError, match="microbatches is 0"):
        Plan((Stage(("a",), ("v0",)),), 0, "gpipe", "x")
    with pytest.raises(PlanError, match="no device"):
        Stage(("a",), ())
    with pytest.raises(PlanError, match="at least one stage"):
        Plan((), 1, "gpipe", "x")


@given(st.data())
def test_random_contiguous_plans_are_valid(data):
    g = data.draw(graphs(max_nodes=10))
    c = data.draw(clusters())
    p = data.draw(plans_for(g, c))
    assert plan_problems(p, g, c) == []


@given(st.data())
def test_swapping_two_stages_with_an_edge_between_them_is_caught(data):
    g = data.draw(graphs(min_nodes=2, max_nodes=10))
    c = data.draw(clusters(min_devices=2))
    p = data.draw(plans_for(g, c))
    if len(p.stages) < 2:
        return
    i = data.draw(st.integers(0, len(p.stages) - 2))
    stages = list(p.stages)
    stages[i], stages[i + 1] = stages[i + 1], stages[i]
    swapped = Plan(tuple(stages), p.microbatches, p.schedule, p.planner)
    crossing = any(e.src in p.stages[i].nodes and e.dst in p.stages[i + 1].nodes for e in g.edges)
    assert bool(plan_problems(swapped, g, c)) == crossing
