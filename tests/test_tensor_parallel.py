"""Tensor-parallel stages (`hetplan.pieces.tensor_split`, `hetplan.pieces.tensor_stage`,
`hetplan.runtime.tensor_parallel`): a 2- and 4-way group of worker processes over gloo trains
gpt2-tiny and llama-tiny to the same loss and gradients as one process."""

from __future__ import annotations

import os
import time

import pytest
import torch

from hetplan import forked
from hetplan.pieces.split import split_step
from hetplan.plan import Plan, Stage
from hetplan.runtime.stages import stage_modules
from hetplan.runtime.traces import SharedTraces
from hetplan.zoo import load_model
from hetplan.zoo.faithful import switch_off_dropout
from slowness import limit_s

BATCH, SEQ = 4, 16


def _stage(model: str, shared: dict[str, SharedTraces]):
    """The model's whole step as one stage; `shared`: its traces by model, made once (`traces.SharedTraces`)."""
    zm = load_model(model, batch_size=BATCH, seq_len=SEQ)
    switch_off_dropout(zm.step)
    split = shared.setdefault(model, SharedTraces()).split(zm.step, zm.batch, "block", tuple(zm.block_classes))
    plan = Plan((Stage(tuple(p.name for p in split.pieces), ("cpu:0",)),), 1, "gpipe", "test")
    return zm, stage_modules(split, plan)[0]


def _grads(zm, loss) -> dict[str, torch.Tensor]:
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in zm.step.named_parameters() if p.grad is not None}


# (model, degree, sequence-parallel)
CASES = (("gpt2-tiny", 2, False), ("llama-tiny", 2, False), ("gpt2-tiny", 4, False), ("llama-tiny", 4, False),
         ("llama-tiny", 2, True), ("gpt2-tiny", 4, True))


