"""What a pipelined step can and cannot equal, said before the run (`hetplan.zoo.faithful`), and
the losses hetplan writes again so that a step traces (`hetplan.zoo.losses`)."""

import copy
import os

import pytest
import torch

from hetplan.rows import step_rows
from hetplan.zoo.faithful import draws_random, loss_parts, not_a_mean, switch_off_dropout
from hetplan.zoo.losses import ctc_loss, is_ctc

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hf = pytest.importorskip("hf_families")


def _grads(model, batch, loss):
    model.zero_grad(set_to_none=True)
    value = loss(model, batch)
    value.backward()
    return float(value.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_traceable_ctc_loss_is_transformers_own_value_and_gradient():
    """Padded labels of several lengths (-100 after a transcript's end), in training mode."""
    model, batch = hf.wav2vec2(batch_size=4)
    switch_off_dropout(model)
    assert is_ctc(model, batch) and (batch["labels"] < 0).any()
    ours, g_ours = _grads(model, batch, ctc_loss)
    theirs, g_theirs = _grads(model, batch, lambda m, b: m(**b).loss)
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert g_ours.keys() == g_theirs.keys()
    for name, g in g_ours.items():
        torch.testing.assert_close(g, g_theirs[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("family,zeros", [
    ("opt", {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "layerdrop": 0.0}),
    ("wav2vec2", {"hidden_dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "feat_proj_dropout": 0.0,
                  "final_dropout": 0.0}),
])
def test_no_dropout_trains_as_the_model_built_without_dropout(family, zeros, monkeypatch):
    """OPT and wav2vec2 keep dropout as plain probabilities, used functionally: switching off
    only the dropout modules left them drawing (OPT differed from its dropout-free self by 1e-3)."""
    import transformers

    built = getattr(hf, family)
    config_class = {"opt": transformers.OPTConfig, "wav2vec2": transformers.Wav2Vec2Config}[family]
    real_init = config_class.__init__

    def without_dropout(self, *args, **kwargs):
        real_init(self, *args, **{**kwargs, **zeros})

    model, batch = built()
    assert draws_random(_Step(model), batch)
    switch_off_dropout(model)
    assert not draws_random(_Step(model), batch)
    monkeypatch.setattr(config_class, "__init__", without_dropout)
    plain, _ = built()
    model.train(), plain.train()
    loss, grads = _grads(model, batch, lambda m, b: _Step(m)(**b))
    plain_loss, plain_grads = _grads(plain, batch, lambda m, b: _Step(m)(**b))
    assert loss == plain_loss
    assert all(torch.equal(g, plain_grads[n]) for n, g in grads.items())


class _Step(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return ctc_loss(self.model, batch) if is_ctc(self.model, batch) else self.model(**batch).loss


def test_a_router_loss_is_found_at_the_runs_own_split_and_a_mean_is_not():
    """Mixtral's balancing loss couples the tokens a micro-batch holds: its gradient over 1-row
    micro-batches is 3e-4 (of the largest) from the whole batch's, where a loss that is a mean
    stays at float32's 1e-7; checking at 4 rows in halves, by the loss alone, missed it."""
    router, batch = hf.mixtral_router(batch_size=4)
    plain, _ = hf.mixtral(batch_size=4)
    one_row = loss_parts(step_rows(4, 4, [[1.0], [1.0]]))
    assert one_row == [(0, 1), (1, 2), (2, 3), (3, 4)]
    found = not_a_mean(_Step(router), batch, one_row)
    assert found is not None and found[0] > 1e-4
    assert not_a_mean(_Step(plain), batch, one_row) is None
    assert not_a_mean(_Step(copy.deepcopy(router)), batch, [(0, 4)]) is None  # one part: nothing to differ


def test_loss_parts_are_the_last_stages_slices_of_each_microbatch():
    rows = step_rows(7, 2, [[1.0], [2.0, 1.0]])  # micro-batches of 4 and 3, the last stage in two replicas
    assert loss_parts(rows) == [(0, 3), (3, 4), (4, 6), (6, 7)]


def test_a_model_with_sparse_gradients_is_checked_too():
    """ctr-dnn's embedding tables take sparse gradients, which have no flat view: the check of
    the loss compares them dense (flattening them raised, and the run was refused as a model that
    does not run on its batch)."""
    from hetplan.zoo import load_model
    from hetplan.zoo.faithful import pipeline_warnings

    zm = load_model("ctr-dnn", batch_size=8, seed=0)
    assert pipeline_warnings(zm.step, zm.batch, loss_parts(step_rows(8, 2, [[1.0], [1.0]]))) == []
