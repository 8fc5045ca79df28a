"""One trace for the ranks of one process (`split.rebind`, `traces.SharedTraces`): another instance of
the same model takes copies of the pieces holding its own weights, which compute what its own
trace computes; another model is refused."""

import operator

import pytest
import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.pieces.split import SplitStep, holdings, rebind, split_step
from hetplan.pieces.tracing import export_step
from hetplan.runtime.traces import SharedTraces
from hetplan.zoo import load_model


def _loss_and_grads(split, step, batch):
    for p in step.parameters():
        p.grad = None
    torch.manual_seed(0)  # the same dropout masks for both
    loss, _ = split.run(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in step.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name,granularity", [("gpt2-tiny", "layer"), ("inception-tiny", "block")])
def test_a_rebound_trace_trains_the_other_models_weights_as_its_own_trace_does(name, granularity):
    a, b = (load_model(name, batch_size=4, seq_len=16, seed=0) for _ in range(2))
    classes = tuple(a.block_classes or ()) or None
    traced = split_step(a.step, a.batch, granularity, classes)
    with torch.no_grad():  # b's weights made unlike a's: a piece still holding a's would show
        for p in b.step.parameters():
            p.add_(0.01 * torch.randn_like(p))
    mine = rebind(traced, holdings(a.step), b.step)
    assert [p.name for p in mine.pieces] == [p.name for p in traced.pieces]
    ids_a, ids_b = {id(p) for p in a.step.parameters()}, {id(p) for p in b.step.parameters()}
    held = [id(p) for piece in mine.pieces for p in piece.module.parameters()]
    assert held and set(held) <= ids_b and not set(held) & ids_a
    loss, grads = _loss_and_grads(mine, b.step, b.batch)
    ref_loss, ref_grads = _loss_and_grads(split_step(b.step, b.batch, granularity, classes), b.step, b.batch)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    assert all(torch.allclose(grads[n], ref_grads[n], atol=1e-6) for n in grads)


def test_shared_traces_trace_once_and_keep_the_first_trace_as_it_was_made(monkeypatch):
    calls = []
    real = split_step

    def counting(*args, **kwargs):
        calls.append(args[1]["input_ids"].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr("hetplan.runtime.traces.split_step", counting)
    shared = SharedTraces()
    models = [load_model("gpt2-tiny", batch_size=4, seq_len=16, seed=0) for _ in range(3)]
    first = shared.split(models[0].step, models[0].batch, "layer", None)
    graph = first.pieces[0].module.graph
    made = len(graph.nodes)
    with graph.inserting_before(next(n for n in graph.nodes if n.op == "output")):
        graph.call_function(operator.add, (1, 1))  # a rank rewriting its copy (tensor parallelism does)
    for zm in models[1:]:
        assert len(shared.split(zm.step, zm.batch, "layer", None).pieces[0].module.graph.nodes) == made
    shared.split(models[2].step, {k: v[:2] for k, v in models[2].batch.items()}, "layer", None)
    assert calls == [4, 2]  # one trace per row count, not one per rank


def test_shared_traces_cut_every_granularity_from_one_export_of_a_batchs_shapes(monkeypatch):
    """The export does not depend on the granularity: a second cut of the same shapes is made from
    the first's export, by another instance of the model too, and has the pieces, the weights
    (its own model's) and the loss and gradients that a cut of its own trace has."""
    calls = []
    real = export_step
    monkeypatch.setattr("hetplan.runtime.traces.export_step", lambda step, batch: calls.append(1) or real(step, batch))
    a, b = (load_model("gpt2-tiny", batch_size=4, seq_len=16, seed=0) for _ in range(2))
    shared = SharedTraces()
    layer = shared.split(a.step, a.batch, "layer", None)
    block = shared.split(b.step, b.batch, "block", tuple(b.block_classes))
    assert calls == [1]
    own = split_step(b.step, b.batch, "block", tuple(b.block_classes))
    assert [p.name for p in block.pieces] == [p.name for p in own.pieces] != [p.name for p in layer.pieces]
    held = {id(p) for piece in block.pieces for p in piece.module.parameters()}
    assert held and held <= {id(p) for p in b.step.parameters()}
    loss, grads = _loss_and_grads(block, b.step, b.batch)
    ref_loss, ref_grads = _loss_and_grads(own, b.step, b.batch)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert grads.keys() == ref_grads.keys() and all(torch.allclose(grads[n], ref_grads[n], atol=1e-6) for n in grads)


def test_shared_traces_try_to_export_a_model_once_for_every_granularity(monkeypatch):
    """A model torch.export refuses (data-dependent Python) is tried once for its batch's shapes;
    each block cut of it is then traced by torch.fx with its blocks opaque, without a second try."""
    calls = []
    real = export_step

    def counting(step, batch):
        calls.append(1)
        return real(step, batch)

    monkeypatch.setattr("hetplan.runtime.traces.export_step", counting)
    monkeypatch.setattr("hetplan.pieces.tracing.export_step", counting)
    zm = load_model("user_models:untraceable", batch_size=2, seq_len=16, seed=0)
    shared = SharedTraces()
    with pytest.raises(HetplanError, match="cannot trace the model"):
        shared.split(zm.step, zm.batch, "layer", None)
    for blocks in (("Gate",), ("Gate", "Linear")):
        assert shared.split(zm.step, zm.batch, "block", blocks).pieces
    assert calls == [1]


def test_the_pieces_of_another_model_are_refused():
    a = load_model("gpt2-tiny", batch_size=4, seq_len=16, seed=0)
    other = load_model("mlp", batch_size=4, seq_len=16, seed=0)
    with pytest.raises(HetplanError, match="hold different parameters"):
        rebind(split_step(a.step, a.batch), holdings(a.step), other.step)
    nothing = SplitStep((), (), (), "loss")
    for unlike in (nn.Linear(4, 5), nn.Linear(4, 4).double(), nn.Conv1d(4, 4, 1)):  # same names, other weights
        with pytest.raises(HetplanError, match="hold different parameters"):
            rebind(nothing, holdings(nn.Linear(4, 4)), unlike)


@pytest.mark.skipif(not hasattr(torch.fx.config, "do_not_emit_stack_traces"), reason="torch without the switch")
def test_a_trace_records_no_python_stacks_and_leaves_torchs_switch_as_it_was():
    """Recording every node's Python stack is a fifth of an export's time, and nothing reads it."""
    from hetplan.pieces.tracing import export_step

    zm = load_model("mlp", batch_size=4, seed=0)
    graph = export_step(zm.step, zm.batch)
    assert not [n for n in graph.graph.nodes if n.meta.get("stack_trace")]
    assert torch.fx.config.do_not_emit_stack_traces is False


def test_ranks_sharing_traces_read_the_boundaries_layouts_once_and_trace_only_what_they_run():
    """gpt2-tiny as 2 stages, micro-batches of 2 rows: the layouts are read at 2 and 3 rows by the
    first rank; the second takes them and traces 2 rows only, and both hold the same layouts."""
    from hetplan.runtime.launch import run_spec
    from hetplan.runtime.settings import RunSettings
    from hetplan.runtime.worker import build_rank
    from test_executor import chain_plan, cpus

    zm = load_model("gpt2-tiny", batch_size=8, seq_len=16, seed=0)
    shared = SharedTraces()
    names = [p.name for p in shared.split(zm.step, {k: v[:2] for k, v in zm.batch.items()}, "layer", None).pieces]
    spec = run_spec(chain_plan(names, [1, 1], 4, "1f1b"), cpus(2), "gpt2-tiny",
                    RunSettings(batch_size=8, seq_len=16, granularity="layer", steps=1, warmup=0))
    first, second = (build_rank(spec, rank, shared=shared)[1] for rank in range(2))
    assert sorted(first.traces.by_rows) == [2, 3] and sorted(second.traces.by_rows) == [2]
    assert first.layouts[0][1] == second.layouts[0][0] and first.layouts[0][1]  # boundary 0, read by both