def _saved_bytes(stage, inputs) -> tuple[torch.Tensor, int]:
    """The stage's output on `inputs`, and the bytes autograd saved for its backward (a DTensor's
    local part; each storage once, its parameters not counted)."""
    from torch.distributed.tensor import DTensor

    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}

    def pack(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.untyped_storage().data_ptr() not in weights:
            saved[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(*inputs)
    return out, sum(saved.values())


def _traced() -> dict[str, SharedTraces]:
    """Both models traced once, in the process the group's workers are forked from (`forked.start_group`)."""
    torch.set_num_threads(1)  # no OpenMP team there: a child forked after one hangs
    shared: dict[str, SharedTraces] = {}
    for model in dict.fromkeys(m for m, _, _ in CASES):
        _stage(model, shared)
    return shared


def _group_worker(rank: int, world: int, store: str, out: str, shared: dict[str, SharedTraces]) -> int:
    """Each case on its groups of `world` = 4 workers (2-way: ranks 0-1 and 2-3 side by side)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from hetplan.pieces.tensor_stage import parallelize, running

    torch.set_num_threads(1)  # four workers on a few cores, as the runtime's workers of one thread
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, in order
    try:
        for model, degree, sp in CASES:
            group = pairs[rank // 2] if degree == 2 else dist.group.WORLD
            zm, stage = _stage(model, shared)
            tp = parallelize([stage], zm.step, degree, rank % degree, sp)[0][0]
            tp.attach(DeviceMesh.from_group(group, "cpu"))
            with running("cpu", tp.vocab_parallel):
                loss, saved = _saved_bytes(tp, [zm.batch[k] for k in zm.batch])
                grads = _grads(zm, loss)
            with running("cpu"):  # the logits gathered for the loss
                gathered = _saved_bytes(tp, [zm.batch[k] for k in zm.batch])[1]
            torch.save({"loss": loss.detach(), "grads": grads, "saved": saved, "gathered": gathered,
                        "vocab": tp.vocab_parallel}, f"{out}.{model}.{degree}.{sp}.{rank}")
    finally:
        dist.destroy_process_group()
    return 0


def _joined(name: str, parts: list[torch.Tensor], whole: torch.Tensor) -> torch.Tensor:
    """The shards of one parameter's gradient put back together (a whole one: the first)."""
    if parts[0].shape == whole.shape:
        for part in parts[1:]:
            torch.testing.assert_close(part, parts[0], atol=1e-5, rtol=1e-5, msg=f"{name}: replicas differ")
        return parts[0]
    dim = next(d for d in range(whole.dim()) if parts[0].shape[d] != whole.shape[d])
    return torch.cat(parts, dim)


def test_two_and_four_way_stages_of_gpt2_tiny_and_llama_tiny_equal_one_process(tmp_path):
    """Four worker processes over gloo: each model's whole step as one stage on 2-way groups
    (two side by side) and on one 4-way group, with sequence parallelism or without; the loss and
    every gradient, the shards joined, equal one process's to 1e-5. Sequence-parallel, a worker
    saves less for its backward than without (its norms' and residuals' share of the tokens).
    llama-tiny's loss is vocabulary-parallel: a worker saves its share of the log-probabilities,
    not the whole (GPT-2's head, tied to its embedding, is whole: its loss too)."""
    logs = [tmp_path / f"worker.{r}.log" for r in range(4)]
    group = forked.start_group("test_tensor_parallel:_traced", (), "test_tensor_parallel:_group_worker",
                               [forked.Member((r, 4, str(tmp_path / "store"), str(tmp_path / "out")), dict(os.environ),
                                              str(logs[r])) for r in range(4)],
                               dict(os.environ), tmp_path / "tracing.log", (*forked.PRELOAD, forked.TRANSFORMERS))
    deadline = time.monotonic() + limit_s(600)
    while None in group.exitcodes() and time.monotonic() < deadline:
        time.sleep(0.1)
    group.stop()
    assert group.exitcodes() == [0] * 4, [log.read_text()[-2000:] for log in logs]
    shared: dict[str, SharedTraces] = {}
    for model, degree, sp in CASES:
        zm, stage = _stage(model, shared)
        loss = stage(*(zm.batch[k] for k in zm.batch))
        want = _grads(zm, loss)
        first = torch.load(tmp_path / f"out.{model}.{degree}.{sp}.0")
        assert first["vocab"] == (model == "llama-tiny")
        if first["vocab"]:  # the log-probabilities: 4 x 16 tokens x 256 words x 4 bytes, of which 1/degree kept
            assert first["gathered"] - first["saved"] >= 0.9 * BATCH * SEQ * 256 * 4 * (1 - 1 / degree), first
        else:
            assert first["gathered"] == first["saved"]
        if sp:
            saved = [torch.load(tmp_path / f"out.{model}.{degree}.{flag}.0")["saved"] for flag in (False, True)]
            assert saved[1] < 0.9 * saved[0], saved
        for first in range(0, 4, degree):
            got = [torch.load(tmp_path / f"out.{model}.{degree}.{sp}.{r}") for r in range(first, first + degree)]
            torch.testing.assert_close(got[0]["loss"], loss.detach(), atol=1e-5, rtol=1e-5)
            assert set(got[0]["grads"]) == set(want)
            for name, whole in want.items():
                joined = _joined(name, [g["grads"][name] for g in got], whole)
                torch.testing.assert_close(joined, whole, atol=1e-5, rtol=1e-5, msg=f"{model} {degree} {sp} {name}")


def _cluster(n: int):
    from hetplan.io.clusters import cluster_from_spec

    return cluster_from_spec({"name": "cpus", "devices": [
        {"id": f"c{i}", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"} for i in range(n)]}, "cpus")


def _pipeline_equals_one_process(tmp_path, model: str, stages: list[list[int]], schedule: str,
                                 sequence_parallel: bool = False) -> None:
    """Worker processes run a 2-stage plan whose stages' replicas have the devices given, one
    SGD step; the loss and every worker's weights (its shards joined) equal one process's."""
    from hetplan.runtime.launch import launch, run_spec
    from hetplan.runtime.settings import RunSettings
    from hetplan.runtime.worker import _batches
    from test_executor import reference_step
    from test_runtime import graph_of

    zm = load_model(model, batch_size=8, seq_len=SEQ)
    switch_off_dropout(zm.step)
    split = split_step(zm.step, zm.batch, granularity="block", block_classes=zm.block_classes)
    names = [p.name for p in split.pieces]
    cut = len(names) // 2
    devices = iter(f"c{i}" for i in range(sum(map(sum, stages))))
    built = []
    for degrees, nodes in zip(stages, (names[:cut], names[cut:]), strict=True):
        groups = [tuple(next(devices) for _ in range(t)) for t in degrees]
        tp = max(degrees)
        built.append(Stage(tuple(nodes), tuple(g[0] for g in groups), tp=tp, tp_devices=groups if tp > 1 else (),
                           sequence_parallel=sequence_parallel and tp > 1))
    plan = Plan(tuple(built), 2, schedule, "test")
    spec = run_spec(plan, _cluster(sum(map(sum, stages))), model, RunSettings(
        batch_size=8, seq_len=SEQ, granularity="block", steps=1, warmup=0, optimizer="sgd", lr=0.1, out_dir=tmp_path,
        no_dropout=True, return_weights=True), graph=graph_of(split, 8))
    result = launch(spec)
    reference = stage_modules(split, plan)
    ref_loss = reference_step(zm, _batches(spec, zm, 0), 2, 0.1)
    assert result.losses[0] == pytest.approx(ref_loss, rel=1e-5)
    for k in range(len(stages)):
        for p in range(len(stages[k])):
            ranks = [r for r, me in enumerate(spec.ranks) if me.stage == k and me.replica == p]
            trained = [{n.removeprefix("inner."): w for n, w in torch.load(tmp_path / f"weights.{r}.pt").items()}
                       for r in ranks]
            for name, whole in reference[k].named_parameters():
                got = _joined(name, [t[name] for t in trained], whole)
                torch.testing.assert_close(got, whole.detach(), atol=1e-5, rtol=1e-5, msg=f"stage {k}.{p} {name}")


def test_gpt2_tiny_four_way_stage_then_two_replicas_equals_one_process(tmp_path):
    """The tied embedding and head: whole in the group, summed with the head's replicas."""
    _pipeline_equals_one_process(tmp_path, "gpt2-tiny", [[4], [1, 1]], "1f1b")


def test_llama_tiny_two_replicas_of_two_way_groups_then_a_four_way_group_equal_one_process(tmp_path):
    """Eight workers: each replica's shards summed with the other replica's, place by place."""
    _pipeline_equals_one_process(tmp_path, "llama-tiny", [[2, 2], [4]], "gpipe")


def test_llama_tiny_two_way_sequence_parallel_stages_equal_one_process(tmp_path):
    """Both stages 2-way groups splitting their values along the tokens too, under 1F1B."""
    _pipeline_equals_one_process(tmp_path, "llama-tiny", [[2], [2]], "1f1b", sequence_parallel=True)


def test_a_replica_of_one_device_beside_a_two_way_group_equals_one_process(tmp_path):
    """Replicas of unlike degrees in one stage (Metis's A100s one by one beside a group of
    V100s): their gradients summed whole and given back as each worker's shards; GPT-2's head,
    tied to the embedding of the stage before, so too."""
    _pipeline_equals_one_process(tmp_path, "gpt2-tiny", [[1], [1, 2]], "1f1b")


def test_the_split_follows_megatron_and_keeps_tied_and_key_value_weights_whole_where_it_must():
    from hetplan.pieces.tensor_split import WHOLE, Split, split_units, tensor_splits

    llama = load_model("llama-tiny").step
    two, four = tensor_splits(llama, 2), tensor_splits(llama, 4)
    attn = "model.model.layers.0.self_attn."
    assert two[attn + "q_proj.weight"] == Split(0, 4, "column") and two[attn + "o_proj.weight"] == Split(1, 4, "row")
    assert two[attn + "k_proj.weight"] == Split(0, 2, "column")  # 2 key-value heads: one each
    assert four[attn + "k_proj.weight"] == WHOLE  # fewer key-value heads than devices: each has them all
    assert four["model.model.layers.0.mlp.down_proj.weight"] == Split(1, 344, "row")
    assert four["model.lm_head.weight"] == Split(0, 256, "column") and four["model.model.embed_tokens.weight"] == WHOLE
    gpt2 = load_model("gpt2-tiny").step
    splits = tensor_splits(gpt2, 2)
    assert splits["model.transformer.h.0.attn.c_attn.weight"] == Split(1, 4, "column")  # Conv1D: [in, out]
    assert splits["model.transformer.h.0.attn.c_proj.bias"] == WHOLE
    assert splits["model.transformer.wte.weight"] == WHOLE  # tied to the head
    names = {n for n, _ in gpt2.named_parameters()}
    assert split_units(gpt2, {n for n in names if ".h.0." in n}) == 4  # heads 4, MLP 512
    assert split_units(gpt2, {n for n in names if "ln_f" in n}) == 0


def test_sequence_parallel_is_a_tensor_parallel_stages_choice_and_its_plan_file_says_it(cli, tmp_path):
    """A stage of one device per replica cannot split its tokens (refused in one line); a plan file
    keeps the choice; `hetplan plan` marks the stage; `--sequence-parallel never` plans without it.
    OPT-1.3B, one sequence of 2,048 tokens on two A100s of a host: one micro-batch, so a 2-way
    group is the only way to use both, and sequence-parallel it holds less."""
    from hetplan.errors import PlanError
    from hetplan.io import serde

    with pytest.raises(PlanError, match="sequence_parallel True; it is true only for a tensor-parallel stage"):
        Stage(("a",), ("c0",), sequence_parallel=True)
    stage = Stage(("a",), ("c0",), tp=2, tp_devices=(("c0", "c1"),), sequence_parallel=True)
    plan = Plan((stage,), 1, "1f1b", "test")
    assert serde.loads(serde.dumps(plan)) == plan
    graph = tmp_path / "opt.json"
    assert cli("profile", "opt-1.3b", "--roofline", "a100-40gb", "--batch-size", "1", "--seq-len", "2048",
               "-o", graph).code == 0
    spec = tmp_path / "two.yaml"
    spec.write_text("devices: [{id: a, type: a100-40gb, host: h, count: 2}]\n")
    marks, memory = {}, {}
    for flag in ("tensor-parallel", "never"):
        r = cli("plan", graph, "--cluster", spec, "--sequence-parallel", flag, "-o", tmp_path / f"{flag}.json")
        assert r.code == 0, r.err
        planned = serde.load(tmp_path / f"{flag}.json")
        assert any(s.tp > 1 for s in planned.stages), r.out
        marks[flag] = ("tp2 sp" in r.out, all(s.sequence_parallel == (flag != "never") for s in planned.stages
                                              if s.tp > 1))
        memory[flag] = max(planned.predicted.peak_mem_bytes.values())
    assert marks == {"tensor-parallel": (True, True), "never": (False, True)}
    assert memory["tensor-parallel"] < memory["never"]


def test_a_projection_without_a_rule_is_refused_by_name():
    from torch import nn

    from hetplan.errors import HetplanError
    from hetplan.pieces.tensor_split import split_units, tensor_splits

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(HetplanError, match=r"module '0' \(Linear\) cannot be split tensor-parallel.*--max-tp 1"):
        tensor_splits(model, 2)
    assert split_units(model, {"0.weight"}) == 1


def test_validation_refuses_a_split_the_model_cannot_make_in_one_line():
    from hetplan.graph import Edge, Graph, Node
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.plan import plan_problems

    t = {"cpu": 1.0}
    graph = Graph("g", (Node("a", "Block", t, t, tp_units=4), Node("b", "Block", t, t, tp_units=6),
                        Node("c", "Norm", t, t, tp_units=0)), (Edge("a", "b"), Edge("b", "c")), 8, "cpu")
    cluster = cluster_from_spec({"name": "two", "devices": [
        {"id": f"{h}{i}", "type": "a100-40gb", "host": h} for h in "xy" for i in range(4)]}, "two")

    def problems(nodes, groups):
        stage = Stage(nodes, tuple(g[0] for g in groups), tp=len(groups[0]), tp_devices=groups)
        rest = tuple(n for n in "abc" if n not in nodes)
        stages = (stage, Stage(rest, ("y3",))) if rest else (stage,)
        return plan_problems(Plan(stages, 1, "gpipe", "test"), graph, cluster)

    assert problems(("a", "b"), [("x0", "x1")]) == []
    assert problems(("a", "b"), [("x0", "x1", "x2", "x3")]) == [
        "stage 0 cannot split 4 ways: node 'b' splits into 6 parts (its heads, MLP units and vocabulary), which 4 does "
        "not divide; use a tp that divides 6"]
    assert "mixes device types or hosts" in problems(("a", "b"), [("x0", "y1")])[0]
    last = Plan((Stage(("a", "b"), ("y0",)), Stage(("c",), ("x0",), tp=2, tp_devices=(("x0", "x1"),))), 1, "gpipe",
                "test")
    assert plan_problems(last, graph, cluster) == [
        "stage 1 cannot split 2 ways: nothing in it splits tensor-parallel (no attention, MLP or vocabulary "
        "projection); set tp 1"]


def test_a_group_is_charged_its_share_of_the_splitting_nodes_and_their_all_reduces():
    """Exact: node a splits (1/2 each plus two all-reduces of its output per pass), node b
    runs whole (no fixed parts to grow by DTensor's dispatch); each device holds half of a's
    parameters; the group's second device is busy and holds memory as its first, and is paid for."""
    from dataclasses import replace

    from hetplan.cost import CostModel
    from hetplan.cost.table import step_costs
    from hetplan.graph import Edge, Graph, Node
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.sim import simulate

    graph = Graph("g", (Node("a", "Block", {"a100-40gb": 0.4}, {"a100-40gb": 0.8}, param_bytes=1000, out_bytes=10**6,
                             tp_units=4),
                        Node("b", "Norm", {"a100-40gb": 0.1}, {"a100-40gb": 0.2}, param_bytes=100, tp_units=0)),
                  (Edge("a", "b", 10**6),), 8, "a100-40gb")
    cluster = cluster_from_spec({"name": "one", "devices": [
        {"id": f"g{i}", "type": "a100-40gb", "host": "h"} for i in range(2)]}, "one")
    plan = Plan((Stage(("a", "b"), ("g0",), tp=2, tp_devices=(("g0", "g1"),)),), 1, "gpipe", "test")
    cm = CostModel(graph, cluster)
    allreduce = cm._allreduce_s(10**6, ("g0", "g1"))
    assert allreduce > 0
    work = step_costs(graph, cluster, plan, cost=cm).stages[0]
    rep = work.replicas[0]
    # one micro-batch: its all-reduces, of the whole batch's bytes, paid with its one action
    assert rep.fwd_s == pytest.approx(0.2 + 0.1) and rep.bwd_s == pytest.approx(0.4 + 0.2)
    assert rep.fwd_fixed_s == pytest.approx(2 * allreduce) and rep.bwd_fixed_s == pytest.approx(2 * allreduce)
    four = step_costs(graph, cluster, replace(plan, microbatches=4), cost=cm).stages[0].replicas[0]
    assert four.fwd_fixed_s == pytest.approx(2 * cm._allreduce_s(10**6 / 4, ("g0", "g1")))
    assert rep.weight_bytes == 4 * (500 + 100)  # weights, gradients, Adam's two moments: half of a's
    est = simulate(graph, cluster, plan).estimate
    assert est.busy_s["g1"] == est.busy_s["g0"] and est.peak_mem_bytes["g1"] == est.peak_mem_bytes["g0"]
    alone = simulate(graph, cluster, Plan((Stage(("a", "b"), ("g0",)),), 1, "gpipe", "test")).estimate
    assert est.usd_per_step / est.step_s == pytest.approx(2 * alone.usd_per_step / alone.step_s)


def _brute_force(graph, cluster, options):
    """The best plan of every chain of stages, every assignment of devices to them, every cut of
    a stage's devices into groups of one host and type, every micro-batch count, with the memory
    choices the options allow (sharding where a stage can, recomputation where memory needs
    it, as exact takes them): scored by the simulator on the real problem (a reference that
    knows nothing of groupings)."""
    import itertools
    import math

    from hetplan.plan import plan_problems
    from hetplan.planners.kit import microbatch_choices
    from hetplan.planners.refine import with_recompute, with_shard
    from hetplan.planners.scoring import Scorer

    scorer = Scorer(graph, cluster, options)
    cost = scorer.cost
    names = list(graph.topo_order)
    ids = [d.id for d in cluster.devices]
    best_value, best = float("inf"), None
    for n in range(1, len(names) + 1):
        for cuts in itertools.combinations(range(1, len(names)), n - 1):
            bounds = [0, *cuts, len(names)]
            for owner in itertools.product(range(n + 1), repeat=len(ids)):  # n: unused
                held = [[d for d, o in zip(ids, owner, strict=True) if o == k] for k in range(n)]
                if not all(held):
                    continue
                for stages in itertools.product(*(_group_cuts(h, cluster, options.max_tp) for h in held)):
                    built = tuple(_stage_of(names[bounds[k]:bounds[k + 1]], groups) for k, groups in enumerate(stages))
                    for m in microbatch_choices(graph, options):
                        plan = Plan(built, m, options.schedule, "brute")
                        plan = with_recompute(cost, with_shard(cost, plan, options.shard), options.recompute)
                        value = math.inf if plan_problems(plan, graph, cluster) else scorer.value(plan)
                        if value < best_value:
                            best_value, best = value, plan
    return best_value, best


def _stage_of(nodes, groups) -> Stage:
    tp = max(map(len, groups))
    return Stage(tuple(nodes), tuple(g[0] for g in groups), tp=tp, tp_devices=groups if tp > 1 else ())


def _group_cuts(devices, cluster, max_tp):
    """Every cut of `devices` into groups of up to max_tp devices, each of one host and type."""
    import itertools

    if not devices:
        return [()]
    first, rest = devices[0], devices[1:]
    out = []
    for size in range(1, min(max_tp, len(devices)) + 1):
        for mates in itertools.combinations(rest, size - 1):
            group = (first, *mates)
            if len({(cluster.device(d).host, cluster.device(d).type) for d in group}) == 1:
                out += [(group, *tail) for tail in _group_cuts([d for d in rest if d not in mates], cluster, max_tp)]
    return out


def test_dp_with_tensor_parallelism_finds_the_exhaustive_optimum():
    """One sample per step, so replicas cannot share it: on 2 A100 + 2 V100 the best plan puts
    a 2-way group per pipeline stage, or the whole model on one group; dp finds the step of a
    search over every plan, with --max-tp 2 and by default (groups of a host's GPUs of a type),
    and with --max-tp 1 it cannot."""
    from hetplan.graph import Edge, Graph, Node
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.planners import PlanOptions, make_plan

    t = {"a100-40gb": 0.02}
    graph = Graph("g", (Node("a", "Block", t, {"a100-40gb": 0.04}, param_bytes=10**6, out_bytes=10**4, tp_units=4),
                        Node("b", "Block", t, {"a100-40gb": 0.04}, param_bytes=10**6, out_bytes=10**4, tp_units=4),
                        Node("c", "Head", {"a100-40gb": 0.005}, {"a100-40gb": 0.01}, out_bytes=4, tp_units=0)),
                  (Edge("a", "b", 10**4), Edge("b", "c", 10**4)), 1, "a100-40gb")
    cluster = cluster_from_spec({"name": "mixed", "devices": [
        *({"id": f"a{i}", "type": "a100-40gb", "host": "x"} for i in range(2)),
        *({"id": f"v{i}", "type": "v100-16gb", "host": "y"} for i in range(2))]}, "mixed")
    options = PlanOptions(max_tp=2)
    want, reference = _brute_force(graph, cluster, options)
    assert any(s.tp == 2 for s in reference.stages)
    plan = make_plan(graph, cluster, "dp", options)
    assert plan.predicted.step_s == pytest.approx(want, rel=1e-9)
    assert any(s.tp == 2 for s in plan.stages)
    assert make_plan(graph, cluster, "dp", PlanOptions()).predicted.step_s == pytest.approx(want, rel=1e-9)
    assert make_plan(graph, cluster, "dp", PlanOptions(max_tp=1)).predicted.step_s > want * 1.05


@pytest.mark.parametrize("seed", range(6))
def test_dp_with_tensor_parallelism_equals_exhaustive_search_on_random_problems(seed):
    import random

    from hetplan.graph import Edge, Graph, Node
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.planners import PlanOptions, make_plan

    r = random.Random(seed)
    nodes = []
    for name in "abc":
        f = r.uniform(0.005, 0.05)
        nodes.append(Node(name, "Block", {"a100-40gb": f}, {"a100-40gb": 2 * f}, param_bytes=r.choice([10**6, 10**9]),
                          out_bytes=r.choice([10**4, 10**7, 10**8]), act_bytes=10**6, tp_units=r.choice([0, 2, 4])))
    graph = Graph("g", tuple(nodes), (Edge("a", "b", nodes[0].out_bytes), Edge("b", "c", nodes[1].out_bytes)),
                  r.choice([1, 2, 4, 8]), "a100-40gb")
    cluster = cluster_from_spec({"name": "mixed", "devices": [
        *({"id": f"a{i}", "type": "a100-40gb", "host": "x"} for i in range(2)),
        *({"id": f"v{i}", "type": "v100-16gb", "host": "y"} for i in range(2))]}, "mixed")
    options = PlanOptions(max_tp=2)
    want, _ = _brute_force(graph, cluster, options)
    assert make_plan(graph, cluster, "dp", options).predicted.step_s == pytest.approx(want, rel=1e-9)


def test_each_projection_pair_is_bounded_as_megatron_bounds_it():
    """Per llama block: the input of q, k, v made whole once (f, shared by the three), the same
    for gate and up, the outputs of o and down summed (g); 4 ways over 2 key-value heads, k and v
    stay whole and read the plain input, not the f."""
    from hetplan.pieces.tensor_split import tensor_splits
    from hetplan.pieces.tensor_stage import megatron_boundaries, replicated

    shared: dict[str, SharedTraces] = {}
    for degree, whole_entries in ((2, 3), (4, 1)):
        zm, stage = _stage("llama-tiny", shared)  # a copy of the first trace: the second as new
        names = {id(p): n for n, p in zm.step.named_parameters()}
        splits = tensor_splits(zm.step, degree)
        megatron_boundaries(stage, {pid: splits[n] for pid, n in names.items()})
        calls = [n for gm in stage.pieces for n in gm.graph.nodes if n.target is replicated]
        assert len(calls) == 4 * 4 + 1  # and the head's input
        # what reads them: per block q, k, v (or q alone), gate and up, and the two residual sums
        readers = {u for c in calls for u in c.users if u.target is not replicated}
        assert len(readers) == 4 * (whole_entries + 2 + 2) + 1


def test_the_profiler_records_how_far_each_node_splits():
    from hetplan.profile import profile_step

    zm = load_model("llama-tiny", batch_size=2, seq_len=8)
    graph = profile_step(zm.step, zm.batch, name="llama-tiny", granularity="block", block_classes=zm.block_classes,
                         repeats=1, fixed=False).graph
    units = {n.id: n.tp_units for n in graph.nodes}
    assert units["model.layers.0"] == 4 and units["lm_head"] == 256  # heads 4, MLP 344; a vocabulary of 256
    assert units["input"] == 0 and units["model.norm"] == 0


def test_the_groupings_planned_on():
    """Small clusters: every cut of each host's devices of a type; big ones: a degree per type."""
    from hetplan.graph import Graph, Node
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.planners.tensor_groups import by_type, degrees, small_groupings

    t = {"a100-40gb": 1.0}
    graph = Graph("g", (Node("a", "Block", t, t, tp_units=12),), (), 8, "a100-40gb")
    assert degrees(graph, 8) == (2, 3, 4, 6)
    cluster = cluster_from_spec({"name": "c", "devices": [
        *({"id": f"a{i}", "type": "a100-40gb", "host": "x"} for i in range(2)),
        *({"id": f"v{i}", "type": "v100-16gb", "host": "y"} for i in range(4))]}, "c")
    # a100s: alone or a pair; v100s: alone, a pair, two pairs, a triple or all four
    assert len(small_groupings(graph, cluster, 4)) == 2 * 5 - 1
    assert by_type(cluster, {"v100-16gb": 3}) == (("v0", "v1", "v2"),)


def test_max_tp_on_a_graph_that_cannot_split_is_refused_in_one_line():
    """Asked for groups of 2 on a graph whose nodes say nothing of how they split (a PipeDream
    import), or split only 3 ways: one line that says why and what to do, not a plan made as if
    --max-tp were 1. By default (auto) nothing is asked, so nothing is refused."""
    from hetplan.errors import HetplanError
    from hetplan.graph import Edge, Graph, Node
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.planners import PlanOptions, make_plan

    t = {"a100-40gb": 0.01}
    cluster = cluster_from_spec({"devices": [{"id": "a", "type": "a100-40gb", "host": "h", "count": 2}]}, "two")
    silent = Graph("imported", (Node("a", "Conv2d", t, t), Node("b", "Conv2d", t, t)), (Edge("a", "b", 10),), 4,
                   "a100-40gb")
    with pytest.raises(HetplanError, match=r"^--max-tp 2: graph 'imported' does not say how its nodes split "
                                           r"tensor-parallel \(no node has tp_units\); profile the model again"):
        make_plan(silent, cluster, "dp", PlanOptions(max_tp=2))
    odd = Graph("odd", (Node("a", "Block", t, t, tp_units=3), Node("b", "Head", t, t, tp_units=0)),
                (Edge("a", "b", 10),), 4, "a100-40gb")
    with pytest.raises(HetplanError, match=r"^--max-tp 2: no node of graph 'odd' splits into 2 to 2 equal parts "
                                           r"\(the most ways a node splits: 3\)"):
        make_plan(odd, cluster, "uniform", PlanOptions(max_tp=2))
    assert make_plan(silent, cluster, "dp").predicted.feasible
    assert all(s.tp == 1 for s in make_plan(odd, cluster, "dp").stages)


def test_heads_given_per_stage_split_each_attention_by_its_own():
    """Swin's configuration gives its heads per stage (a list), so a model's one number of heads
    cannot be read off it: each attention splits by the heads its own module says (the first
    stage's block, 1 head, cannot split; the second's, 2, splits 2 ways), the profile records so,
    and a projection whose heads nothing says is refused by name."""
    from types import SimpleNamespace

    import transformers as tf
    from torch import nn

    from hetplan.errors import HetplanError
    from hetplan.pieces.tensor_split import Split, split_units, tensor_splits
    from hetplan.profile import profile_step

    cfg = tf.SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                        window_size=2, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        drop_path_rate=0.0)
    swin = tf.SwinForImageClassification(cfg)

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = swin

        def forward(self, pixel_values, labels):
            return self.model(pixel_values=pixel_values, labels=labels).loss

    batch = {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.tensor([0, 1, 2, 3])}
    graph = profile_step(Step(), batch, name="swin", devices=("cpu:1",), repeats=1, granularity="block",
                         block_classes=("SwinLayer",)).graph
    units = {n.id.removeprefix("model."): n.tp_units for n in graph.nodes}
    assert units["swin.encoder.layers.0.blocks.0"] == 1 and units["swin.encoder.layers.1.blocks.0"] == 2
    second = {n for n, _ in swin.named_parameters() if n.startswith("swin.encoder.layers.1.blocks.0.")}
    assert tensor_splits(swin, 2, second)["swin.encoder.layers.1.blocks.0.attention.q_proj.weight"] == \
        Split(0, 2, "column")

    unknown = nn.Module()
    unknown.attn = nn.Module()
    unknown.attn.q_proj = nn.Linear(4, 4)
    unknown.config = SimpleNamespace(num_attention_heads=[1, 2])
    with pytest.raises(HetplanError, match=r"^module 'attn.q_proj' is an attention projection whose heads are not"):
        tensor_splits(unknown, 2)
    assert split_units(unknown, {"attn.q_proj.weight"}) == 1
