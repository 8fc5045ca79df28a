"""Optimizer-state sharding among a stage's replicas (ZeRO-1, `Stage.shard`): the rings sum and
gather exactly, sharded replicas of different speeds train as one process does and as unsharded
ones do, each holds an r-th of Adam's state, the memory model's closed form, dp's choice equals
exact's, and the measured memory of worker processes holds."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from torch import nn

from hetplan.cost import CostModel
from hetplan.io.clusters import load_cluster
from hetplan.pieces.optim import StageOptimizer
from hetplan.pieces.split import split_step
from hetplan.plan import Plan, Stage, plan_problems
from hetplan.planners import PlanOptions
from hetplan.runtime.sharding import (
    ShardedParameters,
    gather_shares,
    ring_all_gather,
    ring_reduce_scatter,
    share_bounds,
    summed_share,
)
from hetplan.runtime.transport import LocalHub, LocalTransport
from strategies import chain, exact_step_dp_matches
from test_executor import cpus, pipelined_vs_single

V100X4 = load_cluster("v100x4")


def _threads(world: int, work) -> list:
    out: list = [None] * world
    errors: list = []

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def test_shares_are_equal_within_one_element():
    assert share_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert share_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_rings_sum_each_share_and_gather_them_all(world):
    hub = LocalHub(world, timeout_s=10)
    bounds = share_bounds(11, world)
    values = [torch.arange(11, dtype=torch.float64) * (r + 1) for r in range(world)]

    def work(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine = values[rank].clone()
        ring_reduce_scatter(mine, bounds, tuple(range(world)), rank, hub.transport(rank), 100)
        lo, hi = bounds[rank]
        summed = mine[lo:hi].clone()
        whole = torch.zeros(11, dtype=torch.float64)
        whole[lo:hi] = summed
        ring_all_gather(whole, bounds, tuple(range(world)), rank, hub.transport(rank), 200)
        return summed, whole

    total = sum(values)
    for rank, (summed, whole) in enumerate(_threads(world, work)):
        lo, hi = bounds[rank]
        assert torch.equal(summed, total[lo:hi]) and torch.equal(whole, total)


@pytest.mark.parametrize("collectives", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_a_share_is_summed_and_gathered_by_rings_or_by_the_backends_collectives(world, collectives, monkeypatch):
    """`summed_share` and `gather_shares` on shares of unequal sizes (11 over 2 or 3): the same
    sums by the gloo path (rings) and by NCCL's (the backend's reduce-scatter and all-gather, here
    the threads' hub's, each share padded to the largest), which runs only where it says so."""
    monkeypatch.setattr(LocalTransport, "collectives_on", collectives)
    calls = []
    monkeypatch.setattr(LocalTransport, "reduce_scatter",
                        lambda self, *a, run=LocalTransport.reduce_scatter: calls.append(1) or run(self, *a))
    hub = LocalHub(world, timeout_s=10)
    bounds = share_bounds(11, world)
    values = [torch.arange(11, dtype=torch.float64) * (r + 1) for r in range(world)]

    def work(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        transport = hub.transport(rank)
        summed = summed_share(values[rank].clone(), bounds, tuple(range(world)), rank, transport, 100).clone()
        lo, hi = bounds[rank]
        whole = torch.zeros(11, dtype=torch.float64)
        whole[lo:hi] = summed
        gather_shares(whole, bounds, tuple(range(world)), rank, transport, 200)
        return summed, whole

    total = sum(values)
    for rank, (summed, whole) in enumerate(_threads(world, work)):
        lo, hi = bounds[rank]
        assert torch.equal(summed, total[lo:hi]) and torch.equal(whole, total)
    assert len(calls) == (world if collectives else 0)


def test_each_replica_holds_its_share_of_adam_s_state_and_ends_with_every_update():
    """Three replicas of a Linear(5, 4) (24 weights: shares of 8): each one's Adam state is two
    moments of its 8 weights; after a step every replica holds the weights one unsharded Adam
    step on the summed gradients gives. (Through a pipeline, Adam's first step divides each
    gradient by its own size, so ulp differences between orders of summation show where sums
    cancel to near zero, whoever sums them: the pipelined tests use SGD.)"""
    torch.manual_seed(0)
    base = nn.Linear(5, 4)
    grads = [[torch.randn_like(p) for p in base.parameters()] for _ in range(3)]
    reference = nn.Linear(5, 4)
    reference.load_state_dict(base.state_dict())
    for p, *g in zip(reference.parameters(), *grads, strict=True):
        p.grad = sum(g)
    torch.optim.Adam(reference.parameters(), lr=0.01).step()
    hub = LocalHub(3, timeout_s=10)

    def work(rank: int):
        model = nn.Linear(5, 4)
        model.load_state_dict(base.state_dict())
        group = ShardedParameters(list(model.parameters()), (0, 1, 2), rank)
        opt = StageOptimizer([group.shard], "adam", 0.01)
        for p, g in zip(model.parameters(), grads[rank], strict=True):
            p.grad = g.clone()
        group.reduce(hub.transport(rank))
        opt.step()
        group.gather(hub.transport(rank))
        return model, opt.state_bytes()

    for model, state in _threads(3, work):
        assert state == 2 * 8 * 4 + 4  # two fp32 moments of 8 weights, and Adam's step count
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-7)


@pytest.mark.parametrize(("name", "replicas", "weights", "shard"), [
    ("gpt2-tiny", [1, 3], [[1.0], [1.0, 3.0, 2.0]], (1,)),
    ("mlp", [2, 2], [[1.0, 2.0], [3.0, 1.0]], (0, 1)),
])
def test_sharded_replicas_of_different_speeds_train_as_one_process(name, replicas, weights, shard):
    worst, moved, loss, ref_loss, plan, *_ = pipelined_vs_single(name, replicas, 2, "1f1b", batch=12,
                                                                 weights=weights, shard=shard)
    assert [s.shard for s in plan.stages] == [k in shard for k in range(len(replicas))]
    assert moved > 1e-4 and worst <= 1e-5 and loss == pytest.approx(ref_loss, rel=1e-5)


def test_sharded_replicas_train_as_one_process_on_the_backends_collectives(monkeypatch):
    """The path NCCL takes among GPU workers (`Transport.collectives`: a reduce-scatter and an
    all-gather per step instead of rings), on the threads' hub: mlp in two stages of two replicas
    of unequal speeds, both sharding the optimizer's state, trains as one process does."""
    monkeypatch.setattr(LocalTransport, "collectives_on", True)
    calls = []
    monkeypatch.setattr(LocalTransport, "all_gather",
                        lambda self, *a, run=LocalTransport.all_gather: calls.append(1) or run(self, *a))
    worst, moved, loss, ref_loss, *_ = pipelined_vs_single("mlp", [2, 2], 2, "1f1b", batch=12,
                                                           weights=[[1.0, 2.0], [3.0, 1.0]], shard=(0, 1))
    assert len(calls) == 4  # each of the four workers gathers once after the step
    assert moved > 1e-4 and worst <= 1e-5 and loss == pytest.approx(ref_loss, rel=1e-5)


