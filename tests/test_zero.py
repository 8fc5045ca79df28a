"""Gradient and parameter sharding among a stage's replicas, node by node (`Stage.shard` 2 and
3, `hetplan.runtime.zero`): each replica keeps only its share between uses and the summed
gradients' share; pipelined runs at each level train as one process does, with recomputation
too; a sharded run resumes from its checkpoint bit for bit; the plans it cannot run are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from hetplan.cost import CostModel
from hetplan.errors import HetplanError, PlanError
from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan, Stage, plan_problems
from hetplan.runtime.sharding import share_bounds
from hetplan.runtime.transport import LocalHub, LocalTransport
from hetplan.runtime.zero import ShardedUnits
from hetplan.sim import simulate
from strategies import chain
from test_executor import chain_plan, check, cpus, pipelined_vs_single
from test_sharding import _threads, sharded_mlp

V100X4 = load_cluster("v100x4")


def _pieces() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.Linear(4, 1)]


def _forward_backward(pieces, units, x, seen):
    """The pieces run as a stage runs them (`StageModule.run` through `units.call`), recording
    before each piece's forward and each parameter's gradient which units hold their storage."""
    def whole():
        return tuple(u.flat.untyped_storage().nbytes() > 0 for u in units.units)

    for i, piece in enumerate(pieces):
        seen.append(("F", i, whole()))
        x = units.call(i, piece, [x], None)
        for p in piece.parameters():
            p.register_hook(lambda g, i=i: seen.append(("B", i, whole())) or g)
    x.sum().backward()
    units.finish()


@pytest.mark.parametrize("level", [2, 3])
def test_units_hold_a_share_and_sum_each_gradient_into_it(level):
    """Three replicas, one node of parameters in each of three pieces (Tanh has none): at level 3
    a unit is whole only while its piece runs (forward, and backward until its gradients are
    reduced), at level 2 always; each replica ends with its share of the summed gradients."""
    inputs = [torch.randn(2, 6) for _ in range(3)]
    reference = _pieces()
    for x in inputs:
        nn.Sequential(*reference)(x).sum().backward()
    hub = LocalHub(3, timeout_s=10)
    made = [_pieces() for _ in range(3)]  # here: torch's random generator is the process's, not a thread's

    def work(rank: int):
        pieces = made[rank]
        units = ShardedUnits([list(p.parameters()) for p in pieces], (0, 1, 2), rank, level)
        units.transport = hub.transport(rank)
        seen: list = []
        _forward_backward(pieces, units, inputs[rank], seen)
        return units, seen

    for rank, (units, seen) in enumerate(_threads(3, work)):
        assert len(units.units) == 3 and units.needs[1] == ()
        for u, piece in zip(units.units, [reference[0], reference[2], reference[3]], strict=True):
            whole = torch.cat([p.grad.reshape(-1) for p in piece.parameters()])
            lo, hi = share_bounds(whole.numel(), 3)[rank]
            assert torch.allclose(u.shard.grad, whole[lo:hi], atol=1e-6)
            assert u.shard.numel() == hi - lo and all(p.grad is None for p in u.params)
            # its own storage: a view of the reduced buffer would keep every share alive
            assert u.shard.grad.untyped_storage().nbytes() == u.shard.grad.numel() * 4
        if level == 2:
            assert all(all(w) for _, _, w in seen)
            continue
        unit = {0: 0, 2: 1, 3: 2}
        for kind, i, whole in seen:
            if kind == "F":  # before a piece's forward: every unit freed
                assert not any(whole)
            else:  # a gradient of piece i's parameters: its unit whole, and none before it
                assert whole[unit[i]] and not any(whole[:unit[i]])
        assert not any(u.flat.untyped_storage().nbytes() for u in units.units)


@pytest.mark.parametrize(("name", "replicas", "level", "recompute", "schedule"), [
    ("gpt2-tiny", [2], 3, "none", "gpipe"),  # the tied embedding in one stage: two pieces read it
    ("gpt2-tiny", [2, 1], 2, "none", "1f1b"),
    pytest.param("gpt2-tiny", [2, 2], 2, "block", "gpipe", marks=pytest.mark.slow),
    ("llama-tiny", [2, 1], 3, "block", "1f1b"),
    pytest.param("llama-tiny", [1, 3], 3, "selective", "1f1b", marks=pytest.mark.slow),
    pytest.param("llama-tiny", [2, 1], 3, "stage", "1f1b", marks=pytest.mark.slow),
])
def test_sharded_gradients_and_parameters_train_as_one_process(name, replicas, level, recompute, schedule):
    """Replicas of unequal rows (weights 2 : 1 ...), three micro-batches: the weights after a
    step and the loss equal one process's (1e-5)."""
    weights = [[2.0 if p == 0 else 1.0 for p in range(r)] for r in replicas]
    sharded = tuple(k for k, r in enumerate(replicas) if r > 1)
    check(*pipelined_vs_single(name, replicas, 3, schedule, batch=9, weights=weights, shard=sharded, level=level,
                               recompute=recompute))


