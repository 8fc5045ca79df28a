import pytest

from hetplan import catalog
from hetplan.cost import CostModel, inflight_microbatches, microbatch_fractions
from hetplan.cost.projection import project_s
from hetplan.graph import Graph, Node
from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan, Stage
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
    shares = cm._replica_shares(("n0",), ("a0", "t0"))
    a100, t4 = catalog.CATALOG["a100-40gb"], catalog.CATALOG["t4-16gb"]
    assert shares["a0"] / shares["t0"] == pytest.approx(a100.peak_flops / t4.peak_flops)
    assert cm._allreduce_s(10**8, ("a0", "t0")) == pytest.approx(
        2 * (cluster.inter_host.latency_s + 10**8 / 2 / cluster.inter_host.bandwidth_Bps))


def test_projection_without_flops_uses_peak_flops():
    g = chain(1, fwd=0.2, bwd=0.4)
    cm = CostModel(g, load_cluster("hetero-4"))
    fwd, bwd = cm._stage_times_s(("n0",), "t4-16gb")
    ratio = catalog.CATALOG[V].peak_flops / catalog.CATALOG["t4-16gb"].peak_flops
    assert (fwd, bwd) == pytest.approx((0.2 * ratio, 0.4 * ratio))
    assert cm._stage_times_s(("n0",), V) == (0.2, 0.4)  # measured type: no projection


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
    fwd, bwd = CostModel(g, load_cluster("hetero-4"))._stage_times_s(("n0",), "t4-16gb")
    assert (fwd, bwd) == pytest.approx((0.1 * v100.peak_flops / t4.peak_flops, 0.2 * v100.peak_flops / t4.peak_flops))




def test_host_work_takes_its_measured_time_on_every_device_type():
    """A node that runs on the host (input parsing) is as slow on a GPU's stage as measured on a
    CPU; the same node without the flag is projected (roofline, here peak FLOP/s)."""
    cpu = catalog.cpu_type(1)
    host = Node("parse", "CriteoParser", {cpu.name: 0.002}, {cpu.name: 0.0}, runs_on_host=True)
    plain = Node("mlp", "MLP", {cpu.name: 0.002}, {cpu.name: 0.0})
    g = Graph("g", (host, plain), (), batch_size=8, profiled_on=cpu.name)
    cm = CostModel(g, load_cluster("cloud-mix"))
    for dtype in ("t4-16gb", "a100-40gb", "cpu-16t"):
        times = cm._node_times_s(dtype)
        assert times["parse"] == (0.002, 0.0)
        assert times["mlp"][0] == pytest.approx(0.002 * cpu.peak_flops / catalog.lookup(dtype).peak_flops)


def test_a_sparse_tables_optimizer_step_costs_its_looked_up_rows():
    """The optimizer of a table with sparse gradients updates `updated_bytes`, not the table:
    the simulated step is shorter by exactly the difference of the two optimizer steps."""
    from hetplan.sim import simulate

    cluster = load_cluster("cloud-mix")
    table = Node("t", "EmbeddingBag", {V: 0.001}, {V: 0.001}, param_bytes=4 * 10**8)
    g_dense = Graph("g", (table,), (), batch_size=8, profiled_on=V)
    g_sparse = Graph("g", (Node(**{**table.__dict__, "updated_bytes": 4 * 10**4}),), (), batch_size=8, profiled_on=V)
    plan = Plan((Stage(("t",), ("c0",)),), 1, "1f1b", "test")
    steps = [simulate(g, cluster, plan).estimate.step_s for g in (g_dense, g_sparse)]
    cm = CostModel(g_dense, cluster)
    assert CostModel(g_sparse, cluster)._optimizer_bytes(("t",)) == 4 * 10**4
    assert steps[0] - steps[1] == pytest.approx(cm._optimizer_s(4 * 10**8, "c0") - cm._optimizer_s(4 * 10**4, "c0"))
    assert steps[0] - steps[1] > 0.01  # Adam over 400 MB on a 16-thread CPU: about 17 ms