def test_memory_of_a_sharded_stage():
    """Two nodes of 1 GB on 4 replicas, 8 GB of activations for the batch, GPipe at one
    micro-batch: weights and gradients whole, Adam's two moments a quarter each."""
    g = chain(2, params=1e9, acts=4e9, batch=8)
    plan = Plan((Stage(("n0", "n1"), ("v0", "v1", "v2", "v3"), shard=True),), 1, "gpipe", "test")
    need = CostModel(g, V100X4).stage_replicas_memory_bytes(plan, 0)
    assert need == {d: int(2 * 2e9 + 2 * 2e9 / 4 + 8e9 / 4) for d in ("v0", "v1", "v2", "v3")}
    unsharded = CostModel(g, V100X4).stage_replicas_memory_bytes(replace(plan, stages=(
        replace(plan.stages[0], shard=False),)), 0)
    assert all(unsharded[d] - need[d] == 3e9 for d in need)


def test_a_stage_shards_over_replicas_with_dense_gradients():
    g = chain(2, params=1e6)
    plan = Plan((Stage(("n0",), ("v0",), shard=True), Stage(("n1",), ("v1", "v2"), shard=True)), 2, "1f1b", "t")
    assert [p for p in plan_problems(plan, g, V100X4) if "shard" in p] == [
        "stage 0 shards its optimizer state but has one replica; shard needs two or more"]
    sparse = replace(g, nodes=(g.nodes[0], replace(g.nodes[1], updated_bytes=1000, sparse_rows=10)))
    assert any("sparse gradients" in p for p in plan_problems(plan, sparse, V100X4))