@pytest.mark.parametrize("level", [2, 3])
def test_sharded_gradients_train_as_one_process_on_the_backends_collectives(level, monkeypatch):
    """The path NCCL takes among GPU workers (`Transport.collectives`): each unit's gradients
    reduce-scattered in the backward and its weights all-gathered by the backend's collectives
    (here the threads' hub's), not rings; the step equals one process's."""
    monkeypatch.setattr(LocalTransport, "collectives_on", True)
    calls = []
    monkeypatch.setattr(LocalTransport, "reduce_scatter",
                        lambda self, *a, run=LocalTransport.reduce_scatter: calls.append(1) or run(self, *a))
    check(*pipelined_vs_single("llama-tiny", [2, 1], 3, "1f1b", batch=9, weights=[[2.0, 1.0], [1.0]], shard=(0,),
                               level=level))
    assert calls  # every unit of the sharded stage, on both replicas


@pytest.mark.parametrize("level", [2, 3])
def test_a_run_sharding_gradients_resumes_bit_for_bit(tmp_path, level):
    """mlp on 2 + 2 replicas at `level`, Adam: 4 steps at once, and 2 steps, a checkpoint (each
    replica its file: its share of the weights and of Adam's state), 2 more resumed from it,
    end with the same weights, bit for bit."""
    from hetplan.runtime.checkpoint import latest_step

    plan, run = sharded_mlp(tmp_path, level, weights=[[3.0, 1.0], [1.0, 1.0]])
    ckpt = tmp_path / "ckpt"
    whole = run(4)
    run(2, checkpoint_dir=ckpt)
    assert latest_step(ckpt) == 2
    resumed = run(4, checkpoint_dir=ckpt, resume_step=2)
    for a, b in zip(whole, resumed, strict=True):
        assert a["losses"][-1:] == b["losses"][-1:]
        for name, w in a["weights"].items():
            assert torch.equal(w, b["weights"][name]), name
    moved = run(2)
    assert any(not torch.equal(w, moved[0]["weights"][n]) for n, w in whole[0]["weights"].items())


def test_plans_that_cannot_shard_gradients_are_refused(tmp_path):
    """Zero bubble's split backward; a replica without a row of some micro-batch; a level not
    among ZeRO's; a plan file's true and false read as levels 1 and 0."""
    from hetplan.runtime.launch import run_spec
    from hetplan.runtime.settings import RunSettings

    g = chain(2, params=1e6)
    v100 = V100X4
    plan = Plan((Stage(("n0",), ("v0", "v1"), shard=2), Stage(("n1",), ("v2",))), 2, "zero-bubble", "t")
    assert any("shards its gradients (shard 2) under zero-bubble" in p for p in plan_problems(plan, g, v100))
    assert not any("shards its gradients" in p for p in plan_problems(replace(plan, schedule="1f1b"), g, v100))
    with pytest.raises(PlanError, match="must be one of 0, 1, 2, 3"):
        Stage(("n0",), ("v0",), shard=4)
    assert Stage(("n0",), ("v0", "v1"), shard=True).shard == 1 and Stage(("n0",), ("v0",), shard=False).shard == 0
    zm_names = ["fc1", "fc2"]
    mlp = chain_plan(zm_names, [2, 1], 4, "1f1b")
    mlp = replace(mlp, stages=(replace(mlp.stages[0], shard=3), mlp.stages[1]))
    with pytest.raises(HetplanError, match="has no row of micro-batch"):
        run_spec(mlp, cpus(3), "mlp", RunSettings(batch_size=4, granularity="layer", steps=1, out_dir=tmp_path),
                 weights=[[1.0, 1.0], [1.0]])