def test_replicas_of_a_sparse_table_sum_its_looked_up_rows_not_the_table():
    """Replicas of a table with sparse gradients exchange its looked-up rows (`runtime.gradients`):
    an all-reduce of the bytes the optimizer updates, and two before it, of each replica's row
    count (8 bytes each) and of the rows' indices (8 bytes a row); and the bytes updated copied
    into the all-reduced buffer and back. A dense table: one all-reduce of all of it, and its
    copies. The simulator, the bottleneck and the array form charge the same."""
    import numpy as np

    from hetplan.cost.table import step_costs

    cluster = load_cluster("cloud-mix")
    pair = ("t0", "t1")
    table = Node("t", "EmbeddingBag", {V: 0.001}, {V: 0.001}, param_bytes=4 * 10**8)
    sparse = Node(**{**table.__dict__, "updated_bytes": 4 * 10**4, "sparse_rows": 10**3})
    plan = Plan((Stage(("t",), pair),), 1, "1f1b", "test")
    charged = []
    for node in (sparse, table):
        g = Graph("g", (node,), (), batch_size=8, profiled_on=V)
        cm = CostModel(g, cluster)
        charged.append(cm._stage_sync_s(("t",), pair))
        assert step_costs(g, cluster, plan, cost=cm).stages[0].allreduce_s == charged[-1]
    slowest = min(cluster.types[cluster.device(d).type].mem_bw_Bps for d in pair)
    rows = cm._allreduce_s(4 * 10**4, pair) + cm._allreduce_s(8 * 10**3, pair) + cm._allreduce_s(16.0, pair)
    # and the bytes updated copied into the all-reduced buffer and back, on the slower replica
    rows += 2 * 4 * 10**4 / slowest
    whole = cm._allreduce_s(4 * 10**8, pair) + 2 * 4 * 10**8 / slowest
    assert charged == [pytest.approx(rows), pytest.approx(whole)]
    assert charged[1] > 100 * charged[0]
    both = cm._gradient_sync_s(np.array([4e4, 4e8]), np.array([8e3, 0.0]), pair)
    assert both == pytest.approx(charged)
    assert cm._gradient_sync_s(4e4, 8e3, ("t0",)) == 0.0


def test_sparse_rows_need_updated_bytes():
    from hetplan.errors import GraphError

    with pytest.raises(GraphError, match="sparse_rows"):
        Node("t", "EmbeddingBag", {V: 0.0}, {V: 0.0}, param_bytes=10, sparse_rows=3)


def test_updated_bytes_are_checked_and_kept():
    from hetplan.errors import GraphError
    from hetplan.io import serde

    with pytest.raises(GraphError, match="updated_bytes"):
        Node("t", "EmbeddingBag", {V: 0.0}, {V: 0.0}, param_bytes=10, updated_bytes=11)
    node = Node("t", "EmbeddingBag", {V: 0.0}, {V: 0.0}, param_bytes=10, updated_bytes=4, runs_on_host=True)
    g = Graph("g", (node,), (), batch_size=8, profiled_on=V)
    back = serde.loads(serde.dumps(g))
    assert back.node("t") == node and back.node("t").optimizer_bytes == 4


