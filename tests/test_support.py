"""What the runtime can run (`hetplan.runtime.support`), as the planners and the launcher read it."""

from hetplan.io.clusters import cluster_from_spec, load_cluster
from hetplan.plan import Plan, Stage
from hetplan.planners import make_plan
from hetplan.runtime.support import runtime_refusal
from strategies import chain


def test_every_valid_plan_runs_on_bound_devices_and_none_on_unbound_ones():
    bound = cluster_from_spec({"name": "b", "devices": [
        {"id": f"c{i}", "type": "cpu", "threads": t, "binding": "cpu"} for i, t in enumerate((1, 2, 4, 8))]}, "b")
    uneven = Plan((Stage(("n0",), ("c0", "c1", "c2")), Stage(("n1",), ("c3",))), 1, "1f1b", "test")  # 3 + 1, m < n
    assert runtime_refusal(uneven, bound) is None
    unbound = load_cluster("hetero-4")
    one = Plan((Stage(("n0", "n1"), ("a0",)),), 1, "gpipe", "test")
    assert "device a0 of cluster 'hetero-4' has no binding" in runtime_refusal(one, unbound)


def test_planners_record_the_runtimes_verdict():
    g = chain(4, fwd=0.01, bwd=0.02, batch=16)
    g = g.__class__(g.name, tuple(n.__class__(n.id, n.op, {"cpu-1t": 0.01}, {"cpu-1t": 0.02}) for n in g.nodes),
                    g.edges, 16, "cpu-1t")
    local = cluster_from_spec({"name": "l", "devices": [
        {"id": f"c{i}", "type": "cpu", "threads": 1, "binding": "cpu"} for i in range(3)]}, "l")
    for planner in ("dp", "uniform", "data-parallel"):
        assert make_plan(g, local, planner).meta["runtime_refusal"] is None
    assert "no binding" in make_plan(chain(4), load_cluster("v100x4"), "dp").meta["runtime_refusal"]
