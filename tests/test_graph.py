import itertools
import math

import networkx as nx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetplan.errors import GraphError
from hetplan.graph import Edge, Graph, Node
from strategies import graphs

V = "v100-16gb"


def node(i, fwd=1.0, bwd=2.0, **kw):
    return Node(id=i, op="Linear", fwd_s={V: fwd}, bwd_s={V: bwd}, **kw)


def graph(ids, edges, **kw):
    return Graph("g", tuple(node(i) for i in ids), tuple(Edge(a, b, 8) for a, b in edges), batch_size=4,
                 profiled_on=V, **kw)


def diamond():
    # a -> b -> d, a -> c -> d
    return graph("abcd", [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])


def test_structure_of_a_diamond():
    g = diamond()
    assert g.topo_order == ("a", "b", "c", "d")
    assert g.successors("a") == ("b", "c")
    assert g.predecessors("d") == ("b", "c")
    assert g.ancestors("d") == {"a", "b", "c"}
    assert g.descendants("b") == {"d"}
    assert g.sources == ("a",) and g.sinks == ("d",)


def test_convexity_of_a_diamond():
    g = diamond()
    assert g.is_convex({"a", "b", "c", "d"})
    assert g.is_convex({"a", "b"})
    assert g.is_convex({"b", "c"})
    assert not g.is_convex({"a", "d"})
    witness = g.convexity_witness({"a", "d"})
    assert witness[0] == "a" and witness[-1] == "d" and witness[1] in ("b", "c")
    assert not g.is_convex({"a", "b", "d"})  # a -> c -> d leaves and re-enters


def test_topo_order_keeps_listed_order_when_valid():
    g = graph("xyz", [("x", "z")])
    assert g.topo_order == ("x", "y", "z")
    g = graph("zyx", [("x", "z")])
    assert g.topo_order == ("y", "x", "z")


def test_totals():
    g = Graph("g", (node("a", 0.1, 0.2, param_bytes=10), node("b", 0.3, 0.4, param_bytes=5)), (Edge("a", "b", 3),),
              batch_size=2, profiled_on=V)
    assert g.fwd_s_total() == pytest.approx(0.4)
    assert g.bwd_s_total() == pytest.approx(0.6)
    assert g.param_bytes_total == 15


def test_cycle_is_named():
    with pytest.raises(GraphError, match=r"cycle (a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c)"):
        graph("abc", [("a", "b"), ("b", "c"), ("c", "a")])


def test_self_loop_is_a_cycle():
    with pytest.raises(GraphError, match="cycle a -> a"):
        graph("ab", [("a", "a")])


def test_duplicate_node_id():
    with pytest.raises(GraphError, match="duplicate node id 'a'"):
        graph("aba", [])


def test_edge_to_missing_node():
    with pytest.raises(GraphError, match=r"edge 0 \(a -> zz\) names node 'zz', which does not exist"):
        graph("ab", [("a", "zz")])


def test_duplicate_edge():
    with pytest.raises(GraphError, match="duplicate edge a -> b"):
        graph("ab", [("a", "b"), ("a", "b")])


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_times_must_be_finite_and_non_negative(bad):
    with pytest.raises(GraphError, match=r"node 'a': fwd_s\['v100-16gb'\]"):
        node("a", fwd=bad)


def test_sizes_must_be_non_negative():
    with pytest.raises(GraphError, match="node 'a': param_bytes is -5"):
        node("a", param_bytes=-5)
    with pytest.raises(GraphError, match="bytes is -1"):
        Edge("a", "b", -1)


def test_profiled_type_must_be_on_every_node():
    with pytest.raises(GraphError, match="no time for the profiled device type 't4-16gb'"):
        Graph("g", (node("a"),), (), batch_size=1, profiled_on="t4-16gb")


def test_fwd_and_bwd_name_the_same_types():
    with pytest.raises(GraphError, match="both need the same types"):
        Node("a", "Linear", {V: 1.0}, {V: 1.0, "t4-16gb": 2.0})


