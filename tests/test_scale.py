"""Plans at scale: the per-type program (`hetplan.planners.scale`), micro-batch counts past 32,
replicas past 4, no replica without rows, and "no plan fits" only when none does."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.cost import CostModel
from hetplan.errors import InfeasibleError
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import cluster_from_spec, hosts_spec
from hetplan.plan import Plan, Stage, plan_problems
from hetplan.planners import PlanOptions, make_plan
from hetplan.planners.baselines import data_parallel
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.randomized import random_problem
from hetplan.planners.scale import scale_candidates, type_units, unit_size
from hetplan.planners.scoring import Scorer, idle_replicas
from hetplan.planners.states import StateSums
from hetplan.zoo.llm import shape, transformer_chain
from strategies import clusters

V = "v100-16gb"
GiB = 2**30


def hosts_cluster(groups, inter="1.7GB/s"):
    """[(type, hosts, per_host)]: hosts of one type each, joined at `inter`."""
    return cluster_from_spec(hosts_spec(groups, inter_host=inter), "hosts.yaml")


def test_microbatch_choices_reach_one_row_per_microbatch():
    graph = Graph("g", (Node("a", "Linear", {V: 1.0}, {V: 1.0}),), (), 1000, V)
    choices = microbatch_choices(graph, PlanOptions())
    assert choices[0] == 1 and choices[-1] == 1000 and 32 in choices and 64 in choices
    assert {math.ceil(1000 / (1 << k)) for k in range(10)} <= set(choices)  # 1, 2, 4, ... rows
    assert microbatch_choices(graph, PlanOptions(microbatches=7)) == (7,)


def test_units_are_whole_hosts_past_sixteen_devices():
    assert unit_size(8, 8) == 1 and unit_size(16, 8) == 1
    assert unit_size(96, 8) == 8 and unit_size(32, 8) == 8 and unit_size(512, 8) == 32
    assert unit_size(20, 20) == 2  # one big host: groups of devices
    cluster = hosts_cluster([("a100-40gb", 4, 8), (V, 12, 8)])
    units = type_units(cluster, V)
    assert len(units) == 12 and all(len(u) == 8 and len({cluster.device(d).host for d in u}) == 1 for u in units)


def test_dp_equals_exact_where_a_stage_needs_more_than_four_replicas():
    """Ten V100s: the compute-heavy node wants eight replicas, the heavy weights one device (their
    all-reduce at 1 GB/s would cost more than the compute saved). The device program alone took
    at most four replicas past eight devices: 0.300 s against 0.150 s."""
    nodes = (Node("n0", "Conv2d", {V: 0.4}, {V: 0.8}, param_bytes=2**16, act_bytes=2**20),
             Node("n1", "Linear", {V: 0.01}, {V: 0.02}, param_bytes=GiB, act_bytes=2**20))
    graph = Graph("wide", nodes, (Edge("n0", "n1", 2**20),), 64, V)
    cluster = hosts_cluster([(V, 2, 5)], inter="1GB/s")
    best = make_plan(graph, cluster, "exact")
    plan = make_plan(graph, cluster, "dp")
    assert max(len(s.devices) for s in best.stages) > 4
    assert plan.predicted.step_s == pytest.approx(best.predicted.step_s, rel=1e-9)


def _memory_bound_chain(act_bytes, param_bytes=GiB):
    nodes = tuple(Node(f"n{i}", "Linear", {V: 0.01}, {V: 0.02}, param_bytes=param_bytes, act_bytes=act_bytes)
                  for i in range(4))
    return Graph("memory", nodes, tuple(Edge(f"n{i}", f"n{i + 1}", 2**20) for i in range(3)), 64, V)


def test_dp_equals_exact_where_memory_needs_more_than_32_microbatches():
    graph = _memory_bound_chain(2**36)  # 1 GiB a sample per node: 32 rows of two nodes need 64 GiB
    cluster = hosts_cluster([(V, 1, 2)])
    best = make_plan(graph, cluster, "exact")
    plan = make_plan(graph, cluster, "dp")
    assert best.microbatches > 32
    assert plan.predicted.step_s == pytest.approx(best.predicted.step_s, rel=1e-9)


@pytest.mark.parametrize("act_gib", [8, 64, 256])
def test_no_plan_fits_only_when_none_does_and_names_the_shortfall(act_gib):
    """exact searches every plan: dp refuses exactly when it does, and says what the closest needs."""
    graph = _memory_bound_chain(act_gib * GiB)
    cluster = hosts_cluster([(V, 1, 2)])
    try:
        make_plan(graph, cluster, "exact")
        feasible = True
    except InfeasibleError:
        feasible = False
    if feasible:
        assert make_plan(graph, cluster, "dp").predicted.feasible
        return
    with pytest.raises(InfeasibleError, match=r"the closest tried \(\d+ stages?, 64 micro-batches of up to 1 row\) "
                                              r"needs [\d.]+ GiB on v\S+ \(v100-16gb\), which has 16.0 GiB"):
        make_plan(graph, cluster, "dp")


def test_data_parallel_gives_no_replica_an_empty_slice():
    graph = _memory_bound_chain(2**20, param_bytes=2**20)
    cluster = hosts_cluster([(V, 2, 8)])
    plan = data_parallel(graph, cluster, PlanOptions(microbatches=8))  # 8 rows a micro-batch, 16 devices
    assert len(plan.stages[0].devices) == 8
    assert idle_replicas(Scorer(graph, cluster, PlanOptions()).cost, plan) == []


def test_idle_replicas_names_a_replica_without_rows():
    """One row a micro-batch: equal replicas take turns with it, the slower of two never gets it."""
    graph = _memory_bound_chain(2**20, param_bytes=2**20)
    cost = Scorer(graph, hosts_cluster([(V, 1, 4)]), PlanOptions()).cost
    plan = Plan((Stage(graph.topo_order, tuple(cost.cluster.ids)),), 64, "1f1b", "t")
    assert idle_replicas(cost, plan) == []
    cost = Scorer(graph, hosts_cluster([(V, 1, 1), ("t4-16gb", 1, 1)]), PlanOptions()).cost
    plan = Plan((Stage(graph.topo_order, tuple(cost.cluster.ids)),), 64, "1f1b", "t")
    assert idle_replicas(cost, plan) == [(0, cost.cluster.ids[1])]
    assert idle_replicas(cost, Plan(plan.stages, 16, "1f1b", "t")) == []


@pytest.mark.parametrize("seed", range(4))
def test_planners_never_return_a_replica_without_rows(seed):
    rng = np.random.default_rng(seed)
    graph, cluster = random_problem(rng)
    cost = Scorer(graph, cluster, PlanOptions()).cost
    for planner in ("dp", "data-parallel", "local-search", "heterps"):
        try:
            plan = make_plan(graph, cluster, planner, PlanOptions(max_iters=50))
        except InfeasibleError:
            continue
        assert idle_replicas(cost, plan) == [], planner


def test_scale_candidates_are_valid_plans_of_one_type_per_stage():
    """Three types whose order by speed is not their order by name (a mix-up of the two once put
    V100 memory on A100 stages), so every candidate must fit as the simulator sees it."""
    graph = transformer_chain("opt-2.7b", 64, 2048, ["h100-80gb", "a100-40gb", V])
    cluster = hosts_cluster([("h100-80gb", 1, 4), ("a100-40gb", 1, 4), (V, 2, 4)])
    scorer = Scorer(graph, cluster, PlanOptions())
    plans = scale_candidates(scorer, StateSums(graph, scorer.cost, 64))
    assert plans
    for plan in plans:
        assert plan_problems(plan, graph, cluster) == []
        assert all(len({cluster.device(d).type for d in s.devices}) == 1 for s in plan.stages)
        assert idle_replicas(scorer.cost, plan) == []
        assert scorer.estimate(plan).feasible


# dp on OPT-350M over 32 A100 + 96 V100 (the guide's section on a big mixed cluster, the same
# problem): tests/test_readme.py runs it as the guide's commands and checks its plan

def test_llm_shapes_count_their_parameters():
    g = transformer_chain("llama-3-8b", 1, 8, ["h100-80gb"])
    assert sum(n.param_bytes for n in g.nodes) / 4 == pytest.approx(8.03e9, rel=0.01)  # Llama 3 8B
    assert shape("opt-350m").block_params() == pytest.approx(12.6e6, rel=0.01)


def test_deep_llm_shapes_count_their_published_parameters():
    """The chain's parameters (embedding, blocks, head; a tied one once) against the published
    totals. GPT-Neo 2.7B's checkpoint holds 2,651,307,520 (2,048 learnt positions, biases and
    norms included); the chain counts its positions at the sequence length."""
    neo = transformer_chain("gpt-neo-2.7b", 1, 2048, ["h100-80gb"])
    assert neo.param_bytes_total / 4 == pytest.approx(2.7e9, rel=0.02)
    assert neo.param_bytes_total / 4 == pytest.approx(2_651_307_520, rel=0.001)
    assert neo.tied and neo.by_id["block_0"].tp_units == 20  # heads and MLP units split 20 ways at most
    llama = transformer_chain("llama-3-70b", 1, 8, ["h100-80gb"])
    assert llama.param_bytes_total / 4 == pytest.approx(70.6e9, rel=0.02)  # Meta-Llama-3-70B
    assert llama.tied == () and len(llama.nodes) == 80 + 2


@settings(max_examples=150, deadline=None)
@given(clusters(min_devices=1, max_devices=6), st.randoms(use_true_random=False))
def test_cut_bandwidth_by_host_pairs_equals_every_pair(cluster, rnd):
    """`CostModel._slowest_Bps` and `nic_cap_Bps` count pairs by host (128 x 128 replicas would
    be 16,384 link look-ups a cut): the same as looking at every pair."""
    ids = list(cluster.ids)
    senders, receivers = rnd.sample(ids, rnd.randint(1, len(ids))), rnd.sample(ids, rnd.randint(1, len(ids)))
    t = cluster.devices[0].type
    cost = CostModel(Graph("g", (Node("a", "Linear", {t: 1.0}, {t: 1.0}),), (), 1, t), cluster)
    assert cost._slowest_Bps(senders, receivers) == min(cluster.link(a, b).bandwidth_Bps
                                                       for a in senders for b in receivers)
    cross = [(a, b) for a in senders for b in receivers if cluster.crosses_hosts(a, b)]
    out_hosts = {cluster.device(a).host for a, _ in cross}
    in_hosts = {cluster.device(b).host for _, b in cross}
    naive = min(math.fsum(cluster.nic_Bps(h) for h in out_hosts),
                math.fsum(cluster.nic_Bps(h) for h in in_hosts)) if cross else math.inf
    assert cost._nic_cap_Bps(senders, receivers) == naive


def test_opt_ties_its_embedding_to_its_head_and_llama_does_not():
    """OPT and GPT-2 use the token embedding as the output layer (`tie_word_embeddings`, true by
    transformers' default): the chain records it, so a plan that puts the two in different
    stages pays their gradient's sum, as Megatron-LM's embedding group does."""
    from hetplan.graph import Tied
    from hetplan.zoo.llm import TransformerShape

    opt = transformer_chain("opt-350m", 1, 8, ["h100-80gb"])
    assert opt.tied == (Tied(("embed", "head"), 4 * 1024 * 50272),)
    assert opt.param_bytes_total == sum(n.param_bytes for n in opt.nodes) - 4 * 1024 * 50272
    assert transformer_chain("llama-3-8b", 1, 8, ["h100-80gb"]).tied == ()
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100}
    assert TransformerShape.from_config(config, "gpt").tied_embeddings
    assert not TransformerShape.from_config({**config, "tie_word_embeddings": False}, "llama").tied_embeddings