@pytest.mark.parametrize("level", [1, 2, 3])
def test_memory_of_each_shard_level(level):
    """Two nodes of 1 GB on 4 replicas, 8 GB of activations for the batch, GPipe at one
    micro-batch: of the weights (1), gradients (2) and Adam's two moments a quarter each as the
    level says, and the largest node whole two (gradients and their buffer) or three times (and
    its weights) while it is reduced."""
    g = chain(2, params=1e9, acts=4e9, batch=8)
    plan = Plan((Stage(("n0", "n1"), ("v0", "v1", "v2", "v3"), shard=level),), 1, "gpipe", "test")
    need = CostModel(g, V100X4).stage_replicas_memory_bytes(plan, 0)
    quartered = {1: 2, 2: 3, 3: 4}[level] * 2e9
    whole = {1: 2, 2: 1, 3: 0}[level] * 2e9
    assert need == {d: int(whole + quartered / 4 + {1: 0, 2: 2, 3: 3}[level] * 1e9 + 8e9 / 4)
                    for d in ("v0", "v1", "v2", "v3")}
    assert simulate(g, V100X4, plan).estimate.peak_mem_bytes == need


def test_deeper_levels_move_their_rings_into_the_passes():
    """Two replicas of an eight-node stage, 1F1B over 4 micro-batches: ZeRO-1 sums once after the
    step; ZeRO-2 reduce-scatters in each of the 4 backwards (half a sum each) and gathers after
    the step; ZeRO-3 gathers in each forward and backward too, nothing after it. Each is slower
    by what its rings add (the passes are the same), and holds less; with two nodes, ZeRO-2
    holds more than ZeRO-1 (a node's gradients whole twice outweigh half the gradients)."""
    g = chain(8, fwd=0.05, bwd=0.1, params=5e7, acts=1e8, batch=8)
    cm = CostModel(g, V100X4)
    nodes = tuple(f"n{i}" for i in range(8))
    plans = {lv: Plan((Stage(nodes, ("v0", "v1"), shard=lv),), 4, "1f1b", "t") for lv in (1, 2, 3)}
    ring = 8 * cm._gradient_sync_s(5e7, 0, ("v0", "v1"))  # one ring per node
    assert ring > cm._gradient_sync_s(4e8, 0, ("v0", "v1"))  # eight latencies
    assert cm.shard_passes_s(plans[1], 0) == (0.0, 0.0)
    assert cm.shard_passes_s(plans[2], 0) == pytest.approx((0.0, ring / 2))
    assert cm.shard_passes_s(plans[3], 0) == pytest.approx((ring / 2, ring))
    est = {lv: simulate(g, V100X4, p).estimate for lv, p in plans.items()}
    assert est[1].step_s < est[2].step_s < est[3].step_s
    assert est[1].peak_mem_bytes["v0"] > est[2].peak_mem_bytes["v0"] > est[3].peak_mem_bytes["v0"]
    two = chain(2, params=2e8, acts=1e8, batch=8)
    held = [simulate(two, V100X4, Plan((Stage(("n0", "n1"), ("v0", "v1"), shard=lv),), 4, "1f1b", "t"))
            .estimate.peak_mem_bytes["v0"] for lv in (1, 2)]
    assert held[1] - held[0] == int(2 * 2e8 - 4e8 / 2)


