import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetplan import catalog
from hetplan.cluster import cluster_from_spec, load_cluster
from hetplan.cost import CostModel, analytic_estimate, inflight_microbatches
from hetplan.graph import Edge, Graph, Node
from hetplan.plan import Plan, Stage
from hetplan.projection import project_s

V = "v100-16gb"
GiB = 2**30


def chain(n, fwd=0.03, bwd=0.05, edge_bytes=0, params=0, acts=0, batch=64):
    nodes = tuple(Node(f"n{i}", "Linear", {V: fwd}, {V: bwd}, param_bytes=params, act_bytes=acts) for i in range(n))
    edges = tuple(Edge(f"n{i}", f"n{i + 1}", edge_bytes) for i in range(n - 1))
    return Graph("chain", nodes, edges, batch_size=batch, profiled_on=V)


def one_per_stage(n, m, schedule="1f1b", ids=None):
    ids = ids or [f"v{i}" for i in range(n)]
    return Plan(tuple(Stage((f"n{i}",), (ids[i],)) for i in range(n)), m, schedule, "test")


@pytest.mark.parametrize("n,m", [(1, 1), (2, 4), (4, 8), (4, 1), (8, 16)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_equal_stages_without_communication(n, m, schedule):
    """(m + n - 1) x (t_fwd + t_bwd) per micro-batch: the textbook pipeline formula."""
    g = chain(n)
    cluster = load_cluster("v100x8")
    est = analytic_estimate(g, cluster, one_per_stage(n, m, schedule))
    per_micro = (0.03 + 0.05) / m
    assert est.step_s == pytest.approx((m + n - 1) * per_micro)
    assert est.bubble_fraction == pytest.approx(1 - m / (m + n - 1))
    assert est.samples_per_s == pytest.approx(64 / est.step_s)
    assert est.feasible and est.method == "analytic"


def test_memory_under_gpipe_and_1f1b():
    n, m = 4, 8
    g = chain(n, params=1000, acts=800)
    cluster = load_cluster("v100x4")
    for schedule in ("gpipe", "1f1b"):
        est = analytic_estimate(g, cluster, one_per_stage(n, m, schedule))
        for i in range(n):
            held = m if schedule == "gpipe" else min(m, n - i)
            assert est.peak_mem_bytes[f"v{i}"] == 4 * 1000 + 800 // m * held
    assert [inflight_microbatches("1f1b", 4, i, 2) for i in range(4)] == [2, 2, 2, 1]


def test_memory_violation_is_readable():
    g = chain(2, params=5 * GiB, acts=0)
    est = analytic_estimate(g, load_cluster("hetero-4"), one_per_stage(2, 1, ids=["a0", "t0"]))
    assert not est.feasible
    assert est.violations == ("stage 1 on t0 (t4-16gb) needs 20.0 GiB, has 16.0 GiB",)


def test_a_slow_link_bounds_the_step():
    mb = 10**9
    g = chain(2, fwd=0.001, bwd=0.001, edge_bytes=8 * mb)
    spec = {"devices": [{"id": "a", "type": "v100-16gb", "host": "x"}, {"id": "b", "type": "v100-16gb", "host": "y"}],
            "network": {"inter_host": {"bandwidth": "1GB/s", "latency": "0us"}}}
    cluster = cluster_from_spec(spec, "slow")
    m = 4
    est = analytic_estimate(g, cluster, one_per_stage(2, m, ids=["a", "b"]))
    link = 8 * mb / m / 1e9  # 2 s per micro-batch over the link
    assert est.step_s >= m * link
    assert est.step_s == pytest.approx(2 * 0.002 / m + 2 * link + (m - 1) * link)
    assert est.link_bytes == {"a->b": 8 * mb, "b->a": 8 * mb}


def test_replicas_split_by_speed_and_finish_together():
    g = chain(1, fwd=0.1, bwd=0.2, params=10**8)
    cluster = load_cluster("hetero-4")
    plan = Plan((Stage(("n0",), ("a0", "t0")),), 1, "gpipe", "test")
    cm = CostModel(g, cluster)
    shares = cm.replica_shares(("n0",), ("a0", "t0"))
    a100, t4 = catalog.CATALOG["a100-40gb"], catalog.CATALOG["t4-16gb"]
    assert shares["a0"] / shares["t0"] == pytest.approx(a100.peak_flops / t4.peak_flops)
    est = analytic_estimate(g, cluster, plan)
    assert est.busy_s["a0"] == pytest.approx(est.busy_s["t0"])
    assert est.step_s == pytest.approx(est.busy_s["a0"] + cm.allreduce_s(10**8, ("a0", "t0")))
    assert cm.allreduce_s(10**8, ("a0", "t0")) == pytest.approx(
        2 * (cluster.inter_host.latency_s + 10**8 / 2 / cluster.inter_host.bandwidth_Bps))


def test_projection_without_flops_uses_peak_flops():
    g = chain(1, fwd=0.2, bwd=0.4)
    cm = CostModel(g, load_cluster("hetero-4"))
    fwd, bwd = cm.stage_times_s(("n0",), "t4-16gb")
    ratio = catalog.CATALOG[V].peak_flops / catalog.CATALOG["t4-16gb"].peak_flops
    assert (fwd, bwd) == pytest.approx((0.2 * ratio, 0.4 * ratio))
    assert cm.stage_times_s(("n0",), V) == (0.2, 0.4)  # measured type: no projection


def test_roofline_projection():
    v100, t4 = catalog.CATALOG[V], catalog.CATALOG["t4-16gb"]
    # Compute-bound (1e12 FLOPs, 1 MB): scales with peak FLOP/s.
    assert project_s(1.0, 1e12, 1e6, v100, t4) == pytest.approx(v100.peak_flops / t4.peak_flops)
    # Memory-bound (1e6 FLOPs, 1 GB): scales with memory bandwidth.
    assert project_s(1.0, 1e6, 1e9, v100, t4) == pytest.approx(v100.mem_bw_Bps / t4.mem_bw_Bps)
    assert project_s(1.0, 1e12, 1e6, v100, v100) == 1.0
    assert project_s(0.0, 1e12, 1e6, v100, t4) == 0.0
    # Through the cost model: a node with FLOPs is projected per node by the roofline.
    n = Node("n0", "Linear", {V: 0.1}, {V: 0.2}, flops=1e12, param_bytes=10**6, out_bytes=0)
    g = Graph("one", (n,), (), batch_size=1, profiled_on=V)
    fwd, bwd = CostModel(g, load_cluster("hetero-4")).stage_times_s(("n0",), "t4-16gb")
    assert (fwd, bwd) == pytest.approx((0.1 * v100.peak_flops / t4.peak_flops, 0.2 * v100.peak_flops / t4.peak_flops))


def test_price_per_step():
    g = chain(2)
    cluster = load_cluster("hetero-4")
    est = analytic_estimate(g, cluster, one_per_stage(2, 2, ids=["a0", "t0"]))
    assert est.usd_per_step == pytest.approx((1.50 + 0.35) * est.step_s / 3600)


@given(st.integers(1, 4), st.integers(1, 32), st.floats(0.001, 1), st.floats(0.001, 1))
def test_step_is_at_least_the_busiest_device(n, m, fwd, bwd):
    g = chain(n, fwd=fwd, bwd=bwd, edge_bytes=10**7)
    est = analytic_estimate(g, load_cluster("hetero-4"), one_per_stage(n, m, ids=["a0", "v0", "t0", "t1"]))
    assert est.step_s >= max(est.busy_s.values()) * (1 - 1e-9)
    assert 0 <= est.bubble_fraction < 1
