"""Nodes timed on a tensor-parallel group of CPU workers (`hetplan.profile.tensor_times`,
`Node.tp_s`), and the cost model taking those times over its projection (`hetplan.cost.tensor`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetplan.errors import GraphError, HetplanError
from hetplan.graph import Graph, Node, at_batch


def _cluster(hosts: tuple[str, str]):
    from hetplan.io.clusters import cluster_from_spec

    return cluster_from_spec({"name": "cpus", "devices": [
        {"id": f"c{i}", "type": "cpu-1t", "threads": 1, "binding": "cpu", "host": h} for i, h in enumerate(hosts)]},
        "cpus")


@pytest.fixture(scope="module")
def llama_tp2():
    from hetplan.profile import profile_step
    from hetplan.zoo import load_model

    zm = load_model("llama-tiny", batch_size=4, seq_len=16, seed=0)
    return profile_step(zm.step, zm.batch, name="llama-tiny", devices=("cpu:1",), repeats=1, granularity="block",
                        block_classes=zm.block_classes, tp_degrees=(2,)).graph


def test_the_profiler_times_every_node_on_a_two_way_group(llama_tp2):
    """Two worker processes over gloo run each piece as a tensor-parallel stage's workers do:
    every node but the input carries its forward, backward and their fixed parts at degree 2, each
    fixed part within its pass, and the file keeps them."""
    from hetplan.io.serde import dumps, loads

    for node in llama_tp2.nodes:
        if node.is_input:
            assert not node.tp_s
            continue
        fwd, bwd, fwd_fixed, bwd_fixed = node.tp_s["cpu-1t"][2]
        assert fwd > 0 and 0 <= fwd_fixed <= fwd and 0 <= bwd_fixed <= bwd, node.id
    assert all(n.tp_s["cpu-1t"][2][1] > 0 for n in llama_tp2.nodes if n.id.startswith("model.layers."))
    assert loads(dumps(llama_tp2)) == llama_tp2


def test_the_cost_model_takes_a_groups_measured_times_on_one_host_only(llama_tp2):
    """A group of two workers on one host: each node's times are the measured ones (an
    uncalibrated cluster: no slowdown of co-running workers to take out); across two hosts, whose
    links the measurement did not use, the projection, as for a graph without them."""
    from hetplan.cost import CostModel
    from hetplan.cost.tensor import node_tp_times_s

    bare = replace(llama_tp2, nodes=tuple(replace(n, tp_s={}) for n in llama_tp2.nodes))
    here, apart = _cluster(("h", "h")), _cluster(("h", "g"))
    for node in ("model.layers.0", "lm_head", "model.norm"):
        got = node_tp_times_s(CostModel(llama_tp2, here), node, "cpu-1t", ("c0", "c1"), microbatches=2)
        assert got == pytest.approx(llama_tp2.by_id[node].tp_s["cpu-1t"][2])
        projected = node_tp_times_s(CostModel(bare, apart), node, "cpu-1t", ("c0", "c1"), microbatches=2)
        assert node_tp_times_s(CostModel(llama_tp2, apart), node, "cpu-1t", ("c0", "c1"),
                               microbatches=2) == pytest.approx(projected)
        assert projected != pytest.approx(got)


def test_a_degree_the_model_cannot_split_or_a_gpu_only_profile_is_refused_in_one_line(llama_tp2):
    from hetplan.profile.devices import ProfileDevice
    from hetplan.profile.tensor_times import with_group_times

    cpu = (ProfileDevice("cpu:1", "cpu", "cpu-1t", 1),)
    with pytest.raises(HetplanError, match=r"^--tp-degrees 3: node 'model.layers.0' splits into 4 parts"):
        with_group_times(llama_tp2, None, {}, cpu, (3,), "block", None, 1, "fp32", False)
    with pytest.raises(HetplanError, match="^--tp-degrees times groups of CPU workers"):
        with_group_times(llama_tp2, None, {}, (ProfileDevice("cuda", "cuda:0", "h100-80gb"),), (2,), "block", None,
                         1, "fp32", False)


def test_measured_group_times_scale_with_the_batch_and_bad_ones_are_refused():
    """At twice the batch a group's pass takes its fixed part plus twice the rest, as a single
    device's does; a degree below 2 or a fixed part beyond its pass is refused by name."""
    node = Node("b", "Block", {"cpu": 1.0}, {"cpu": 2.0}, tp_s={"cpu": {2: (0.6, 1.1, 0.1, 0.3)}})
    graph = Graph("g", (node,), (), 8, "cpu")
    assert at_batch(graph, 16).by_id["b"].tp_s["cpu"][2] == pytest.approx((1.1, 1.9, 0.1, 0.3))
    with pytest.raises(GraphError, match="degrees of 2 or more"):
        Node("b", "Block", {"cpu": 1.0}, {"cpu": 2.0}, tp_s={"cpu": {1: (0.6, 1.1, 0.1, 0.3)}})
    with pytest.raises(GraphError, match=r"tp_s\['cpu'\]\[2\] has a fixed part more than its pass"):
        Node("b", "Block", {"cpu": 1.0}, {"cpu": 2.0}, tp_s={"cpu": {2: (0.6, 1.1, 0.7, 0.3)}})


class _Refuses(__import__("torch").nn.Module):
    """A step that runs nowhere: tracing it fails in the process the group is forked from, then in each worker."""

    def __init__(self):
        super().__init__()
        self.w = __import__("torch").nn.Linear(4, 4)

    def forward(self, x):
        raise ValueError("this step refuses to run")


def test_a_group_whose_workers_fail_says_the_first_workers_error_in_one_line():
    from hetplan.profile.tensor_times import group_times

    torch = __import__("torch")
    with pytest.raises(HetplanError, match=r"^timing a group of 2 workers failed in a worker: .*this step refuses "
                                           r"to run"):
        group_times(_Refuses(), {"x": torch.zeros(2, 4)}, None, 2, 1, "layer", None, 1, "fp32")


def test_a_failed_group_names_the_worker_that_failed_first_or_why_none_started(tmp_path):
    from hetplan.profile.tensor_times import _failure

    logs = [tmp_path / "w0.log", tmp_path / "w1.log"]
    tracing = tmp_path / "tracing.log"
    assert "if __name__ == '__main__':" in _failure(2, [1, 1], logs, tracing)  # nothing of ours ran
    logs[0].write_text("UserWarning: something torch says\nRuntimeError: Connection closed by peer\n")
    logs[1].write_text("Traceback (most recent call last):\nValueError: the real cause\n")
    assert _failure(2, [-15, 1], logs, tracing).endswith("failed in a worker: ValueError: the real cause")
    assert _failure(2, [1, -15], logs, tracing).endswith("failed in a worker: RuntimeError: Connection closed by peer")