@pytest.mark.parametrize("params", [2.5e9, 1.5e9])
def test_dp_shards_as_exact_does(params):
    """Two nodes of 1.5 or 2.5 GB of parameters on four 16 GB V100s: a stage of both on all four
    fits only sharded at 2.5 GB (4 x 5 GB whole; 2 x 5 + 2 x 5 / 4 sharded). dp finds exact's
    plan and step with `--shard replicated` and without, and sharding never lengthens it."""
    g = chain(2, fwd=0.2, bwd=0.4, edge_bytes=1e8, batch=8, params=params, acts=1e8)
    steps = {}
    for mode in ("never", "replicated"):
        def sharded_as_asked(plan, mode=mode):
            assert all(s.shard == (mode != "never" and len(s.devices) > 1) for s in plan.stages)

        steps[mode] = exact_step_dp_matches(g, V100X4, PlanOptions(schedule="1f1b", shard=mode),
                                            lambda plan: [len(s.devices) for s in plan.stages], sharded_as_asked)
    assert steps["replicated"] <= steps["never"] * (1 + 1e-9)


def test_measured_peak_memory_of_sharded_worker_processes(tmp_path):
    """mlp (15 MB of parameters) as two stages of two worker processes each (gloo carries the
    rings), Adam, both stages sharded: each worker's measured tensors are within 10% of the
    prediction (which is 3.8 MB less on a first-stage worker than without sharding; the saving
    measured on one stage of two workers: bench/memory_choices.py)."""
    from hetplan.pieces.hostmem import malloc_in_use_bytes
    from hetplan.profile import profile_step
    from hetplan.runtime.launch import launch, run_spec
    from hetplan.runtime.settings import RunSettings
    from hetplan.sim import simulate
    from hetplan.zoo import load_model
    from test_executor import chain_plan

    if malloc_in_use_bytes() is None:
        pytest.skip("this C library does not say what malloc has handed out")
    zm = load_model("mlp", batch_size=16, seed=0)
    graph = profile_step(zm.step, zm.batch, name="mlp", devices=("cpu:1",), repeats=1).graph
    cluster = cpus(4)
    plan = chain_plan(list(graph.topo_order), [2, 2], 2, "1f1b")
    plan = replace(plan, stages=tuple(replace(s, shard=True) for s in plan.stages))
    spec = run_spec(plan, cluster, "mlp", RunSettings(batch_size=16, granularity="layer", steps=4, warmup=2,
                    optimizer="adam", out_dir=tmp_path), graph=graph)
    result = launch(spec)
    predicted = simulate(graph, cluster, plan).estimate.peak_mem_bytes
    for r in result.ranks:
        assert r["peak_mem_bytes"] == pytest.approx(predicted[r["device"]], rel=0.10), r["device"]
    unsharded = simulate(graph, cluster, replace(plan, stages=tuple(replace(s, shard=False) for s in plan.stages)))
    assert unsharded.estimate.peak_mem_bytes["c0"] > predicted["c0"]


