"""A tensor crosses a cut once, whatever number of consumers it has beyond it: the runtime sends
each value once per boundary (`hetplan.runtime.stages`), and dp's cut states, the cost model,
the fast path and the event simulator all count it so (`Graph.crossing_bytes`)."""

import numpy as np
import pytest

from hetplan.cost import CostModel
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import cluster_from_spec
from hetplan.plan import Plan, Stage
from hetplan.planners.states import StateSums
from hetplan.sim.fast import chain_crossing_bytes
from hetplan.sim.model import stage_pair_bytes

V = "v100-16gb"
MB = 10**6


def _fork():
    """a's 100 MB output feeds b and c; b and c feed d (each 10 MB)."""
    nodes = (Node("a", "Conv2d", {V: 0.1}, {V: 0.2}, out_bytes=100 * MB),
             Node("b", "Conv2d", {V: 0.1}, {V: 0.2}, out_bytes=10 * MB),
             Node("c", "Conv2d", {V: 0.1}, {V: 0.2}, out_bytes=10 * MB),
             Node("d", "Linear", {V: 0.1}, {V: 0.2}, out_bytes=MB))
    edges = (Edge("a", "b", 100 * MB), Edge("a", "c", 100 * MB), Edge("b", "d", 10 * MB), Edge("c", "d", 10 * MB))
    return Graph("fork", nodes, edges, 8, V)


def test_a_tensor_with_two_consumers_beyond_a_cut_crosses_it_once():
    graph = _fork()
    cluster = cluster_from_spec({"devices": [{"id": "v", "type": V, "host": "h", "count": 2}]}, "two")
    plan = Plan((Stage(("a",), ("v0",)), Stage(("b", "c", "d"), ("v1",))), 2, "1f1b", "t")
    assert CostModel(graph, cluster).cut_bytes(plan, 0) == 100 * MB  # not 200
    assert stage_pair_bytes(graph, plan, "relay") == {(0, 1): 100 * MB}
    assert stage_pair_bytes(graph, plan, "direct") == {(0, 1): 100 * MB}
    # the fast path's chain positions, along the order a b c d
    crossing = chain_crossing_bytes(graph, {v: k for k, v in enumerate(graph.topo_order)})
    assert crossing.tolist() == [0, 100 * MB, 110 * MB, 20 * MB, 0]
    # dp's cut states: {a} and {a, b}
    prob = StateSums(graph, CostModel(graph, cluster), 160)
    cuts = {frozenset(prob.states.members(m)): c for m, c in zip(prob.ideals, prob.cut, strict=True)}
    assert cuts[frozenset("a")] == 100 * MB and cuts[frozenset("ab")] == 110 * MB


def test_different_tensors_of_one_node_are_all_sent():
    """A node whose output is two tensors (out_bytes their sum) to two consumers sends both."""
    nodes = (Node("a", "Split", {V: 0.1}, {V: 0.2}, out_bytes=30 * MB),
             Node("b", "Linear", {V: 0.1}, {V: 0.2}), Node("c", "Linear", {V: 0.1}, {V: 0.2}))
    graph = Graph("split", nodes, (Edge("a", "b", 10 * MB), Edge("a", "c", 20 * MB)), 8, V)
    assert graph.crossing_bytes(graph.edges) == 30 * MB
    assert graph.crossing_bytes(graph.edges[:1]) == 10 * MB


def test_resnet50_counts_a_skip_tensor_once(profiles):
    """PipeDream's resnet50: node79's 205.5 MB output feeds two nodes; a cut right after it
    carries it once (dp's model counted 411 MB)."""
    from hetplan.io.pipedream import import_pipedream

    graph = import_pipedream(profiles / "resnet50" / "graph.txt")
    out = [e for e in graph.edges if e.src == "node79"]
    assert len(out) == 2 and graph.crossing_bytes(out) == pytest.approx(graph.by_id["node79"].out_bytes)
    assert np.isclose(sum(e.bytes for e in out), 2 * graph.by_id["node79"].out_bytes)
