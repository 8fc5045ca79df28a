"""The numpy fast path against the event simulator: exact on chains of single-device stages
where no host's network interface carries two streams, the same ranking on any plans."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from scipy.stats import spearmanr

from hetplan.cost.table import lower_chain, step_costs
from hetplan.graph import Edge
from hetplan.io.clusters import load_cluster
from hetplan.io.pipedream import import_pipedream
from hetplan.plan import Plan, Stage
from hetplan.planners.randomized import random_plan
from hetplan.schedule import get_schedule
from hetplan.sim import simulate
from hetplan.sim.chains import ChainScorer
from hetplan.sim.fast import ChainProgram, fast_step_s
from strategies import MIXED as CLUSTER
from strategies import ONE_PER_RANK, chain, graphs, one_per_stage, one_stream_per_host_interface


@st.composite
def chain_plans(draw):
    graph = draw(graphs(min_nodes=1, max_nodes=10))
    order = graph.topo_order
    k = draw(st.integers(1, min(len(order), len(CLUSTER.ids))))
    cuts = sorted(draw(st.sets(st.integers(1, len(order) - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
    bounds = [0, *cuts, len(order)]
    devices = draw(st.permutations(CLUSTER.ids))
    stages = tuple(Stage(order[bounds[i]:bounds[i + 1]], (devices[i],)) for i in range(k))
    m = draw(st.integers(1, min(graph.batch_size, 12)))
    return graph, Plan(stages, m, draw(st.sampled_from(ONE_PER_RANK)), "random")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(chain_plans())
def test_fast_path_equals_the_event_simulator_on_chains(case):
    """Every resource's order is fixed (a device sends in the order its actions make tensors and
    receives in the order they use them), so the recurrence is the event simulation exactly
    (tensors that skip stages relayed, uneven micro-batches, latencies, zero-byte edges)."""
    graph, plan = case
    assume(one_stream_per_host_interface(CLUSTER, [s.devices[0] for s in plan.stages]))
    event = simulate(graph, CLUSTER, plan, routing="relay", timeline=False).estimate.step_s
    assert fast_step_s(graph, CLUSTER, [plan])[0] == pytest.approx(event, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("degrees", [(2, 2), (1, 2), (2, 1)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fast_path_equals_the_event_simulator_on_chains_of_tensor_parallel_groups(degrees, schedule):
    """A group's first device sends a stage's values to every device of the next stage's group
    (as `hetplan run` does): the activations as many times as the receiving group has devices,
    the gradients back as many as the sending group has; two stages on two hosts, 1, 2 and 4
    micro-batches."""
    from hetplan.graph import Graph, Node
    from hetplan.io.clusters import cluster_from_spec

    nodes = tuple(Node(f"n{i}", "Block", {"cpu-1t": 0.01 * (i + 1)}, {"cpu-1t": 0.02 * (i + 1)}, out_bytes=8_000_000,
                       param_bytes=1000, act_bytes=1000, tp_units=4) for i in range(4))
    graph = Graph("g", nodes, tuple(Edge(f"n{i}", f"n{i + 1}", 8_000_000) for i in range(3)), 8, "cpu-1t")
    cluster = cluster_from_spec({"name": "c", "devices": [
        {"id": f"c{i}", "type": "cpu-1t", "host": f"h{i // 2}"} for i in range(4)], "network": {
        "intra_host": {"bandwidth": "1GB/s"}, "inter_host": {"bandwidth": "100MB/s", "latency": "10us"}}}, "c")
    stages = []
    for k, t in enumerate(degrees):
        group = tuple(cluster.ids[2 * k:2 * k + t])
        stages.append(Stage((f"n{2 * k}", f"n{2 * k + 1}"), (group[0],), tp=t, tp_devices=(group,) if t > 1 else ()))
    for m in (1, 2, 4):
        plan = Plan(tuple(stages), m, schedule, "t")
        event = simulate(graph, cluster, plan, routing="relay", timeline=False).estimate.step_s
        assert fast_step_s(graph, cluster, [plan])[0] == pytest.approx(event, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(chain_plans())
def test_the_tables_array_form_equals_its_scalar_form(case):
    """One table, two forms: a chain's actions, transfers and tails per micro-batch in
    `ChainScorer.lower` (arrays, from prefix sums) are the scalar table's (`step_costs`)."""
    graph, plan = case
    scorer = ChainScorer(graph, CLUSTER)
    sizes = np.cumsum([len(s.nodes) for s in plan.stages])[:-1]
    costs, _ = scorer.lower(sizes[None, :], [[CLUSTER.ids.index(s.devices[0]) for s in plan.stages]],
                            plan.microbatches, plan.schedule)
    table = step_costs(graph, CLUSTER, plan, "relay")
    split = get_schedule(plan.schedule).split_backward
    for k, stage in enumerate(table.stages):
        rep = stage.replicas[0]
        scalar = (rep.fwd_mb_s, *((rep.bwd_input_mb_s, rep.bwd_weight_mb_s) if split else (rep.bwd_mb_s,)))
        for array, one in zip(costs.actions_s, scalar, strict=True):
            assert array[k, :, 0] == pytest.approx(one, rel=1e-12, abs=1e-15)
        assert costs.optimizer_s[k, 0] == pytest.approx(rep.optimizer_s, rel=1e-12, abs=1e-15)
    assert len(table.messages) == len(plan.stages) - 1
    for msg in table.messages:
        assert costs.transfer_s[msg.src_stage, :, 0] == pytest.approx(msg.seconds_mb, rel=1e-12, abs=1e-15)
        assert costs.sent[msg.src_stage, 0] == (msg.bytes_per_batch > 0)


