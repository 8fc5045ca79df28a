"""Losses that transformers computes in ways a trace cannot follow, written again so that it can.

A model's step is traced into pieces (`hetplan.pieces.split`); a loss whose code branches on the
values of the labels, or makes tensors whose size depends on them, cannot be traced
(`torch.export` refuses a guard on data it has not seen). Each function here computes the same
number as the model's own loss from tensors of fixed shapes; `tests/test_zoo.py` checks each
against the model's own on the same batch.

- CTC (`Wav2Vec2ForCTC`, `HubertForCTC`, ...; Graves et al. 2006): transformers picks the labels
  out of their padding (`masked_select`, a size known only from the data) before
  `nn.functional.ctc_loss`; that function takes the padded labels and their lengths just as well.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn


def is_ctc(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> bool:
    """A transformers model with a CTC head (its configuration says how CTC reduces), given labels."""
    config = getattr(model, "config", None)
    return hasattr(config, "ctc_loss_reduction") and "labels" in batch and hasattr(model, "lm_head")


def ctc_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The model's CTC loss as its forward computes it with `labels` (padding: negative), from its
    logits: per sample, the frames its attention mask keeps through the feature encoder."""
    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    mask = batch.get("attention_mask")
    if mask is not None:
        frames = model._get_feat_extract_output_lengths(mask.sum(-1)).to(torch.long)
    else:
        frames = torch.full((logits.shape[0],), logits.shape[1], dtype=torch.long, device=logits.device)
    config = model.config
    log_probs = nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    return torch.ops.hetplan.ctc_loss(log_probs, labels.clamp(min=0), frames, (labels >= 0).sum(-1),
                                      config.pad_token_id, config.ctc_loss_reduction, config.ctc_zero_infinity)


# One op to a trace: inside, CTC's tables are as long as the longest transcript, a size known only
# from the labels' values, which torch.export cannot follow (`aten._ctc_loss` has no shape rule for
# them); outside, its result is a number per batch (or per sample with reduction "none").
@torch.library.custom_op("hetplan::ctc_loss", mutates_args=())
def _ctc_op(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
            target_lengths: torch.Tensor, blank: int, reduction: str, zero_infinity: bool) -> torch.Tensor:
    return nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=blank,
                                  reduction=reduction, zero_infinity=zero_infinity).clone()


@_ctc_op.register_fake
def _ctc_shape(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
    return log_probs.new_empty((log_probs.shape[1],) if reduction == "none" else ())


def _ctc_keep(ctx, inputs, output) -> None:
    log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths)
    ctx.settings = (blank, reduction, zero_infinity)


def _ctc_backward(ctx, grad: torch.Tensor):
    """torch's own CTC gradient, from the forward run again (the op keeps only its inputs)."""
    log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
    blank, reduction, zero_infinity = ctx.settings
    with torch.enable_grad():
        again = log_probs.detach().requires_grad_()
        loss = nn.functional.ctc_loss(again, targets, input_lengths, target_lengths, blank=blank,
                                      reduction=reduction, zero_infinity=zero_infinity)
        (out,) = torch.autograd.grad(loss, again, grad)
    return out, None, None, None, None, None, None


_ctc_op.register_autograd(_ctc_backward, setup_context=_ctc_keep)


def traceable_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> Callable | None:
    """The loss function to use in place of the model's own, or None where its own traces."""
    return ctc_loss if is_ctc(model, batch) else None
