import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetplan.errors import HetplanError, InfeasibleError
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import cluster_from_spec, load_cluster
from hetplan.plan import plan_problems
from hetplan.planners import PLANNERS, PlanOptions, get_planner, make_plan
from hetplan.planners.baselines import chunk_sizes, default_microbatches
from slowness import limit_s
from strategies import clusters, graphs

V = "v100-16gb"
GiB = 2**30


def chain(n, params=0, acts=0, batch=32):
    nodes = tuple(Node(f"n{i}", "Linear", {V: 0.01}, {V: 0.02}, param_bytes=params, act_bytes=acts) for i in range(n))
    return Graph("chain", nodes, tuple(Edge(f"n{i}", f"n{i + 1}", 4) for i in range(n - 1)), batch, V)


def test_registry():
    assert {"single", "uniform"} <= set(PLANNERS)
    with pytest.raises(HetplanError, match="unknown planner 'magic' \\(planners: single, data-parallel, uniform"):
        get_planner("magic")


def test_chunk_sizes():
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(4, 4) == [1, 1, 1, 1]
    assert chunk_sizes(177, 4) == [45, 44, 44, 44]


@given(st.integers(1, 1024), st.integers(1, 16))
def test_default_microbatches_divide_the_batch(batch, stages):
    m = default_microbatches(batch, stages)
    assert batch % m == 0 and 1 <= m <= max(1, 4 * stages)
    if stages == 1:
        assert m == 1


def test_uniform_on_a_chain():
    plan = make_plan(chain(10), load_cluster("v100x4"), "uniform")
    assert [len(s.nodes) for s in plan.stages] == [3, 3, 2, 2]
    assert [s.devices for s in plan.stages] == [("v0",), ("v1",), ("v2",), ("v3",)]
    assert plan.stages[0].nodes == ("n0", "n1", "n2")
    assert plan.microbatches == 16 and plan.schedule == "1f1b"
    assert plan.graph == "chain" and plan.cluster == "v100x4" and plan.planner == "uniform"
    assert plan.predicted is not None and plan.meta["planning_s"] >= 0


def test_uniform_with_fewer_nodes_than_devices():
    plan = make_plan(chain(2), load_cluster("v100x8"), "uniform", PlanOptions(microbatches=4, schedule="gpipe"))
    assert len(plan.stages) == 2 and plan.microbatches == 4 and plan.schedule == "gpipe"


@given(st.data())
def test_uniform_is_valid_on_random_problems(data):
    g = data.draw(graphs(max_nodes=12))
    c = data.draw(clusters())
    plan = make_plan(g, c, "uniform")
    assert plan_problems(plan, g, c) == []
    sizes = [len(s.nodes) for s in plan.stages]
    assert max(sizes) - min(sizes) <= 1 and len(sizes) == min(len(g.nodes), len(c.devices))