@pytest.mark.parametrize(("nodes", "level"), [(6, 1), (8, 2), (10, 3)])
def test_where_needed_shards_as_deep_as_a_stage_needs_to_fit(nodes, level):
    """Nodes of 1 GB as one stage on four 16 GB V100s: 6 GB fit with Adam's state sharded, 8
    need the gradients sharded too, 10 the weights too; `replicated` stops at ZeRO-1 and zero
    bubble's split backward too."""
    from hetplan.planners.refine import with_shard

    g = chain(nodes, params=1e9, acts=1e6, batch=8)
    cm = CostModel(g, V100X4)
    plan = Plan((Stage(tuple(f"n{i}" for i in range(nodes)), ("v0", "v1", "v2", "v3")),), 4, "1f1b", "t")
    assert with_shard(cm, plan, "where-needed").stages[0].shard == level
    assert with_shard(cm, plan, "replicated").stages[0].shard == 1
    assert with_shard(cm, replace(plan, schedule="zero-bubble"), "where-needed").stages[0].shard == 1
    assert with_shard(cm, plan, "never") == plan


@pytest.mark.parametrize(("params", "level"), [(1e9, 2), (1.5e9, 3)])
def test_dp_shards_deeper_where_it_pays(params, level):
    """Eight nodes of 1 or 1.5 GB, 3 s of compute each per batch of 4, on four 16 GB V100s: the
    model as one stage on all four wastes no time in a pipeline's bubble, but fits only with its
    gradients sharded (8 GB: 14 GB and a node's 2 GB twice), or its weights too (12 GB: 12 GB and
    4.5); its rings cost less than the bubble. dp takes it under `--shard where-needed` (a
    shorter step, the simulator's, that fits); with ZeRO-1 only it pipelines."""
    from hetplan.planners import PlanOptions, make_plan

    g = chain(8, fwd=1.0, bwd=2.0, params=params, acts=1e8, batch=4)
    deep = make_plan(g, V100X4, "dp", PlanOptions(shard="where-needed"))
    plain = make_plan(g, V100X4, "dp", PlanOptions(shard="replicated"))
    assert [(len(s.devices), s.shard) for s in deep.stages] == [(4, level)] and len(plain.stages) > 1
    assert plan_problems(deep, g, V100X4) == []
    est = simulate(g, V100X4, deep).estimate
    assert est.step_s == pytest.approx(deep.predicted.step_s, rel=1e-9)
    assert est.step_s < simulate(g, V100X4, plain).estimate.step_s
    assert all(est.peak_mem_bytes[d] <= V100X4.device(d).mem_bytes for d in deep.devices)


def test_sharded_weights_train_in_bf16_as_one_process():
    """ZeRO-3 under bf16 autocast (the weights' 16-bit copies made from the gathered weights,
    once a step): one step equals one process's in bf16, to bf16's tolerance."""
    from test_precision import SIXTEEN_BIT_TOL

    worst, moved, loss, ref_loss, *_ = pipelined_vs_single("llama-tiny", [2, 1], 2, "1f1b", batch=6,
                                                           weights=[[1.0, 2.0], [1.0]], shard=(0,), level=3,
                                                           precision="bf16")
    assert moved > 1e-4 and worst <= SIXTEEN_BIT_TOL * moved and loss == pytest.approx(ref_loss, rel=1e-5)


def test_planners_never_return_a_sharded_stage_with_an_idle_replica():
    """Eight micro-batches of one row on two replicas: each replica idles in every other one. At
    ZeRO-1 that runs (each has rows of some micro-batch); sharding gradients it cannot (the rings
    run in every micro-batch), so the planners score it infinite, as `hetplan run` refuses it."""
    import math

    from hetplan.planners import PlanOptions
    from hetplan.planners.scoring import Scorer
    from hetplan.rows import idle_replicas, step_rows

    g = chain(2, params=1e6, batch=8)
    scorer = Scorer(g, V100X4, PlanOptions())
    plans = {lv: Plan((Stage(("n0", "n1"), ("v0", "v1"), shard=lv),), 8, "1f1b", "t") for lv in (1, 2)}
    assert math.isfinite(scorer.value(plans[1])) and scorer.value(plans[2]) == math.inf
    rows = step_rows(8, 8, [[1.0, 1.0]])
    assert idle_replicas(rows, [False]) == [] and idle_replicas(rows, [True]) == [(0, 0), (0, 1)]
