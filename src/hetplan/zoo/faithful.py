"""Whether a pipelined step of a model can equal its whole-batch step, and what to tell the user.

The runtime cuts the batch into micro-batches (and replicas' slices), takes each one's loss with
the weight of its rows and sums the gradients (GPipe, Huang et al. 2019, section 2.2). That is the
whole batch's gradient exactly when the loss is the mean over samples of a per-sample loss, and
when nothing else couples the samples of a batch or draws random numbers:

- a loss that is not such a mean (a mixture of experts' load-balancing loss, which is computed
  over the tokens of the batch it sees; a sum instead of a mean) gives another gradient;
- batch normalisation normalises each micro-batch by its own statistics (GPipe says so too);
- dropout draws its masks in each worker, so the losses and weights differ from one process's.

Each is found by running the model, on the CPU and a few rows of the batch, not by its name.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

ROWS = 4  # rows of the batch the checks run on: two halves of two
REL_TOL = 1e-4  # float32 sums in another order differ by ~1e-6 relative; a real difference is far larger


def _rows(batch: Mapping[str, Any], lo: int, hi: int) -> dict[str, Any]:
    return {k: v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


def _loss(step: nn.Module, batch: Mapping[str, Any], seed: int = 0) -> float:
    torch.manual_seed(seed)
    with torch.no_grad():
        return float(step(**batch))


def not_a_mean(step: nn.Module, batch: Mapping[str, Any]) -> tuple[float, float] | None:
    """The loss of the first ROWS rows and the mean of its two halves' losses, in eval mode (no
    dropout, batch norm from running statistics), when they differ; None when they agree."""
    step = copy.deepcopy(step).eval()
    rows = next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0)
    n = min(ROWS, rows)
    if n < 2:
        return None
    with torch.random.fork_rng():
        whole, half = _loss(step, _rows(batch, 0, n)), n // 2
        mean = (half * _loss(step, _rows(batch, 0, half)) + (n - half) * _loss(step, _rows(batch, half, n))) / n
    return (whole, mean) if abs(whole - mean) > REL_TOL * max(1.0, abs(whole)) else None


def draws_random(step: nn.Module, batch: Mapping[str, Any]) -> bool:
    """Whether two training-mode forwards of the same rows with other seeds give other losses."""
    step = copy.deepcopy(step).train()
    part = _rows(batch, 0, ROWS)
    with torch.random.fork_rng():
        return abs(_loss(step, part, seed=1) - _loss(step, part, seed=2)) > 1e-7


def dropouts(step: nn.Module) -> list[nn.Module]:
    """Every dropout module (`nn.Dropout`, `Dropout1d/2d/3d`, `AlphaDropout`...)."""
    return [m for m in step.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]


def switch_off_dropout(step: nn.Module) -> None:
    """`hetplan run --no-dropout`: every dropout layer at p=0, in the workers and in the checks."""
    for mod in dropouts(step):
        mod.p = 0.0


def batch_norms(step: nn.Module) -> list[str]:
    return [name for name, m in step.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def pipeline_warnings(step: nn.Module, batch: Mapping[str, Any], splits_batch: bool) -> list[str]:
    """One line for each reason the run's step differs from one process training on the whole
    batch (`splits_batch`: the plan has more than one micro-batch or replica)."""
    out = []
    if splits_batch:
        differ = not_a_mean(step, batch)
        if differ is not None:
            out.append(f"the loss is not a mean over samples (over {ROWS} rows {differ[0]:.6g}, the mean of its "
                       f"halves' {differ[1]:.6g}): the pipelined step, a sum over micro-batches, differs from the "
                       "whole batch's (an auxiliary loss over the batch, a sum); make the loss a mean over samples "
                       "to train the same")
        norms = batch_norms(step)
        if norms:
            out.append(f"batch norm ({norms[0]}{' and others' if len(norms) > 1 else ''}) normalises each micro-batch "
                       "on its own statistics, not the whole batch's: fewer, larger micro-batches stay closer")
    if draws_random(step, batch):
        out.append("the model draws random numbers in training (dropout): each worker draws its own, so losses and "
                   "weights differ from one process's; `hetplan run --no-dropout` turns dropout off to compare")
    return out