def test_empty_graph_and_bad_batch():
    with pytest.raises(GraphError, match="no nodes"):
        Graph("g", (), (), batch_size=1, profiled_on=V)
    with pytest.raises(GraphError, match="batch_size is 0"):
        Graph("g", (node("a"),), (), batch_size=0, profiled_on=V)


def test_a_batch_beyond_what_planning_takes_is_refused():
    from hetplan.graph import MAX_BATCH_SIZE, at_batch

    g = Graph("g", (node("a"),), (), batch_size=MAX_BATCH_SIZE, profiled_on=V)
    assert at_batch(g, 1).batch_size == 1 and at_batch(at_batch(g, 1), MAX_BATCH_SIZE).batch_size == MAX_BATCH_SIZE
    for bigger in (MAX_BATCH_SIZE + 1, 10**15):
        with pytest.raises(GraphError, match=f"batch_size is {bigger}; it must be at most {MAX_BATCH_SIZE} samples"):
            Graph("g", (node("a"),), (), batch_size=bigger, profiled_on=V)
        with pytest.raises(GraphError, match=f"the batch size is {bigger}; it must be at most {MAX_BATCH_SIZE}"):
            at_batch(g, bigger)


def test_node_is_frozen_and_hashable():
    n = node("a")
    with pytest.raises(AttributeError):
        n.op = "Conv2d"
    with pytest.raises(TypeError):
        n.fwd_s[V] = 3.0
    assert hash(n) == hash(node("a"))


def _nx(g):
    return nx.DiGraph([(e.src, e.dst) for e in g.edges]) if g.edges else nx.DiGraph()


@given(graphs(max_nodes=10))
def test_topo_order_is_a_topological_permutation(g):
    order = g.topo_order
    assert sorted(order) == sorted(n.id for n in g.nodes)
    pos = {n: i for i, n in enumerate(order)}
    assert all(pos[e.src] < pos[e.dst] for e in g.edges)


@given(graphs(max_nodes=10))
def test_ancestors_match_networkx(g):
    ref = _nx(g)
    ref.add_nodes_from(n.id for n in g.nodes)
    for n in g.nodes:
        assert g.ancestors(n.id) == nx.ancestors(ref, n.id)
        assert g.descendants(n.id) == nx.descendants(ref, n.id)


@given(graphs(max_nodes=8), st.data())
def test_convexity_matches_brute_force(g, data):
    ids = [n.id for n in g.nodes]
    subset = data.draw(st.sets(st.sampled_from(ids), min_size=1))
    # Brute force: S is convex iff no node outside S is both a descendant and an ancestor of S.
    desc = set().union(*(g.descendants(s) for s in subset))
    anc = set().union(*(g.ancestors(s) for s in subset))
    expected = not ((desc & anc) - subset)
    assert g.is_convex(subset) == expected
    witness = g.convexity_witness(subset)
    if witness:
        assert witness[0] in subset and witness[-1] in subset
        assert all(w not in subset for w in witness[1:-1])
        assert all((a, b) in g.edge_bytes for a, b in itertools.pairwise(witness))


def test_a_graph_at_another_batch_scales_what_selective_recomputation_keeps_and_rebuilds():
    """`--global-batch` 4x: a counted block keeps and rebuilds 4x the bytes selectively, as its
    activations; the time recomputing adds stays a number of forwards."""
    from hetplan.graph import at_batch
    from hetplan.zoo.llm import transformer_chain

    g = transformer_chain("opt-350m", 2, 128, ["a100-40gb"])
    big = at_batch(g, 8)
    for n in ("block_0", "head"):
        a, b = g.by_id[n], big.by_id[n]
        assert b.act_bytes == 4 * a.act_bytes
        assert (b.selective_keep_bytes, b.selective_rebuilt_bytes) == (4 * a.selective_keep_bytes,
                                                                        4 * a.selective_rebuilt_bytes)
        assert b.rerun_forwards == a.rerun_forwards
