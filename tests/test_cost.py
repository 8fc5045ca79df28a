import pytest

from hetplan import catalog
from hetplan.cost import CostModel, inflight_microbatches, microbatch_fractions
from hetplan.cost.projection import project_s
from hetplan.graph import Graph, Node
from hetplan.io.clusters import load_cluster
from strategies import V, chain, one_per_stage


def test_memory_formula_under_gpipe_and_1f1b():
    n = 4
    g = chain(n, params=1000, acts=800, batch=64)
    cm = CostModel(g, load_cluster("v100x4"))
    for m in (1, 2, 8):
        for schedule in ("gpipe", "1f1b"):
            plan = one_per_stage(n, m, schedule)
            for i in range(n):
                held = m if schedule == "gpipe" else min(m, n - i)
                assert cm.stage_memory_bytes(plan, i, f"v{i}") == 4 * 1000 + 800 * held // m
    assert [inflight_microbatches("1f1b", 4, i, 2) for i in range(4)] == [2, 2, 2, 1]


def test_memory_with_unequal_microbatches_counts_the_largest():
    """A batch of 10 in 4 micro-batches is 3, 3, 2, 2 samples (torch.tensor_split); a 1F1B stage
    that holds two micro-batches holds the two of 3."""
    assert microbatch_fractions(10, 4) == (0.3, 0.3, 0.2, 0.2)
    g = chain(4, params=0, acts=1000, batch=10)
    cm = CostModel(g, load_cluster("v100x4"))
    plan = one_per_stage(4, 4, "1f1b")
    assert [cm.stage_memory_bytes(plan, i, f"v{i}") for i in range(4)] == [1000, 800, 600, 300]


def test_replica_shares_follow_speed_and_ring_allreduce():
    g = chain(1, fwd=0.1, bwd=0.2, params=10**8)
    cluster = load_cluster("hetero-4")
    cm = CostModel(g, cluster)
    shares = cm.replica_shares(("n0",), ("a0", "t0"))
    a100, t4 = catalog.CATALOG["a100-40gb"], catalog.CATALOG["t4-16gb"]
    assert shares["a0"] / shares["t0"] == pytest.approx(a100.peak_flops / t4.peak_flops)
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


