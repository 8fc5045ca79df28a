"""What a tensor-parallel group splits of a piece's saved activations (`hetplan.pieces.split_acts`):
exact on a small pair of projections, and what the profiler records on a transformer's blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetplan.pieces.split_acts import Shares, measure
from hetplan.pieces.tensor_split import COLUMN_KIND, ROW_KIND


def test_a_pair_of_projections_splits_what_lies_between_them():
    """x [4, 8] -> Linear(8, 16) split by columns -> GELU -> Linear(16, 8) split by rows ->
    LayerNorm(8). Autograd saves x for the first product (128 B: all-gathered, whole even under
    sequence parallelism), the first product's output for GELU and GELU's for the second
    product (256 B each: split), and the norm's input (128 B) and its mean and inverse deviation
    (16 B each: split along the tokens under sequence parallelism)."""
    torch.manual_seed(0)
    up, down, norm = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)
    kinds = {up.weight.untyped_storage().data_ptr(): COLUMN_KIND, up.bias.untyped_storage().data_ptr(): COLUMN_KIND,
             down.weight.untyped_storage().data_ptr(): ROW_KIND, down.bias.untyped_storage().data_ptr(): "",
             norm.weight.untyped_storage().data_ptr(): "", norm.bias.untyped_storage().data_ptr(): ""}
    x = torch.randn(4, 8, requires_grad=True)
    shares = measure(lambda: norm(down(nn.functional.gelu(up(x)))), kinds)
    assert shares.split_share == pytest.approx(512 / 800)
    assert shares.sequence_share == pytest.approx(160 / 800)
    # without the split weights nothing is split, and everything but nothing gathered is along the tokens
    plain = measure(lambda: norm(down(nn.functional.gelu(up(x)))), dict.fromkeys(kinds, ""))
    assert plain.split_share == 0.0 and plain.sequence_share == pytest.approx(1.0)


def test_a_share_cut_into_parts_is_gathered_whole():
    """GPT-2's joined q, k and v: the column-split product's output cut in two along its split
    features (DTensor gathers it first): what is made from the parts is whole on every device
    (tanh's output, 128 B; the product's output the parts view, 256 B), and so is the product's
    input (128 B). Without the cut the same work keeps shares."""
    torch.manual_seed(0)
    up = nn.Linear(8, 16)
    kinds = {up.weight.untyped_storage().data_ptr(): COLUMN_KIND, up.bias.untyped_storage().data_ptr(): COLUMN_KIND}
    x = torch.randn(4, 8, requires_grad=True)

    def cut():
        a, b = up(x).split(8, dim=-1)
        return a.tanh() * b

    def uncut():
        y = up(x)
        return y.tanh() * y

    assert measure(cut, kinds) == Shares(0.0, 0.0)
    kept = measure(uncut, kinds)  # x (128 B) whole; y (256 B) and tanh's output (256 B) shares
    assert kept.split_share == pytest.approx(512 / 640) and kept.sequence_share == 0.0


def test_a_vocabulary_parallel_loss_splits_the_log_probabilities():
    """x [4, 8] -> a head Linear(8, 16) split by columns (its words) -> cross-entropy with 4
    targets. Autograd saves x (128 B: all-gathered, whole), the log-probabilities (256 B: each
    device its words' under a vocabulary-parallel loss), the targets (32 B: int64, given whole to
    every device, also under sequence parallelism) and the loss's count of targets (4 B)."""
    torch.manual_seed(0)
    head = nn.Linear(8, 16, bias=False)
    kinds = {head.weight.untyped_storage().data_ptr(): COLUMN_KIND}
    x, y = torch.randn(4, 8, requires_grad=True), torch.tensor([1, 5, 9, 15])
    shares = measure(lambda: nn.functional.cross_entropy(head(x), y), kinds)
    assert shares.split_share == pytest.approx(260 / 420) and shares.sequence_share == 0.0


def test_only_a_plain_cross_entropy_on_a_column_split_head_is_vocabulary_parallel():
    """`class_split_loss` reads a piece's graph: the head's logits, cast and reshaped, into an
    unweighted cross-entropy are; a head kept whole, a smoothed loss, or log-probabilities read
    by anything else are not."""
    from torch import fx

    from hetplan.pieces.tensor_split import class_split_loss

    def graph(loss):
        g = fx.Graph()
        root = nn.Module()
        root.w = nn.Parameter(torch.zeros(16, 8))
        x, y, w = g.placeholder("x"), g.placeholder("y"), g.get_attr("w")
        logits = g.call_function(torch.ops.aten.linear.default, (x, w))
        flat = g.call_function(torch.ops.aten.reshape.default,
                               (g.call_function(torch.ops.aten.to.dtype, (logits, torch.float32)), [-1, 16]))
        g.output(loss(g, flat, y))
        return fx.GraphModule(root, g), root.w

    def plain(g, flat, y):
        return g.call_function(torch.ops.aten.cross_entropy_loss.default, (flat, y, None, 1, -100, 0.0))

    def smoothed(g, flat, y):
        return g.call_function(torch.ops.aten.cross_entropy_loss.default, (flat, y, None, 1, -100, 0.1))

    def by_hand(g, flat, y):
        logp = g.call_function(torch.ops.aten.log_softmax.int, (flat, 1))
        return g.call_function(torch.ops.aten.nll_loss_nd.default, (logp, y))

    gm, w = graph(plain)
    assert class_split_loss(gm, {id(w): COLUMN_KIND})
    assert not class_split_loss(gm, {id(w): ""})
    for other in (smoothed, by_hand):
        gm, w = graph(other)
        assert not class_split_loss(gm, {id(w): COLUMN_KIND}), other.__name__


def test_the_profiler_records_the_shares_of_each_block():
    """llama-tiny by blocks: each block splits most of what it keeps under tensor parallelism
    and, under sequence parallelism, all but the inputs of its column-split products; the
    vocabulary's head, its loss vocabulary-parallel, splits its log-probabilities (256 words of 4
    bytes a token; its input, 4 bytes a feature, and the targets, 8 bytes a token, whole); the
    norms are left counted whole."""
    from hetplan.profile import profile_step
    from hetplan.zoo import load_model

    zm = load_model("llama-tiny", batch_size=4, seq_len=32, seed=0)
    graph = profile_step(zm.step, zm.batch, name="llama-tiny", devices=("cpu:1",), repeats=1, granularity="block",
                         block_classes=zm.block_classes).graph
    blocks = [n for n in graph.nodes if n.id.startswith("model.layers.")]
    assert len(blocks) == 4
    for n in blocks:
        assert 0.5 < n.act_split_share < 0.9 and 0.05 < n.act_sequence_share < 0.3
        assert n.act_split_share + n.act_sequence_share < 1.0
    head = graph.by_id["lm_head"]
    tokens, width = 4 * 32, zm.step.model.config.hidden_size
    split = tokens * 256 * 4 + 4  # and the loss's count of targets
    assert head.act_split_share == pytest.approx(split / (split + tokens * (width * 4 + 8)))
    assert head.act_sequence_share == 0.0
    assert graph.by_id["model.norm"].act_split_share == 0.0 and graph.by_id["model.norm"].act_sequence_share == 0.0