def test_a_measured_optimizer_step_takes_precedence_over_the_formula():
    """On a device type where the profiler timed each node's optimizer step, a stage's step is
    their sum; elsewhere the formula of the bytes it updates."""
    from hetplan.sim import simulate

    cluster = load_cluster("cloud-mix")  # c0: cpu-16t, t0: t4-16gb
    nodes = (Node("a", "EmbeddingBag", {"cpu-16t": 0.001}, {"cpu-16t": 0.001}, param_bytes=10**6,
                  updated_bytes=10**3, opt_s={"cpu-16t": 0.004}),
             Node("b", "Linear", {"cpu-16t": 0.001}, {"cpu-16t": 0.001}, param_bytes=10**6, opt_s={"cpu-16t": 0.002}))
    g = Graph("g", nodes, (), batch_size=8, profiled_on="cpu-16t")
    cm = CostModel(g, cluster)
    assert cm._stage_optimizer_s(("a", "b"), "c0") == pytest.approx(0.006)
    assert cm._stage_optimizer_s(("a", "b"), "t0") == pytest.approx(cm._optimizer_s(10**3 + 10**6, "t0"))
    plain = Graph("g", tuple(Node(**{**n.__dict__, "opt_s": {}}) for n in nodes), (), batch_size=8,
                  profiled_on="cpu-16t")
    plan = Plan((Stage(("a", "b"), ("c0",)),), 1, "1f1b", "test")
    steps = [simulate(x, cluster, plan).estimate.step_s for x in (g, plain)]
    assert steps[0] - steps[1] == pytest.approx(0.006 - cm._optimizer_s(10**3 + 10**6, "c0"))


def test_a_graph_profiled_under_a_type_alias_is_projected_from_its_own_times():
    """'cpu' is the catalog's alias of cpu-1t; the node times stay keyed 'cpu' (this raised a
    KeyError 'cpu-1t' in `hetplan plan` before)."""
    nodes = [Node(f"n{i}", "Linear", {"cpu": 1e-3}, {"cpu": 2e-3}, flops=1e9) for i in range(2)]
    graph = Graph("g", nodes, (), batch_size=4, profiled_on="cpu")
    cm = CostModel(graph, load_cluster("hetero-4"))
    assert cm.projected_types()["a100-40gb"] == "cpu"
    fwd, bwd = cm._node_times_s("a100-40gb")["n0"]
    src = catalog.find("cpu")
    assert fwd == project_s(1e-3, 1e9, 0, src, catalog.find("a100-40gb")) and 0 < fwd < bwd


def test_an_alias_is_the_type_it_names_not_a_type_to_project_to():
    """Times under 'cpu' are cpu-1t's: not projected (from cpu-2t or anything else), no note."""
    nodes = [Node("n0", "Linear", {"cpu": 1e-3, "cpu-2t": 4e-3}, {"cpu": 2e-3, "cpu-2t": 8e-3}, flops=1e9,
                  fwd_fixed_s={"cpu": 1e-4}, opt_s={"cpu": 5e-4})]
    graph = Graph("g", nodes, (), batch_size=4, profiled_on="cpu")
    cm = CostModel(graph, load_cluster("local"))  # cpu-1t workers
    assert cm.projected_types() == {} and cm.measured_name("cpu-1t") == "cpu"
    assert cm._node_times_s("cpu-1t")["n0"] == (1e-3, 2e-3) and cm._node_fixed_s("cpu-1t")["n0"] == (1e-4, 0.0)
    assert cm._measured_optimizer_s("cpu-1t") == {"n0": 5e-4}


def test_the_cost_model_keeps_what_fits_and_drops_the_oldest(monkeypatch):
    """`CostModel.kept`: made once while kept; the oldest dropped when the sizes would pass
    `KEPT`; one bigger than `KEPT` made every time, never kept (a deep plan's lists)."""
    import hetplan.cost as cost_module

    monkeypatch.setattr(cost_module, "KEPT", 10)
    cm = CostModel(chain(2), load_cluster("v100x8"))
    made = []

    def make(name):
        return lambda: made.append(name) or name

    assert cm.kept(("a",), make("a"), lambda _: 6) == "a" and cm.kept(("a",), make("a"), lambda _: 6) == "a"
    cm.kept(("b",), make("b"), lambda _: 4)
    cm.kept(("c",), make("c"), lambda _: 3)  # 6 + 4 + 3 > 10: "a" goes
    cm.kept(("b",), make("b"), lambda _: 4)
    cm.kept(("a",), make("a"), lambda _: 6)  # made again
    cm.kept(("big",), make("big"), lambda _: 11)
    cm.kept(("big",), make("big"), lambda _: 11)
    assert made == ["a", "b", "c", "a", "big", "big"]
