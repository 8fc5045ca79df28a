"""Synthetic training data keeps the example batch's structure and can be learnt: drawing masks
and labels at random every step would leave no loss that can fall."""

import pytest
import torch
from torch import nn

from hetplan.runtime.data import synthetic_batch
from hetplan.zoo import load_model


def test_masks_and_repeated_rows_stay_as_in_the_example():
    ids = torch.randint(0, 100, (4, 8))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
               "position_ids": torch.arange(8).expand(4, 8), "labels": ids.clone()}
    for step in range(3):
        batch = synthetic_batch(example, step)
        for key in ("attention_mask", "token_type_ids", "position_ids"):
            assert torch.equal(batch[key], example[key])
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {k: (v.shape, v.dtype) for k, v in example.items()}
        assert torch.equal(batch["labels"], batch["input_ids"])  # a language model's labels are its ids


def test_tokens_follow_one_hidden_bigram_rule_across_steps_and_the_seed_changes_it():
    example = {"input_ids": torch.randint(0, 1000, (8, 32)), "labels": torch.zeros(8, 32, dtype=torch.long)}
    successor = {}
    for step in range(4):
        ids = synthetic_batch(example, step, seed=1)["input_ids"]
        assert int(ids.max()) < 256 and not torch.equal(ids, synthetic_batch(example, step + 1, seed=1)["input_ids"])
        for a, b in zip(ids[:, :-1].flatten().tolist(), ids[:, 1:].flatten().tolist(), strict=True):
            assert successor.setdefault(a, b) == b  # every id has one successor, at every step
    other = synthetic_batch(example, 0, seed=2)["input_ids"]
    assert any(successor.get(a, b) != b for a, b in zip(other[:, :-1].flatten().tolist(),
                                                        other[:, 1:].flatten().tolist(), strict=True))


def test_classes_are_a_function_of_the_input():
    """Float inputs are noisy prototypes of their class: the nearest prototype (estimated from
    other steps) gives back the label."""
    example = {"x": torch.randn(64, 20), "labels": torch.randint(0, 10, (64,))}
    train = [synthetic_batch(example, s) for s in range(5)]
    x, y = torch.cat([b["x"] for b in train]), torch.cat([b["labels"] for b in train])
    centres = torch.stack([x[y == c].mean(0) for c in range(10)])
    test = synthetic_batch(example, 99)
    guess = torch.cdist(test["x"], centres).argmin(1)
    assert (guess == test["labels"]).float().mean() > 0.9


@pytest.mark.parametrize("name", ["gpt2-tiny", "mlp", "hf_families:convnext", "hf_families:t5"])
def test_the_loss_falls_on_synthetic_data(name):
    zm = load_model(name, batch_size=8, seq_len=16, seed=0)
    for mod in zm.step.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    opt = torch.optim.Adam(zm.step.parameters(), lr=1e-3)  # `hetplan run`'s defaults
    losses = []
    for step in range(20):
        opt.zero_grad()
        loss = zm.step(**synthetic_batch(zm.batch, step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-4:]) / 4 < 0.85 * sum(losses[:4]) / 4, losses


def test_text_fits_a_vocabulary_smaller_than_a_byte():
    """The corpus has a few UTF-8 bytes above 127: a 128-token model (the DistilBERT and T5 of
    tests/hf_families.py) would get ids past its table at the steps that draw them."""
    from hetplan.runtime.data import corpus, input_vocab, text_batch

    example = {"input_ids": torch.zeros(2, 64, dtype=torch.long), "labels": torch.zeros(2, 64, dtype=torch.long)}
    model = load_model("hf_families:distilbert", batch_size=2, seq_len=64)
    assert input_vocab(model.step) == 128
    assert int(corpus().max()) >= 128
    step = next(s for s in range(20_000) if text_batch(example, s)["input_ids"].max() >= 128)
    assert text_batch(example, step)["input_ids"].max() >= 128  # what the model's embedding could not take
    ids = text_batch(example, step, vocab=128)["input_ids"]
    assert ids.max() < 128
    model.step(**{**model.batch, "input_ids": ids, "labels": ids})  # no index error
