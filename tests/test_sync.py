"""Gradient sums after a step: which replicas sum what, in which order (`hetplan.sync`), and what
the simulator charges for them (`hetplan.cost.syncs`), tied parameters included."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hetplan.cost import CostModel
from hetplan.cost.syncs import plan_syncs
from hetplan.errors import GraphError
from hetplan.graph import Tied, at_batch
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan, Stage
from hetplan.runtime.settings import RunSettings
from hetplan.sim import simulate
from hetplan.sync import SyncGroup, rank_numbers, sync_groups
from hetplan.timeline import ALLREDUCE, OPTIMIZER
from strategies import ONE_PER_RANK, chain

MB = 10**6


def stage_major(replicas):
    """Ranks numbered stage by stage, replica by replica (every device on one host)."""
    members = [(k, p) for k, n in enumerate(replicas) for p in range(n)]
    return {m: r for r, m in enumerate(members)}


def test_groups_are_the_holders_replicas_in_rank_order():
    holders = {"a": {0}, "tied": {2, 0}, "c": {1}, "d": {0}}
    assert sync_groups(holders, stage_major([2, 1, 1])) == [
        SyncGroup(((0, 0), (0, 1)), ("a", "d")),
        SyncGroup(((0, 0), (0, 1), (2, 0)), ("tied",)),
        SyncGroup(((1, 0),), ("c",)),
    ]


def test_ranks_go_host_by_host_and_groups_follow_them():
    """Stage 0 on hosts x and y, stage 1 on x: torchrun's numbering puts stage 1's replica (on x)
    before stage 0's second (on y), and a group's members and the groups go by those ranks."""
    hosts = {"a": "x", "b": "y", "c": "x"}
    ranks = rank_numbers([("a", "b"), ("c",)], hosts.__getitem__)
    assert ranks == {(0, 0): 0, (1, 0): 1, (0, 1): 2}
    groups = sync_groups({"w0": {0}, "tied": {0, 1}, "w1": {1}}, ranks)
    assert [g.members for g in groups] == [((0, 0), (1, 0), (0, 1)), ((0, 0), (0, 1)), ((1, 0),)]


def test_an_interleaved_worker_holds_the_stages_of_its_turn():
    """Under an interleaved schedule on n = 2 workers, replica p of stage k is the worker of
    (k mod 2, p): numbers for the first two stages only, host by host."""
    hosts = {"a": "x", "b": "y", "c": "x"}
    ranks = rank_numbers([("a",), ("b", "c"), ("a",), ("b", "c")], hosts.__getitem__, [0, 1, 0, 1])
    assert ranks == {(0, 0): 0, (1, 1): 1, (1, 0): 2, (2, 0): 0, (3, 1): 1, (3, 0): 2}


def test_the_launcher_numbers_ranks_as_the_cost_model_does():
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.runtime.launch import run_spec

    cluster = cluster_from_spec({"devices": [{"id": i, "type": "cpu-1t", "host": h, "binding": "cpu", "threads": 1}
                                             for i, h in (("a", "x"), ("b", "y"), ("c", "x"), ("d", "y"))]}, "c")
    plan = Plan((Stage(("n0",), ("b", "a")), Stage(("n1",), ("c",)), Stage(("n2",), ("d",))), 2, "1f1b", "t")
    spec = run_spec(plan, cluster, "mlp", RunSettings(batch_size=4, seq_len=None, granularity="layer",
                    out_dir="unused"), weights=[[1.0, 1.0], [1.0], [1.0]])
    numbers = rank_numbers([s.devices for s in plan.stages], lambda d: cluster.device(d).host)
    assert [(r.stage, r.replica) for r in spec.ranks] == sorted(numbers, key=numbers.__getitem__)


@given(st.lists(st.integers(1, 3), min_size=1, max_size=5), st.data())
def test_every_parameter_is_summed_once_over_every_replica_that_holds_it(replicas, data):
    n = len(replicas)
    holders = {f"p{i}": data.draw(st.sets(st.integers(0, n - 1), min_size=1))
               for i in range(data.draw(st.integers(1, 6)))}
    devices = [[f"d{k}.{p}" for p in range(r)] for k, r in enumerate(replicas)]
    hosts = {d: data.draw(st.sampled_from("xyz")) for ds in devices for d in ds}
    ranks = rank_numbers(devices, hosts.__getitem__)
    assert sorted(ranks.values()) == list(range(sum(replicas)))
    groups = sync_groups(holders, ranks)
    assert sorted(p for g in groups for p in g.params) == sorted(holders)
    for g in groups:
        assert [ranks[m] for m in g.members] == sorted(ranks[m] for m in g.members)
        for p in g.params:
            assert set(g.members) == {(k, r) for k in holders[p] for r in range(replicas[k])}
    order = [[ranks[m] for m in g.members] for g in groups]
    assert order == sorted(order)  # one global order


def tied_chain(n=3, tied_bytes=40 * MB, params=50 * MB):
    """A chain whose first and last nodes share a parameter of `tied_bytes` (both count it)."""
    g = chain(n, fwd=0.03, bwd=0.05, params=params, acts=0)
    return replace(g, tied=(Tied(("n0", f"n{n - 1}"), tied_bytes),))


def test_the_graph_checks_its_tied_parameters_and_counts_them_once():
    g = tied_chain()
    assert g.param_bytes_total == 3 * 50 * MB - 40 * MB
    assert g.param_bytes_of(["n0", "n1"]) == 100 * MB and g.param_bytes_of(["n0", "n2"]) == 60 * MB
    assert serde.loads(serde.dumps(g), expect="graph").tied == g.tied
    assert at_batch(g, 32).tied == g.tied
    with pytest.raises(GraphError, match="more than the parameters of 'n0'"):
        replace(g, tied=(Tied(("n0", "n1"), 60 * MB),))
    with pytest.raises(GraphError, match="fewer than two nodes"):
        replace(g, tied=(Tied(("n0",), MB),))


def test_a_tied_parameter_across_stages_is_summed_after_both_are_done():
    """Stage 0 holds n0 and n1, stage 1 n2: the tied parameter is all-reduced between their
    devices once both have finished their last backward pass, then each takes its optimizer step."""
    g, cluster = tied_chain(), load_cluster("v100x8")
    plan = Plan((Stage(("n0", "n1"), ("v0",)), Stage(("n2",), ("v1",))), 4, "1f1b", "test")
    cm = CostModel(g, cluster)
    sim = simulate(g, cluster, plan)
    spans = sim.timeline.spans
    ar = [s for s in spans if s.kind == ALLREDUCE]
    assert {s.resource for s in ar} == {"v0", "v1"}
    last = max(s.end_s for s in spans if s.kind not in (ALLREDUCE, OPTIMIZER))
    assert all(s.start_s == pytest.approx(last) for s in ar)
    sync_s = cm._gradient_sync_s(40 * MB, 0, ("v0", "v1"))
    assert ar[0].end_s - ar[0].start_s == pytest.approx(sync_s) and sync_s > 0
    opt = {s.resource: s for s in spans if s.kind == OPTIMIZER}
    assert opt["v0"].start_s == pytest.approx(last + sync_s) == opt["v1"].start_s
    # each stage updates its own copy of the tied parameter
    assert opt["v1"].end_s - opt["v1"].start_s == pytest.approx(cm._optimizer_s(50 * MB, "v1"))
    assert sim.estimate.step_s == pytest.approx(last + sync_s + max(o.end_s - o.start_s for o in opt.values()))


def test_a_worker_holding_both_users_of_a_tied_parameter_sums_nothing_for_it():
    """Interleaved on two workers, stages 0 and 2 on v0 share the tied parameter: it has one
    gradient there, so nothing is summed (a sum over a worker and itself would double it); with
    stages 0 and 1 sharing it, v0 and v1 sum it after their last actions (all their stages')."""
    g, cluster = tied_chain(4), load_cluster("v100x8")
    same = replace(g, tied=(Tied(("n0", "n2"), 50 * MB),))
    plan = Plan(tuple(Stage((f"n{i}",), (f"v{i % 2}",)) for i in range(4)), 4, "interleaved-1f1b", "test")
    assert plan_syncs(CostModel(same, cluster), plan) == ()
    across = replace(g, tied=(Tied(("n0", "n1"), 50 * MB),))
    (sync,) = plan_syncs(CostModel(across, cluster), plan)
    assert sync.members == ((0, 0), (1, 0)) and sync.devices == ("v0", "v1")
    spans = simulate(across, cluster, plan).timeline.spans
    ar = [s for s in spans if s.kind == ALLREDUCE]
    assert {s.resource for s in ar} == {"v0", "v1"} and len(ar) == 2
    last = max(s.end_s for s in spans if s.kind not in (ALLREDUCE, OPTIMIZER))
    assert all(s.start_s == pytest.approx(last) for s in ar)
    opt = sorted((s for s in spans if s.kind == OPTIMIZER and s.resource == "v0"), key=lambda s: s.start_s)
    assert [s.stage for s in opt] == [0, 2] and opt[1].start_s == pytest.approx(opt[0].end_s)  # one after the other


def test_tied_nodes_in_one_stage_sum_nothing_more_and_count_once():
    g, cluster = tied_chain(), load_cluster("v100x8")
    plan = Plan((Stage(("n0", "n1", "n2"), ("v0", "v1")),), 1, "1f1b", "test")
    cm = CostModel(g, cluster)
    (sync,) = plan_syncs(cm, plan)
    assert sync.members == ((0, 0), (0, 1))
    assert sync.seconds == pytest.approx(cm._gradient_sync_s(110 * MB, 0, ("v0", "v1")))
    assert cm.stage_memory_bytes(plan, 0, "v0") == 4 * 110 * MB


def test_replicated_stages_sharing_a_tied_parameter_sum_it_over_all_their_replicas():
    g, cluster = tied_chain(), load_cluster("v100x8")
    plan = Plan((Stage(("n0",), ("v0", "v1")), Stage(("n1",), ("v2",)), Stage(("n2",), ("v3", "v4"))),
                2, "1f1b", "test")
    cm = CostModel(g, cluster)
    syncs = plan_syncs(cm, plan)
    assert [s.members for s in syncs] == [((0, 0), (0, 1)), ((0, 0), (0, 1), (2, 0), (2, 1)), ((2, 0), (2, 1))]
    own = cm._gradient_sync_s(10 * MB, 0, ("v0", "v1"))  # n0's 50 MB less the 40 summed with stage 2
    assert [s.seconds for s in syncs] == pytest.approx(
        [own, cm._gradient_sync_s(40 * MB, 0, ("v0", "v1", "v3", "v4")), cm._gradient_sync_s(10 * MB, 0, ("v3", "v4"))])


def test_a_stage_without_parameters_sums_nothing():
    g, cluster = chain(2, params=0), load_cluster("v100x8")
    plan = Plan((Stage(("n0",), ("v0", "v1")), Stage(("n1",), ("v2",))), 2, "1f1b", "test")
    assert plan_syncs(CostModel(g, cluster), plan) == ()


def test_the_runtime_sums_what_the_cost_model_charges_for_gpt2s_tied_embedding():
    """gpt2-tiny in three stages with replicas: the profiler finds the token embedding shared by
    the first and last pieces, and the runtime's gradient groups (ranks) are the cost model's
    (stage, replica) members, in the same order, the tied weight in a group of its own."""
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.lowering import REDUCE_GRAD, lower
    from hetplan.pieces.split import split_step
    from hetplan.profile import profile_step
    from hetplan.rows import step_rows
    from hetplan.runtime.rank import gradient_groups, summed, tp_sums
    from hetplan.runtime.traces import Traces
    from hetplan.sim import lowered_step
    from hetplan.zoo import load_model

    zm = load_model("gpt2-tiny", batch_size=4, seq_len=8)
    graph = profile_step(zm.step, zm.batch, name="gpt2-tiny", devices=["cpu:1"], repeats=1, fixed=False).graph
    assert [t.nodes for t in graph.tied] == [("transformer.wte", "lm_head")]
    names = [p.name for p in split_step(zm.step, zm.batch).pieces]
    a, b = len(names) // 3, 2 * len(names) // 3
    devices = (("c0", "c1"), ("c2",), ("c3", "c4"))
    plan = Plan(tuple(Stage(tuple(part), d) for part, d in zip((names[:a], names[a:b], names[b:]), devices,
                                                               strict=True)), 2, "1f1b", "test")
    table = ((0, 1), (2,), (3, 4))
    params = {id(p): n for n, p in zm.step.named_parameters()}
    traces = Traces(zm.step, zm.batch, plan, "layer", None, {})
    runtime = [ranks for ranks, ps, _ in gradient_groups(traces, table, params) if len(ranks) > 1 and ps]
    cluster = cluster_from_spec({"devices": [{"id": f"c{i}", "type": "cpu-1t", "host": "h"} for i in range(5)]}, "c")
    cost = [tuple(table[k][p] for k, p in s.members) for s in plan_syncs(CostModel(graph, cluster), plan)]
    assert runtime == cost == [(0, 1), (0, 1, 3, 4), (3, 4)]
    # each rank's list sums the same, in the same order, whether the runtime lowers it (from its
    # traces) or the simulator (from the graph): the sums a run makes are those it was promised
    members = tuple(tuple((r,) for r in ranks) for ranks in table)
    sums = [ranks for _, ranks in summed(*tp_sums(gradient_groups(traces, table, params), members))]
    ran = lower(plan.schedule, members, plan.stage_ranks, step_rows(4, 2, [[1.0] * len(d) for d in devices]), sums)
    simulated = lowered_step(graph, cluster, plan)
    assert [[op.group for op in ops if op.kind == REDUCE_GRAD] for ops in ran.ops] == \
        [[op.group for op in ops if op.kind == REDUCE_GRAD] for ops in simulated.ops] == \
        [[(0, 1), (0, 1, 3, 4)], [(0, 1), (0, 1, 3, 4)], [], [(0, 1, 3, 4), (3, 4)], [(0, 1, 3, 4), (3, 4)]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_the_fast_path_charges_a_tied_parameter_as_the_event_simulator(data):
    """Chains whose first and last nodes share a parameter, cut anywhere: the fast path (from
    plans, and from cut points) equals the event simulator, memory included."""
    from hetplan.sim.chains import ChainScorer
    from hetplan.sim.fast import fast_step_s
    from strategies import MIXED, one_stream_per_host_interface

    nodes = data.draw(st.integers(2, 7))
    graph = replace(chain(nodes, fwd=0.01, bwd=0.02, params=8 * MB, acts=MB, edge_bytes=MB),
                    tied=(Tied(("n0", f"n{nodes - 1}"), data.draw(st.integers(1, 8)) * MB),))
    n = data.draw(st.integers(1, min(nodes, len(MIXED.ids))))
    cuts = sorted(data.draw(st.sets(st.integers(1, nodes - 1), min_size=n - 1, max_size=n - 1)))
    devices = data.draw(st.permutations(range(len(MIXED.ids))))[:n]
    assume(one_stream_per_host_interface(MIXED, [MIXED.ids[d] for d in devices]))
    bounds = [0, *cuts, nodes]
    m, schedule = data.draw(st.integers(1, 8)), data.draw(st.sampled_from(ONE_PER_RANK))
    plan = Plan(tuple(Stage(tuple(f"n{i}" for i in range(bounds[k], bounds[k + 1])), (MIXED.ids[devices[k]],))
                      for k in range(n)), m, schedule, "test")
    est = simulate(graph, MIXED, plan, routing="relay", timeline=False).estimate
    assert fast_step_s(graph, MIXED, [plan])[0] == pytest.approx(est.step_s, rel=1e-9)
    scores = ChainScorer(graph, MIXED).score(np.array([cuts]), np.array([devices]), m, schedule)
    assert scores.step_s[0] == pytest.approx(est.step_s, rel=1e-9)
    assert scores.peak_mem_bytes[0] == pytest.approx([est.peak_mem_bytes[MIXED.ids[d]] for d in devices], abs=1)
