"""The split of a step's samples (`hetplan.rows`): exact answers, properties, and the same rows
in the runtime's spec as in the simulator's model."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hetplan.cost import CostModel
from hetplan.cost.table import step_costs
from hetplan.errors import HetplanError
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import cluster_from_spec
from hetplan.plan import Plan, Stage
from hetplan.rows import microbatch_rows, split_rows, step_rows
from hetplan.runtime.launch import run_spec
from hetplan.runtime.rank import spec_rows
from hetplan.runtime.settings import RunSettings


def test_exact_splits():
    assert microbatch_rows(10, 4) == (3, 3, 2, 2)
    assert split_rows(10, [1.0, 2.0, 2.0]) == (2, 4, 4)
    assert split_rows(7, [1.0, 1.0]) == (4, 3)  # the odd row to the lower index...
    assert split_rows(7, [1.0, 1.0], rotate=1) == (3, 4)  # ...counting from `rotate`
    assert split_rows(2, [1.0, 1.0, 1.0]) == (1, 1, 0)
    rows = step_rows(5, 2, [[1.0], [1.0, 1.0, 1.0]])
    assert rows.micro == (3, 2) and rows.start == (0, 3)
    assert rows.slices[1] == (((0, 1), (1, 2), (2, 3)), ((0, 0), (0, 1), (1, 2)))  # equal replicas take turns
    assert rows.shared_rows(0, 1, 0, 1, 2) == (1, 2) and rows.shared_rows(0, 1, 0, 1, 0) == (0, 0)
    with pytest.raises(HetplanError, match="weights must be finite"):
        split_rows(3, [0.0, 0.0])


@given(st.integers(1, 300), st.integers(1, 40))
def test_microbatches_split_as_torch_tensor_split_does(batch, m):
    assert list(microbatch_rows(batch, m)) == [len(c) for c in torch.arange(batch).tensor_split(m)]


@given(st.integers(0, 500), st.lists(st.floats(0.01, 100.0), min_size=1, max_size=8), st.integers(0, 7))
def test_replica_rows_add_up_and_stay_within_a_row_of_their_share(rows, weights, rotate):
    parts = split_rows(rows, weights, rotate)
    assert sum(parts) == rows and min(parts) >= 0
    total = math.fsum(weights)
    assert all(abs(p - rows * w / total) < 1 for p, w in zip(parts, weights, strict=True))


def _graph(n, batch):
    nodes = tuple(Node(f"n{i}", "Linear", {"cpu-1t": 1e-3 * (i + 1)}, {"cpu-1t": 2e-3 * (i + 1)}, flops=1e7 * (i + 1),
                       param_bytes=4000 * i, act_bytes=1000) for i in range(n))
    return Graph("g", nodes, tuple(Edge(f"n{i}", f"n{i + 1}", 4096) for i in range(n - 1)), batch, "cpu-1t")


@given(st.lists(st.lists(st.integers(1, 16), min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(1, 64), st.integers(1, 8), st.sampled_from(["gpipe", "1f1b"]))
def test_the_runtime_splits_every_microbatch_as_the_simulator_charges_it(threads, batch, m, schedule):
    """Random speeds (CPU workers of 1-16 threads, projected from one profiled type): the rows
    in RUN.json are the simulator's rows, and the simulator charges each replica for exactly
    those rows (nothing for a slice with no row)."""
    m = min(m, batch)
    devices, stages, i = [], [], 0
    graph = _graph(len(threads), batch)
    for k, reps in enumerate(threads):
        ids = []
        for t in reps:
            devices.append({"id": f"c{i}", "type": "cpu", "threads": t, "binding": "cpu", "host": "h"})
            ids.append(f"c{i}")
            i += 1
        stages.append(Stage((f"n{k}",), tuple(ids)))
    cluster = cluster_from_spec({"name": "r", "devices": devices}, "r")
    plan = Plan(tuple(stages), m, schedule, "test")
    spec = run_spec(plan, cluster, "gpt2-tiny", RunSettings(batch_size=batch, seq_len=8, granularity="layer",
                    out_dir="x"), graph=graph)
    cm = CostModel(graph, cluster)
    rows = spec_rows(spec, plan)
    assert rows == cm.plan_rows(plan)
    model = step_costs(graph, cluster, plan, "relay", cm)
    for k, st_ in enumerate(model.stages):
        fwd = {d: cm._stage_times_s(plan.stages[k].nodes, cluster.device(d).type)[0] for d in plan.stages[k].devices}
        for p, rep in enumerate(st_.replicas):
            for j in range(m):
                n = rows.rows(k, j, p)
                assert rep.fwd_mb_s[j] == pytest.approx(fwd[rep.device] * n / batch, abs=1e-15)
    for msg in model.messages:  # a message exactly where two slices share rows
        p = plan.stages[msg.src_stage].devices.index(msg.src)
        q = plan.stages[msg.dst_stage].devices.index(msg.dst)
        for j in range(m):
            lo, hi = rows.shared_rows(msg.src_stage, j, p, msg.dst_stage, q)
            assert (msg.bytes_mb[j] is None) == (hi == lo)
