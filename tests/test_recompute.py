"""Activation recomputation per stage (`Stage.recompute`): the cost table charges the forward
again in the backward and keeps only the stage's boundary tensors, the simulator's and the cost
model's peak memory follow the closed form, and the runtime's weights equal one process's and,
to the last bit, the same plan's without recomputation."""

import math
from dataclasses import replace

import pytest
import torch

from hetplan.cost import CostModel
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.pieces.split import split_step
from hetplan.plan import Plan, Stage
from hetplan.runtime.launch import run_spec
from hetplan.runtime.settings import RunSettings
from hetplan.runtime.stages import stage_modules
from hetplan.runtime.worker import _batches
from hetplan.sim import simulate
from hetplan.zoo import load_model
from strategies import chain, exact_step_dp_matches, one_per_stage
from test_executor import chain_plan, cpus, no_dropout, reference_step, run_checked, traced

V100X4 = load_cluster("v100x4")


def recomputing(plan: Plan, stages=None, unit="stage") -> Plan:
    keep = set(range(len(plan.stages)) if stages is None else stages)
    return replace(plan, stages=tuple(replace(s, recompute=unit if k in keep else "none")
                                      for k, s in enumerate(plan.stages)))


@pytest.mark.parametrize("n,m", [(1, 1), (3, 4), (4, 8)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_backward_runs_the_forward_again(n, m, schedule):
    """Equal stages, nothing sent: a flushed pipeline takes (m + n - 1) (F + B) / m, and
    recomputation makes B = 0.05 + 0.03."""
    g = chain(n, fwd=0.03, bwd=0.05)
    plain = one_per_stage(n, m, schedule)
    assert simulate(g, V100X4, plain).estimate.step_s == pytest.approx((m + n - 1) * 0.08 / m)
    assert simulate(g, V100X4, recomputing(plain)).estimate.step_s == pytest.approx((m + n - 1) * 0.11 / m)


@pytest.mark.parametrize("m", [1, 4, 8])
def test_peak_memory_keeps_the_boundaries_and_one_micro_batch(m):
    """4 stages under 1F1B hold min(m, 4 - k) micro-batches: without recomputation their
    activations (A = 1 MB per batch each); recomputing, only what crosses their cuts (E = 10 kB
    a cut: E for the end stages, 2E between) plus one micro-batch's activations while its backward
    runs. The simulator and the cost model (which planners ask) agree with the closed form."""
    a, e, params = 1e6, 1e4, 1000
    g = chain(4, acts=a, edge_bytes=e, params=params, batch=8)
    for plan in (one_per_stage(4, m), recomputing(one_per_stage(4, m))):
        est = simulate(g, V100X4, plan).estimate
        cm = CostModel(g, V100X4)
        for k, stage in enumerate(plan.stages):
            held = min(m, 4 - k)
            kept = e * (1 if k in (0, 3) else 2)
            acts = kept * held / m + a / m if stage.recomputes else a * held / m
            want = 4 * params + acts
            assert est.peak_mem_bytes[f"v{k}"] == pytest.approx(want, abs=1)
            assert cm.stage_memory_bytes(plan, k, f"v{k}") == pytest.approx(want, abs=1)


@pytest.mark.parametrize("m", [1, 4])
def test_per_block_keeps_each_nodes_input_and_rebuilds_one_node(m):
    """Two stages of three nodes (activations 1, 3 and 2 MB per batch; each node sends E = 10 kB
    to the next) under 1F1B: stage k holds min(m, 2 - k) micro-batches. Per block it keeps per
    micro-batch the cut before it and every node's output that a node reads (3E for stage 0,
    E + 2E for stage 1, whose last node's output is the loss), and rebuilds only its largest
    node (3 MB) while its backward runs; per stage it keeps its two cuts and rebuilds all 6 MB.
    The simulator and the cost model agree with the closed form, and a planner's table too."""
    from hetplan.cost.stage_table import StageTable
    from hetplan.graph import Node

    e, params = 1e4, 1000
    g = chain(6, acts=0, edge_bytes=e, params=params, batch=8)
    g = replace(g, nodes=tuple(replace(n, act_bytes=a) for n, a in zip(g.nodes, [1e6, 3e6, 2e6] * 2, strict=True)))
    assert all(isinstance(n, Node) for n in g.nodes)
    plan = Plan((Stage(("n0", "n1", "n2"), ("v0",)), Stage(("n3", "n4", "n5"), ("v1",))), m, "1f1b", "test")
    kept = {"block": (3 * e, e + 2 * e), "stage": (e, e), "none": (6e6, 6e6)}
    rebuilt = {"block": 3e6, "stage": 6e6, "none": 0.0}
    table = StageTable.of_chain(CostModel(g, V100X4))
    for unit in ("none", "stage", "block"):
        p = recomputing(plan, unit=unit)
        est = simulate(g, V100X4, p).estimate
        cm = CostModel(g, V100X4)
        for k, (i, j) in enumerate(((0, 3), (3, 6))):
            held = min(m, 2 - k)
            want = 4 * 3 * params + kept[unit][k] * held / m + rebuilt[unit] / m
            assert est.peak_mem_bytes[f"v{k}"] == pytest.approx(want, abs=1)
            assert cm.stage_memory_bytes(p, k, f"v{k}") == pytest.approx(want, abs=1)
            kind = table.kind((f"v{k}",))
            assert float(table.memory_bytes(kind, i, j, held / m, 1 / m, unit)) == pytest.approx(want, abs=1)


def test_a_stage_recomputing_per_block_saves_its_pieces_inputs_and_rebuilds_each_piece_once():
    """What autograd saves in the forward of a gpt2-tiny stage: all its activations without
    recomputation; per block only each piece's inputs (its checkpoint's); in the backward
    each piece that saved something runs again once (the `rebuilt` calls), and the gradients are the plain ones."""
    import torch

    from hetplan.runtime.executor import Role, StageRunner

    zm = no_dropout(load_model("gpt2-tiny", batch_size=2, seq_len=8, seed=0))
    split = split_step(zm.step, zm.batch, "block", zm.block_classes)
    plan = chain_plan([p.name for p in split.pieces], [1], 1, "1f1b")
    module = stage_modules(split, plan)[0]
    inputs = [zm.batch[k] for k in split.input_names]
    grads, saved = {}, {}
    for unit in ("none", "block"):
        runner = StageRunner(Role(0, 0, ((0,),), None, unit), lambda rows: module, (), (), None, torch.device("cpu"))
        calls = []
        runner.rebuilt = lambda calls=calls: calls.append(1)
        count = []

        def pack(t, count=count):
            count.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = runner._run(module, inputs)
        saved[unit] = sum(count)
        module.zero_grad()
        loss.backward()
        grads[unit] = {n: p.grad.clone() for n, p in module.named_parameters()}
        # each piece whose backward needs what it saved runs again, once (not the first, which
        # makes the embeddings' positions from the inputs and saves nothing)
        assert len(calls) == (len(module.pieces) - 1 if unit == "block" else 0)
    read = []  # the pieces' inputs, which each piece's checkpoint keeps
    module.run(inputs, lambda piece, args: read.append(sum(a.numel() for a in args)) or piece(*args))
    assert saved["block"] == sum(read) and 4 * saved["block"] < saved["none"]
    assert all(grads["block"][n].equal(grads["none"][n]) for n in grads["none"])


def test_a_stage_recomputing_selectively_reruns_all_but_its_products():
    """Operators run in the backward of a gpt2-tiny stage, per unit: per block, the forward's
    operators again (its products too); selectively, the norms again but no product (their
    outputs kept: as many products as without recomputation); the gradients are the plain ones."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hetplan.pieces.selective import keeps
    from hetplan.runtime.executor import Role, StageRunner

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.products = self.norms = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.products += keeps(func)
            self.norms += func.overloadpacket is torch.ops.aten.native_layer_norm
            return func(*args, **(kwargs or {}))

    zm = no_dropout(load_model("gpt2-tiny", batch_size=2, seq_len=8, seed=0))
    split = split_step(zm.step, zm.batch, "block", zm.block_classes)
    module = stage_modules(split, chain_plan([p.name for p in split.pieces], [1], 1, "1f1b"))[0]
    inputs = [zm.batch[k] for k in split.input_names]
    counts, grads = {}, {}
    for unit in ("none", "block", "selective"):
        runner = StageRunner(Role(0, 0, ((0,),), None, unit), lambda rows: module, (), (), None, torch.device("cpu"))
        with Count() as forward:
            loss = runner._run(module, inputs)
        module.zero_grad()
        with Count() as backward:
            loss.backward()
        counts[unit] = (forward.products, forward.norms, backward.products, backward.norms)
        grads[unit] = {n: p.grad.clone() for n, p in module.named_parameters()}
    products, norms, back_products, _ = counts["none"]
    assert products > 0 and norms > 0 and counts["none"][3] == 0
    # (torch stops a recomputation once it has what the backward needs: not every product again)
    assert back_products + products // 2 < counts["block"][2] <= back_products + products
    assert counts["block"][3] == norms
    assert counts["selective"][2:] == (back_products, norms)
    assert all(grads[u][n].equal(grads["none"][n]) for u in grads for n in grads["none"])


def test_a_plan_file_says_which_stages_recompute():
    plan = recomputing(one_per_stage(3, 2), stages=[1])
    back = serde.loads(serde.dumps(plan))
    assert [s.recompute for s in back.stages] == ["none", "stage", "none"] and back == plan
    old = serde.to_dict(one_per_stage(3, 2))
    for s in old["stages"]:
        s.pop("recompute")
    assert serde.from_dict(old) == one_per_stage(3, 2)  # plan files from before read as before


def run_weights(name, replicas, m, schedule, recompute, batch=8, unit="stage", granularity="layer", shared=None):
    """One step in threads, the named stages recomputing; the ranks take their traces from
    `shared` (`traces.SharedTraces`), by default the session's for the model (`test_executor.traced`)."""
    zm = no_dropout(load_model(name, batch_size=batch, seq_len=16, seed=0))
    shared, split = traced(zm, granularity, shared, replicas, m)
    plan = chain_plan([p.name for p in split.pieces], replicas, m, schedule)
    plan = recomputing(plan, recompute, unit)
    spec = run_spec(plan, cpus(sum(replicas)), name, RunSettings(batch_size=batch, seq_len=16, granularity=granularity,
                    block_classes=tuple(zm.block_classes or ()), steps=1, warmup=0, optimizer="sgd", lr=0.1,
                    out_dir="unused", no_dropout=True))
    return zm, split, plan, spec, run_checked(spec, shared)


RESNET = "user_models:resnet50_short"  # resnet50's bottlenecks, fewer of them
ROWS = {RESNET: 4}  # its 224-pixel images: fewer rows, the same pieces


@pytest.mark.parametrize("name,replicas,m,schedule,recompute,unit,granularity", [
    ("gpt2-tiny", [1, 2], 3, "1f1b", [0, 1], "stage", "layer"),  # a replicated stage recomputing, rows 4 + 4
    ("gpt2-tiny", [1, 1, 1], 4, "gpipe", [1], "stage", "layer"),  # one stage of three
    ("gpt2-tiny", [1, 1], 4, "zero-bubble", [0, 1], "stage", "layer"),  # the backward split in I and W
    ("inception-tiny", [1, 1], 2, "1f1b", [0, 1], "stage", "layer"),  # branches, batch norm's statistics
    # a checkpoint per node: transformer blocks, layers, pieces that change their inputs in place
    ("gpt2-tiny", [1, 2], 3, "1f1b", [0, 1], "block", "block"),
    ("llama-tiny", [1, 1], 4, "zero-bubble", [0, 1], "block", "block"),
    ("inception-tiny", [1, 1], 2, "1f1b", [0, 1], "block", "layer"),
    (RESNET, [1, 1], 2, "1f1b", [1], "block", "layer"),  # an add_ on a piece's input, inside its checkpoint
    # per block keeping the products' outputs (torch's selective checkpoint)
    ("gpt2-tiny", [1, 2], 3, "1f1b", [0, 1], "selective", "block"),
    ("llama-tiny", [1, 1], 4, "1f1b", [0, 1], "selective", "block"),
    ("llama-tiny", [1, 1], 4, "gpipe", [1], "selective", "layer"),
])
def test_recomputing_stages_train_as_one_process_and_as_without(name, replicas, m, schedule, recompute, unit,
                                                                 granularity):
    batch = ROWS.get(name, 8)
    zm, split, plan, spec, results = run_weights(name, replicas, m, schedule, recompute, batch, unit, granularity)
    _, _, _, _, plain = run_weights(name, replicas, m, schedule, [], batch, granularity=granularity)
    before = {id(p): p.detach().clone() for p in zm.step.parameters()}
    ref_loss = reference_step(zm, _batches(spec, zm, 0), m, 0.1)
    modules = stage_modules(split, plan)
    worst = moved = 0.0
    for rank, (res, other) in enumerate(zip(results, plain, strict=True)):
        assert res["weights"].keys() == other["weights"].keys()
        for pname in res["weights"]:
            assert res["weights"][pname].equal(other["weights"][pname]), pname  # bit for bit
        for bname in res["buffers"]:  # batch norm's running statistics: updated once, not again
            assert res["buffers"][bname].equal(other["buffers"][bname]), bname
        for pname, p in modules[spec.ranks[rank].stage].named_parameters():
            worst = max(worst, (res["weights"][pname] - p.detach()).abs().max().item())
            moved = max(moved, (p.detach() - before[id(p)]).abs().max().item())
    assert moved > 1e-4 and worst <= 1e-5
    last = len(replicas) - 1
    loss = sum(res["losses"][0] for rank, res in enumerate(results) if spec.ranks[rank].stage == last)
    assert loss == pytest.approx(ref_loss, rel=1e-5)


def test_where_needed_recomputes_the_stages_over_memory():
    """Four equal stages on 16 GB V100s, 4 micro-batches under 1F1B, 20 GB of activations per
    stage and batch: stage 0 holds all four micro-batches' (20 GB) and does not fit, the others
    hold 3, 2, 1 of them (15, 10, 5 GB) and fit. `where-needed` recomputes stage 0 only (it then
    holds 4 x its boundary and one micro-batch's 5 GB), which makes the plan fit; `always`
    recomputes every stage."""
    from hetplan.planners import PlanOptions, make_plan

    g = chain(4, fwd=0.03, bwd=0.05, acts=20e9, edge_bytes=1e6, batch=8)
    asked = {mode: make_plan(g, V100X4, "uniform", PlanOptions(microbatches=4, recompute=mode))
             for mode in ("never", "where-needed", "always")}
    assert [s.recompute for s in asked["never"].stages] == ["none"] * 4 and not asked["never"].predicted.feasible
    assert [s.recompute for s in asked["where-needed"].stages] == ["stage", "none", "none", "none"]
    assert asked["where-needed"].predicted.feasible
    assert [s.recompute for s in asked["always"].stages] == ["stage"] * 4
    steps = [asked[mode].predicted.step_s for mode in ("never", "where-needed", "always")]
    assert steps[0] < steps[1] < steps[2]  # each recomputing stage pays its forward again


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("acts", [(30e9, 1e9, 1e9, 1e9), (30e9, 30e9, 2e9, 2e9), (8e9, 8e9, 8e9, 8e9)])
def test_dp_chooses_where_to_recompute_as_exact_does(schedule, acts):
    """Four nodes of 1 GB of parameters each (the model's weights, 4 x 4 GB, fit no 16 GB V100
    whole) with large activations, on 4 V100s: where the activations of a one-node stage do not
    fit at 8 micro-batches, it recomputes. dp (which weighs each stage both ways) finds the plan
    and step of exact (every split and number of micro-batches, each stage recomputing exactly
    where it would not fit), with `--recompute where-needed` and without; with it the step is
    never longer, and shorter where memory binds. (The planners' simulation cache must key on the
    choice, or a recomputing plan gets the plain plan's estimate and dp drops it.)"""
    from hetplan.planners import PlanOptions

    g = chain(4, fwd=0.03, bwd=0.05, edge_bytes=1e8, batch=8, params=1e9)
    g = replace(g, nodes=tuple(replace(n, act_bytes=a, fwd_s={t: v * (1 + i) for t, v in n.fwd_s.items()})
                               for i, (n, a) in enumerate(zip(g.nodes, acts, strict=True))))
    steps = {}
    for mode in ("never", "where-needed"):
        steps[mode] = exact_step_dp_matches(g, V100X4, PlanOptions(schedule=schedule, recompute=mode),
                                            lambda plan: [s.recomputes for s in plan.stages])
    assert steps["where-needed"] <= steps["never"] * (1 + 1e-9)
    assert (steps["where-needed"] < steps["never"]) == (acts[0] == 30e9)


@pytest.mark.parametrize("devices", [1, 2])
def test_dp_recomputes_per_block_where_only_that_fits_as_exact_does(devices):
    """Eight nodes of 0.4 GB of parameters (1.6 GB held each) and 8 GB of activations per batch of
    4, sending 0.1 GB on, on one or two 16 GB V100s. On one, whole: the weights leave 3.2 GB,
    the whole stage rebuilt (64 GB over at most 4 micro-batches) does not fit, per block (each
    node's input, 0.8 GB over m, and one node's 8 GB over m) fits at 4 micro-batches. dp and
    exact find the same step and units, per block, and no plan at all when only the whole stage
    may be rebuilt; on two the same."""
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.planners import PlanOptions

    cluster = cluster_from_spec({"devices": [{"id": f"v{k}", "type": "v100-16gb"} for k in range(devices)]}, "v")
    g = chain(8 * devices, fwd=0.03, bwd=0.05, edge_bytes=1e8, batch=4, params=0.4e9, acts=8e9)
    units = lambda plan: [s.recompute for s in plan.stages]  # noqa: E731
    step = {}
    for mode in ("stage", "block", "where-needed"):
        step[mode] = exact_step_dp_matches(g, cluster, PlanOptions(recompute=mode), units,
                                           lambda plan: all(s.recompute == "block" for s in plan.stages) or
                                           pytest.fail(f"not per block: {units(plan)}"))
    assert step["stage"] == float("inf") and math.isfinite(step["block"])
    assert step["where-needed"] == pytest.approx(step["block"], rel=1e-9)


def test_dp_recomputes_selectively_where_it_fits_and_is_faster_as_exact_does():
    """The graph of the test above with selective figures: each node keeps 0.5 GB of its products'
    outputs, builds 4 GB again and runs a tenth of its forward again. On one V100 at 4
    micro-batches per block needs 0.2 + 2 GB, selectively 0.2 + 1 + 1 GB: both fit, and the
    selective plan is faster by 0.9 of eight forwards; dp and exact pick it under `where-needed`
    and `selective`, and the plan per block where only that is allowed. Without the figures (an
    importer's graph) no plan recomputes selectively."""
    from dataclasses import replace as with_

    from hetplan.io.clusters import cluster_from_spec
    from hetplan.planners import PlanOptions

    cluster = cluster_from_spec({"devices": [{"id": "v0", "type": "v100-16gb"}]}, "v")
    plain = chain(8, fwd=0.03, bwd=0.05, edge_bytes=1e8, batch=4, params=0.4e9, acts=8e9)
    g = with_(plain, nodes=tuple(with_(n, selective_keep_bytes=int(0.5e9) if n.act_bytes else 0,
                                       selective_rebuilt_bytes=int(4e9) if n.act_bytes else 0,
                                       rerun_forwards={"selective": 0.1}) for n in plain.nodes))
    units = lambda plan: [s.recompute for s in plan.stages]  # noqa: E731
    only = lambda unit: lambda plan: all(s.recompute == unit for s in plan.stages) or pytest.fail(units(plan))  # noqa: E731
    step = {mode: exact_step_dp_matches(g, cluster, PlanOptions(recompute=mode), units, only(unit))
            for mode, unit in (("block", "block"), ("selective", "selective"), ("where-needed", "selective"))}
    assert step["where-needed"] == pytest.approx(step["selective"], rel=1e-9)
    assert step["block"] - step["selective"] == pytest.approx(0.9 * 8 * 0.03, rel=1e-6)
    assert exact_step_dp_matches(plain, cluster, PlanOptions(recompute="where-needed"), units,
                                 only("block")) == pytest.approx(step["block"], rel=1e-9)


def test_the_workers_tensors_are_read_off_the_memory_in_use():
    """`worker._StageMemory`: the most memory in use after the warm-up, above the level before
    the first step, plus the parameters' bytes, less what was held at each step's start beyond
    the optimizer's state (the libraries' own); and malloc's memory in use rises by a tensor's
    bytes while it lives (glibc)."""
    import torch

    from hetplan.pieces.hostmem import malloc_in_use_bytes
    from hetplan.runtime.worker import _StageMemory

    # before the first step; then per step its start and the reading after its optimizer
    readings = iter([1000, 1000, 1500, 1130, 1700, 1130, 1400])
    state = iter([0, 100, 100])  # the optimizer's state: none before its first step
    held = _StageMemory(lambda: next(readings), [torch.zeros(10), torch.zeros(5, dtype=torch.float64)],
                        lambda: next(state))
    for runner_peak in (1900, 1600, 1200):  # the most read after an action, per step
        held.start()
        held.step(runner_peak)
    assert held.library == [0, 30, 30]
    assert held.steps == [1900, 1670, 1370]
    assert held.peak_bytes(warmup=1) == 1670 - 1000 + 10 * 4 + 5 * 8
    assert held.library_bytes(warmup=1) == 30
    if malloc_in_use_bytes() is None:
        pytest.skip("this C library does not say what malloc has handed out")
    before = malloc_in_use_bytes()
    x = torch.ones(2**22)
    assert malloc_in_use_bytes() - before >= x.numel() * 4
    del x


def test_the_plan_table_says_which_stages_recompute_and_at_which_unit():
    from rich.console import Console

    from hetplan.report.tables import show_plan

    console = Console(record=True, width=200)
    plan = recomputing(recomputing(one_per_stage(3, 2), stages=[0]), stages=[1], unit="block")
    plan = replace(plan, stages=(recomputing(one_per_stage(3, 2), stages=[0]).stages[0], *plan.stages[1:]))
    show_plan(console, plan)
    text = console.export_text()
    assert "0 (recompute)" in text and "1 (recompute per block)" in text and "2 (" not in text


def test_the_report_page_names_the_stages_that_recompute():
    from hetplan.report.page import facts_of

    assert ("stages recomputing", "0, 2") in facts_of(recomputing(one_per_stage(3, 2), stages=[0, 2]))
    assert all(name != "stages recomputing" for name, _ in facts_of(one_per_stage(3, 2)))


def test_selective_figures_of_a_small_piece_in_closed_form():
    """Linear(4, 8) -> ReLU -> Linear(8, 4) on 16 rows, fp32: selective recomputation keeps the
    two products' outputs (16 x 8 and 16 x 4 floats), and builds again what autograd saves that
    is not one of them (the input, 16 x 4, and ReLU's output, 16 x 8); the weights count in
    neither."""
    import torch

    from hetplan.pieces.selective import measure

    torch.manual_seed(0)
    piece = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(16, 4, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in piece.parameters()}
    figures = measure(lambda: piece(x.clone()), weights.__contains__)
    assert figures.keep_bytes == 4 * 16 * (8 + 4)
    assert figures.rebuilt_bytes == 4 * 16 * (4 + 8)


class _Shortcut(torch.nn.Module):
    """ResNet's end of a block: the branch's output gets the shortcut added in place (or, `mul`,
    multiplied: an in-place op whose backward keeps its operands, as Mixtral's router counts
    tokens with `scatter_add_`)."""

    def __init__(self, op: str):
        super().__init__()
        self.branch, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU()
        self.op = op

    def forward(self, x, y):
        a = self.branch(x)
        a.add_(x) if self.op == "add" else a.mul_(x)  # on a value another piece made
        return torch.nn.functional.mse_loss(self.head(self.act(a)), y)


@pytest.mark.parametrize("op", ["add", "mul"])
def test_recomputation_is_timed_for_a_piece_that_changes_its_input_in_place(op):
    """The profiler times each piece under a checkpoint (`rerun_forwards`): torch keeps the
    checkpoint's inputs to run the forward again, so a piece that adds to an input in place
    (every ResNet block's shortcut) must be given a copy made inside the checkpoint, as the
    runtime gives it (`checkpointable`), and each timed call its own input, or the calls' graphs
    chain through the changed tensor (`hetplan profile` of resnet50 and of Mixtral with its
    router loss ended in autograd's errors)."""
    from hetplan.pieces.split import changed_in_place
    from hetplan.profile.timing import rerun_forwards

    torch.manual_seed(0)
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 8)}
    split = split_step(_Shortcut(op), batch)
    values = dict(batch)
    with torch.no_grad():
        for piece in split.pieces:
            outs = piece.module(*[values[n] for n in piece.inputs])
            values.update(zip(piece.outputs, outs if isinstance(outs, tuple) else (outs,), strict=True))
    changing = [p for p in split.pieces if changed_in_place(p) - set(split.input_names)]
    assert changing, [p.name for p in split.pieces]
    for piece in changing:
        rerun = rerun_forwards(piece, [values[n] for n in piece.inputs], split.input_names, repeats=1)
        assert set(rerun) == {"block", "selective"} and all(v >= 0 for v in rerun.values())