def test_single_picks_the_fastest_device_that_fits():
    cluster = load_cluster("hetero-4")
    assert make_plan(chain(4), cluster, "single").stages[0].devices == ("a0",)
    # 5 GiB of parameters -> 20 GiB with gradients and Adam: too big for the T4s, fits the A100.
    big = chain(4, params=5 * GiB // 4)
    assert make_plan(big, cluster, "single").stages[0].devices == ("a0",)
    # Only the V100-32GB and the A100 fit 28 GiB; a cluster without the A100 must take the V100.
    spec = {"devices": [{"id": "t0", "type": "t4-16gb"}, {"id": "v0", "type": "v100-32gb"}]}
    heavy = chain(4, params=7 * GiB // 4)
    assert make_plan(heavy, cluster_from_spec(spec, "x"), "single").stages[0].devices == ("v0",)


def test_single_says_what_is_missing_when_nothing_fits():
    huge = chain(4, params=20 * GiB // 4)
    with pytest.raises(InfeasibleError, match=r"the whole model needs 80.0 GiB .* the largest device \(a0, "
                                              r"a100-40gb\) has 40.0 GiB: split it with a pipeline planner"):
        make_plan(huge, load_cluster("hetero-4"), "single")


def test_options_are_checked():
    with pytest.raises(HetplanError, match="--schedule: 'zigzag'"):
        PlanOptions(schedule="zigzag")
    with pytest.raises(HetplanError, match="--microbatches: 0"):
        PlanOptions(microbatches=0)


def test_dp_orders_sixteen_identical_cpus_at_once():
    """16 identical devices have one distinct order; listing all 16! permutations to find it would
    take far longer than planning the 2-node graph itself."""
    import itertools
    import time

    from hetplan.planners.devices import device_orders, distinct_permutations

    assert [tuple(p) for p in distinct_permutations(sorted("aabbc"))] == sorted(set(itertools.permutations("aabbc")))
    cluster = cluster_from_spec({"devices": [{"id": "c", "type": "cpu", "threads": 1, "count": 16}]}, "sixteen")
    start = time.perf_counter()
    assert device_orders(cluster, {"cpu-1t": 1.0}) == [tuple(f"c{i}" for i in range(16))]
    assert time.perf_counter() - start < limit_s(1)


def test_every_objective_a_plan_may_name_is_in_the_registry():
    """Planners read an objective's value, bound and floor from `objectives.OBJECTIVES`; a name
    the plan format accepts but the registry lacks would fail only when planned for."""
    from hetplan.plan import OBJECTIVES as NAMES
    from hetplan.planners.objectives import OBJECTIVES

    assert set(NAMES) == set(OBJECTIVES) and all(o.name == n for n, o in OBJECTIVES.items())
    assert [n for n, o in OBJECTIVES.items() if o.floor] == ["cost"]


def test_the_throughput_shortfall_is_zero_without_a_floor_even_for_a_step_of_no_time():
    """A step of 0 s gives infinite samples per second: 0 * inf made the RL environment's score NaN."""
    import numpy as np

    from hetplan.planners.objectives import shortfall
    from hetplan.planners.options import PlanOptions

    assert shortfall(np.array([1.0, np.inf]), PlanOptions()).tolist() == [0.0, 0.0]
    floor = PlanOptions(objective="cost", min_samples_per_s=10.0)
    assert shortfall(np.array([5.0, np.inf]), floor).tolist() == [1.0, 0.0]


def test_auto_schedule_takes_the_schedule_the_objective_prefers_where_it_fits():
    """Four equal stages with weights, 8 micro-batches: zero bubble's W fills 1F1B's bubble
    (27 against 33 forward-times, `tests/test_sim.py`), so `auto` takes it; where a stage's
    memory holds 1F1B's micro-batches in flight but not zero bubble's (which holds all four on
    the last stage), `auto` keeps 1F1B."""
    from dataclasses import replace

    from strategies import chain

    g = chain(4, fwd=0.08, bwd=0.16, params=1000)
    cluster = load_cluster("v100x8")
    plan = make_plan(g, cluster, "uniform", PlanOptions(schedule="auto", microbatches=8))
    assert plan.schedule == "zero-bubble" and plan.predicted.feasible
    ones = make_plan(g, cluster, "uniform", PlanOptions(schedule="1f1b", microbatches=8))
    assert plan.predicted.step_s == pytest.approx(ones.predicted.step_s * 27 / 33, rel=1e-3)
    # activations of 8 micro-batches of 6 GiB on the last device (16 GB): 1F1B holds 1, zero bubble 4
    heavy = replace(g, nodes=tuple(replace(n, act_bytes=48 * 2**30 if n.id == "n3" else 0) for n in g.nodes))
    tight = make_plan(heavy, cluster, "uniform", PlanOptions(schedule="auto", microbatches=8))
    assert tight.schedule == "1f1b" and tight.predicted.feasible
    with pytest.raises(HetplanError, match="--schedule: 'zigzag' is unknown .*1f1b.*, auto"):
        PlanOptions(schedule="zigzag")


def test_interleaved_1f1b_is_planned_from_the_planners_pipeline():
    """Eight equal nodes on two devices, 4 micro-batches: the planner's two stages become 2 v
    stages taking turns (v = 4, the most the eight nodes allow, shortens the bubble most:
    (4 v + 1) actions of 1/(4 v) of a device's work), cut evenly; dp, whose own plan is data
    parallel here (nothing to send), gets the best straight pipeline interleaved instead."""
    from strategies import chain

    g = chain(8, fwd=0.08, bwd=0.16)
    cluster = cluster_from_spec({"devices": [{"id": f"v{i}", "type": "v100-16gb", "host": "h"} for i in range(2)]},
                                "two")
    ones = make_plan(g, cluster, "uniform", PlanOptions(schedule="1f1b", microbatches=4))
    plan = make_plan(g, cluster, "uniform", PlanOptions(schedule="interleaved-1f1b", microbatches=4))
    assert plan.schedule == "interleaved-1f1b" and plan.ranks == 2 and len(plan.stages) == 8
    assert [s.devices for s in plan.stages] == [("v0",), ("v1",)] * 4 and not plan_problems(plan, g, cluster)
    work = 8 * (0.08 + 0.16) / 2  # each device's share of the batch
    assert plan.predicted.step_s == pytest.approx(17 * work / 16)
    assert ones.predicted.step_s == pytest.approx(5 * work / 4)
    assert make_plan(g, cluster, "dp").stages[0].devices == ("v0", "v1")  # data parallel
    assert make_plan(g, cluster, "dp", PlanOptions(schedule="interleaved-1f1b")).schedule == "interleaved-1f1b"
    with pytest.raises(HetplanError, match="--schedule interleaved-1f1b: the single plan has 1 stage"):
        make_plan(g, cluster, "single", PlanOptions(schedule="interleaved-1f1b"))


def test_zbv_is_planned_on_the_planners_devices_in_a_v():
    """The same chain under ZB-V: two stages per device on a V (the first device holds the first
    and the last), cut evenly, the micro-batches asked for (ZB-V runs any number); and the
    simulator's step is what it makes of torch's order (checked on its own in tests/test_sim.py)."""
    from strategies import chain

    g = chain(8, fwd=0.08, bwd=0.16)
    cluster = cluster_from_spec({"devices": [{"id": f"v{i}", "type": "v100-16gb", "host": "h"} for i in range(2)]},
                                "two")
    plan = make_plan(g, cluster, "uniform", PlanOptions(schedule="zb-v", microbatches=3))
    assert plan.schedule == "zb-v" and plan.ranks == 2 and plan.microbatches == 3
    assert [s.devices for s in plan.stages] == [("v0",), ("v1",), ("v1",), ("v0",)]
    assert [len(s.nodes) for s in plan.stages] == [2, 2, 2, 2] and not plan_problems(plan, g, cluster)
    ones = make_plan(g, cluster, "uniform", PlanOptions(schedule="1f1b", microbatches=3))
    assert plan.predicted.step_s < ones.predicted.step_s
    with pytest.raises(HetplanError, match="--schedule zb-v: the single plan has 1 stage"):
        make_plan(g, cluster, "single", PlanOptions(schedule="zb-v"))


@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=7), st.integers(1, 3), st.integers(1, 4), st.data())
def test_linear_cuts_are_the_brute_force_optimum(times, rows, parts, data):
    """`interleave.linear_cuts` against every way to cut N positions in `parts` pieces, part c
    timed on its row (any map of parts to rows), each cut costing its own price at its position."""
    import itertools

    import numpy as np

    from hetplan.planners.interleave import linear_cuts

    n = len(times)
    speeds = np.array([[1.0 + r] for r in range(rows)]) * np.array(times)[None, :]
    row_of = data.draw(st.lists(st.integers(0, rows - 1), min_size=parts, max_size=parts))
    cut_s = np.array(data.draw(st.lists(st.lists(st.floats(0.0, 10.0), min_size=n + 1, max_size=n + 1),
                                        min_size=parts - 1, max_size=parts - 1))).reshape(parts - 1, n + 1)

    def cost(bounds):
        worst = max(speeds[row_of[c], a:b].sum() for c, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)))
        return max([worst, *(cut_s[c, bounds[c + 1]] for c in range(parts - 1))])

    cuts = linear_cuts(speeds, row_of, cut_s)
    if n < parts:
        assert cuts is None
        return
    best = min(cost([0, *c, n]) for c in itertools.combinations(range(1, n), parts - 1))
    assert cuts[0] == 0 and cuts[-1] == n and all(a < b for a, b in zip(cuts, cuts[1:], strict=False))
    assert cost(cuts) == pytest.approx(best)