def test_sharded_worker_processes_take_the_backends_collectives_as_on_nccl(tmp_path, monkeypatch):
    """mlp in one stage of two worker processes sharding their weights and gradients (ZeRO-3),
    3 steps of SGD (Adam's first steps turn a last-bit difference of a near-zero sum, summed in
    another order, into a whole step), with torch.distributed's reduce-scatter and all-gather on the
    workers' group, the calls NCCL takes among GPU workers (gloo takes them here where
    HETPLAN_GLOO_COLLECTIVES is 1; its own default is the ring): every worker says it used them,
    and the losses are those of the same plan on the threads' rings."""
    from hetplan.runtime.launch import launch, run_spec
    from hetplan.runtime.local import run_threads
    from hetplan.runtime.settings import RunSettings
    from hetplan.runtime.transport import GLOO_COLLECTIVES
    from hetplan.zoo import load_model
    from test_executor import chain_plan

    zm = load_model("mlp", batch_size=8, seed=0)
    names = [p.name for p in split_step(zm.step, zm.batch).pieces]
    plan = chain_plan(names, [2], 2, "gpipe")
    plan = replace(plan, stages=(replace(plan.stages[0], shard=3),))
    settings = RunSettings(batch_size=8, granularity="layer", steps=3, warmup=0, optimizer="sgd", lr=0.1,
                           out_dir=tmp_path)
    rings = run_threads(run_spec(plan, cpus(2), "mlp", settings))
    monkeypatch.setenv(GLOO_COLLECTIVES, "1")
    result = launch(run_spec(plan, cpus(2), "mlp", settings))
    assert [r["shard_collectives"] for r in result.ranks] == [True, True]
    losses = [sum(step) for step in zip(*(r["losses"] for r in rings), strict=True)]
    assert result.losses == pytest.approx(losses, rel=1e-5)


def test_a_sharded_run_resumes_where_it_stopped(tmp_path):
    """mlp on 2 + 2 sharded replicas, Adam: 4 steps at once, and 2 steps, a checkpoint, 2 more
    resumed from it, end with the same weights. Each replica writes its own share of the weights
    and of Adam's state, as elements of each parameter flattened: none writes a whole parameter
    of a sharded stage (nothing is gathered to be written)."""
    from hetplan.runtime.checkpoint import Reader, latest_step, step_dir

    plan, run = sharded_mlp(tmp_path, 1)
    ckpt = tmp_path / "ckpt"
    whole = run(4)
    run(2, checkpoint_dir=ckpt)
    assert latest_step(ckpt) == 2
    assert sorted(p.name for p in step_dir(ckpt, 2).iterdir()) == ["meta.json", *(f"rank{r}.pt" for r in range(4))]
    reader = Reader(ckpt, 2)
    for data in reader.files:
        regions = {region[0] for _, what, region, _ in data["entries"] if what != "buffer"}
        assert regions == {"flat", "whole"}  # shares, and Adam's step count (a number) whole
        assert all(region[0] == "flat" for _, what, region, _ in data["entries"] if what == "param")
    resumed = run(4, checkpoint_dir=ckpt, resume_step=2)
    for a, b in zip(whole, resumed, strict=True):
        for name, w in a["weights"].items():
            assert torch.equal(w, b["weights"][name]), name


def sharded_mlp(tmp_path, level: int, weights=None):
    """mlp as two stages of two replicas sharding at `level`, and `run(steps, **settings)`,
    which runs it in threads with Adam (each rank's results); the runs build and trace the model
    once between them (they differ in steps and checkpoints only)."""
    from hetplan.runtime.launch import run_spec
    from hetplan.runtime.local import run_threads
    from hetplan.runtime.settings import RunSettings
    from hetplan.runtime.traces import SharedTraces
    from hetplan.zoo import load_model
    from test_executor import chain_plan

    zm = load_model("mlp", batch_size=8)
    names = [p.name for p in split_step(zm.step, zm.batch, "layer").pieces]
    plan = chain_plan(names, [2, 2], 2, "1f1b")
    plan = replace(plan, stages=tuple(replace(s, shard=level) for s in plan.stages))

    shared = SharedTraces()

    def run(steps, **more):
        return run_threads(run_spec(plan, cpus(4), "mlp", RunSettings(
            batch_size=8, granularity="layer", steps=steps, warmup=0, optimizer="adam", lr=1e-3,
            out_dir=tmp_path / "unused", **more), weights=weights), shared=shared)

    return plan, run
