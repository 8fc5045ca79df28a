"""The backward split in two actions (inputs' gradients, then weights') gives the gradients of
one backward pass, and the first action leaves the weights' work to the second."""

import pytest
import torch
from torch import nn

from hetplan.runtime.split_backward import backward_inputs, backward_weights


class Twice(nn.Module):
    """A weight used by two layers, an output that is an input passed on, and a side output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.norm = nn.LayerNorm(6)

    def forward(self, x, skip):
        h = torch.relu(self.a(x))
        y = self.norm(self.b(h) + x)
        q, k = y.split(3, dim=-1)
        return q * k.sum(-1, keepdim=True), skip, y


def cases():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.BatchNorm1d(8))
    yield "mlp", mlp, [torch.randn(4, 8)]
    yield "twice", Twice(), [torch.randn(4, 6), torch.randn(4, 6)]
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    yield "encoder", layer, [torch.randn(2, 5, 8)]


def run(model, inputs, split):
    model.zero_grad(set_to_none=True)
    xs = [x.clone().requires_grad_(True) for x in inputs]
    out = model(*xs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
    torch.manual_seed(1)
    grads = [torch.randn_like(o) for o in outs]
    if split:
        left = backward_inputs(outs, grads, xs, list(model.parameters()))
        before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        backward_weights(left)
    else:
        torch.autograd.backward(outs, grads)
        before = None
    return [x.grad for x in xs], {n: p.grad for n, p in model.named_parameters()}, before


@pytest.mark.parametrize("name,model,inputs", list(cases()), ids=[c[0] for c in cases()])
def test_split_backward_equals_one_backward(name, model, inputs):
    ref_x, ref_w, _ = run(model, inputs, split=False)
    got_x, got_w, after_i = run(model, inputs, split=True)
    for a, b in zip(ref_x, got_x, strict=True):
        assert (a is None and b is None) or torch.allclose(a, b, atol=1e-6)
    assert ref_w.keys() == got_w.keys()
    for n in ref_w:
        assert torch.allclose(ref_w[n], got_w[n], atol=1e-6), n
    # I computed no weight gradient of a layer on the way to the inputs: W does
    assert after_i["a.weight" if name == "twice" else "0.weight" if name == "mlp" else "linear1.weight"] is None


def test_without_inputs_that_need_gradients_the_weights_action_does_it_all():
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    out = model(x)
    left = backward_inputs([out.sum()], [torch.ones(())], [x], list(model.parameters()))
    assert model.weight.grad is None
    backward_weights(left)
    assert torch.allclose(model.weight.grad, torch.ones(2, 1) * x.sum(0))


def test_an_output_the_inputs_do_not_reach_is_done_whole_in_the_inputs_action():
    emb = nn.Embedding(5, 3)
    x = torch.randn(2, 3, requires_grad=True)
    pos = emb(torch.arange(2))  # depends on weights only
    out = x * 2
    left = backward_inputs([out, pos], [torch.ones(2, 3), torch.ones(2, 3)], [x], list(emb.parameters()))
    assert emb.weight.grad is not None and torch.allclose(x.grad, torch.full((2, 3), 2.0))
    backward_weights(left)
    assert float(emb.weight.grad.sum()) == pytest.approx(6.0)


def test_the_two_actions_together_do_the_work_of_one_backward():
    """FLOPs of I plus W equal one backward's (torch's FlopCounterMode): nothing runs twice."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))

    def flops(fn):
        counter = FlopCounterMode(display=False)
        with counter:
            fn()
        return counter.get_total_flops()

    x = torch.randn(16, 64, requires_grad=True)
    g = torch.randn(16, 32)
    out = model(x)
    whole = flops(lambda: torch.autograd.backward([out], [g]))
    model.zero_grad(set_to_none=True)
    out = model(x)
    left = {}
    i_flops = flops(lambda: left.setdefault("w", backward_inputs([out], [g], [x], list(model.parameters()))))
    w_flops = flops(lambda: backward_weights(left["w"]))
    assert i_flops + w_flops == whole and 0.3 * whole < i_flops < 0.7 * whole