def test_a_boundary_carrying_nothing_takes_no_turn_on_an_interface():
    """Found by the test above in CI: stage 0 sends nothing to stage 1, which sends 1 byte to
    stage 2. Stage 1 receives stage 2's gradient of micro-batch 0 while stage 0 still runs; the
    fast path made that gradient wait for stage 0's (empty) second forward, so the step ended
    one latency late. Step: stage 0's four actions, 4 x 0.5 x (15.7 / 19.5)."""
    graph = chain(3, fwd=0.0, bwd=0.0, batch=2)
    nodes = list(graph.nodes)
    nodes[0] = dataclasses.replace(nodes[0], fwd_s={"v100-16gb": 1.0}, bwd_s={"v100-16gb": 1.0})
    graph = dataclasses.replace(graph, nodes=tuple(nodes), edges=(Edge("n1", "n2", 1),))
    plan = one_per_stage(3, 2, "1f1b", ["a0", "a1", "v0"])
    event = simulate(graph, CLUSTER, plan, routing="relay", timeline=False).estimate.step_s
    assert event == pytest.approx(2 * 15.7 / 19.5, rel=1e-12)
    assert fast_step_s(graph, CLUSTER, [plan])[0] == pytest.approx(event, rel=1e-12)


@pytest.mark.parametrize("n,m", [(1, 1), (2, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fast_path_pipeline_formula(n, m, schedule):
    program = ChainProgram(n, (1 / m,) * m, schedule)
    fwd, bwd = np.full((3, n), 0.03), np.full((3, n), 0.05)
    fwd[1] *= 2
    bwd[1] *= 2
    none = np.zeros((3, n - 1))
    step = program.step_s(lower_chain(schedule, program.fractions, fwd, bwd, none, none))
    assert step == pytest.approx(np.array([1, 2, 1]) * (m + n - 1) * 0.08 / m)


def profile(profiles, name):
    return import_pipedream(profiles / name / "graph.txt", batch_size=64 if name == "gnmt" else None)


@pytest.mark.parametrize("name", ["vgg16", "resnet50"])
def test_chain_scorer_matches_the_event_simulator(profiles, name):
    """Plans as cut points and device indices, scored without building Plan objects."""
    graph, cluster = profile(profiles, name), load_cluster("cloud-mix")
    scorer = ChainScorer(graph, cluster)
    rng = np.random.default_rng(1)
    checked = 0
    for n, m, schedule in [(1, 1, "gpipe"), (3, 8, "1f1b"), (6, 12, "gpipe"), (8, 16, "1f1b")]:
        cuts = np.array([np.sort(rng.choice(np.arange(1, len(scorer.order)), n - 1, replace=False))
                         for _ in range(20)])
        devices = np.array([rng.permutation(len(cluster.ids))[:n] for _ in range(20)])
        scores = scorer.score(cuts, devices, m, schedule)
        for k in range(20):
            if not one_stream_per_host_interface(cluster, [cluster.ids[d] for d in devices[k]]):
                continue  # a host interface shared by two streams: served as issued (ranked, not exact)
            checked += 1
            bounds = [0, *cuts[k], len(scorer.order)]
            plan = Plan(tuple(Stage(scorer.order[bounds[i]:bounds[i + 1]], (cluster.ids[devices[k, i]],))
                              for i in range(n)), m, schedule, "test")
            est = simulate(graph, cluster, plan, routing="relay", timeline=False).estimate
            assert scores.step_s[k] == pytest.approx(est.step_s, rel=1e-9)
            assert scores.usd_per_step[k] == pytest.approx(est.usd_per_step, rel=1e-9)
            peaks = [est.peak_mem_bytes[cluster.ids[d]] for d in devices[k]]
            assert scores.peak_mem_bytes[k] == pytest.approx(peaks, rel=1e-9, abs=1)
            assert bool(scores.feasible[k]) == est.feasible
    assert checked >= 25  # of 80: one stage, or few enough hosts crossed


@pytest.mark.parametrize("name,cluster_name", [("resnet50", "cloud-mix"), ("gnmt", "hetero-4"),
                                               ("vgg16", "a100+v100-8")])
def test_fast_path_ranks_random_plans_like_the_event_simulator(profiles, name, cluster_name):
    """Random plans with replicated stages and direct routing, where the fast path folds replicas
    and relays skipping tensors: Spearman's rank correlation must be at least 0.95."""
    graph, cluster = profile(profiles, name), load_cluster(cluster_name)
    rng = np.random.default_rng(0)
    plans = [random_plan(graph, cluster, rng, max_replicas=3) for _ in range(150)]
    assert any(len(s.devices) > 1 for p in plans for s in p.stages)
    event = np.array([simulate(graph, cluster, p, routing="direct", timeline=False).estimate.step_s for p in plans])
    fast = fast_step_s(graph, cluster, plans)
    assert spearmanr(event, fast).statistic >= 0.95


def test_fast_path_on_plan_objects():
    g = chain(3, edge_bytes=0)
    assert fast_step_s(g, load_cluster("v100x4"), [one_per_stage(3, 4)])[0] == pytest.approx(6 * 0.08 / 4)
