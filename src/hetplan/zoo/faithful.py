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
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hetplan.pieces.random_settings import zero_random_settings
from hetplan.rows import StepRows

ROWS = 4  # rows of the batch the checks run on: two halves of two
# the loss's own relative difference: float32 sums in another order differ by ~1e-6 (a router's
# balancing loss over 1-row micro-batches moves Mixtral's by only 2e-6: the gradient check finds it)
REL_TOL = 1e-5
# the gradients of 1-row parts against the whole batch's, largest difference over largest gradient:
# 1e-7 to 4e-6 in float32 for models whose loss is a mean (gpt2, llama, t5, wav2vec2, resnet50 in
# eval), 4e-4 for Mixtral with its router's balancing loss
GRAD_TOL = 3e-5
CHECK_ROWS = 16  # the rows the check runs on at most (the first parts of the run's split)


def _rows(batch: Mapping[str, Any], lo: int, hi: int) -> dict[str, Any]:
    return {k: v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


def _loss(step: nn.Module, batch: Mapping[str, Any], seed: int = 0) -> float:
    torch.manual_seed(seed)
    with torch.no_grad():
        return float(step(**batch))


def not_a_mean(step: nn.Module, batch: Mapping[str, Any],
               parts: Sequence[tuple[int, int]] | None = None) -> tuple[float, float] | None:
    """How far the gradient of the batch's loss is from the sum of its parts' gradients, each
    loss weighted by its rows, in eval mode (no dropout, batch norm from running statistics):
    (the largest difference over the largest gradient, the loss's relative difference) when
    either is above its tolerance; None when they agree. `parts` are the rows (first, end) whose
    losses a run sums (`loss_parts`): a loss that couples the rows it sees (a router's balancing
    loss) moves more the fewer rows a part has, so the check splits as the run does, over its
    first parts up to CHECK_ROWS rows. Default: the first ROWS rows in halves."""
    rows = next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0), 0)
    if parts is None:
        n = min(ROWS, rows)
        parts = [(0, n // 2), (n // 2, n)]
    taken: list[tuple[int, int]] = []
    for lo, hi in parts:
        if hi > lo and (len(taken) < 2 or taken[-1][1] < CHECK_ROWS):
            taken.append((lo, hi))
    n = sum(hi - lo for lo, hi in taken)
    if len(taken) < 2 or n > rows or taken[0][0] != 0 or taken[-1][1] != n:
        return None
    step = copy.deepcopy(step).eval()
    with torch.random.fork_rng():
        whole, g_whole = _loss_and_grad(step, [(0, n)], batch, n)
        summed, g_parts = _loss_and_grad(step, taken, batch, n)
    scale = max(float(g_whole.abs().max()), 1e-30) if g_whole.numel() else 1.0
    grad = float((g_whole - g_parts).abs().max()) / scale if g_whole.numel() else 0.0
    loss = abs(whole - summed) / max(1.0, abs(whole))
    return (grad, loss) if grad > GRAD_TOL or loss > REL_TOL else None


def _loss_and_grad(step: nn.Module, parts: Sequence[tuple[int, int]], batch: Mapping[str, Any],
                   n: int) -> tuple[float, torch.Tensor]:
    """The loss summed over `parts` (each weighted by its rows of `n`) and its gradient, flat."""
    step.zero_grad(set_to_none=True)
    total = 0.0
    for lo, hi in parts:
        torch.manual_seed(0)
        loss = step(**_rows(batch, lo, hi)) * ((hi - lo) / n)
        loss.backward()
        total += float(loss.detach())
    grads = [(p.grad.to_dense() if p.grad.is_sparse else p.grad).flatten()  # an embedding's rows (ctr-dnn)
             for p in step.parameters() if p.grad is not None]
    return total, torch.cat(grads) if grads else torch.zeros(0)


def loss_parts(rows: StepRows) -> list[tuple[int, int]]:
    """The rows (first, end) of each loss a run sums: every micro-batch's slices of the last stage."""
    return [(start + lo, start + hi) for start, slices in zip(rows.start, rows.slices[-1], strict=True)
            for lo, hi in slices if hi > lo]


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
    """`hetplan run --no-dropout`: no dropout however the model draws it, in the workers and in the
    checks: every dropout module at p=0, and every probability a module or its configuration keeps
    under a dropout name (functional dropout, LayerDrop, SpecAugment: `hetplan.pieces.random_settings`)
    at 0."""
    for mod in dropouts(step):
        mod.p = 0.0
    zero_random_settings(step)


def batch_norms(step: nn.Module) -> list[str]:
    return [name for name, m in step.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def pipeline_warnings(step: nn.Module, batch: Mapping[str, Any], parts: Sequence[tuple[int, int]] | None) -> list[str]:
    """One line for each reason the run's step differs from one process training on the whole
    batch (`parts`: the rows of each loss the run sums, `loss_parts`; None or one part when the
    plan does not split the batch)."""
    out = []
    if parts is not None and len(parts) > 1:
        differ = not_a_mean(step, batch, parts)
        if differ is not None:
            grad, loss = differ
            out.append(f"the loss is not a mean over samples: its gradient summed over the run's micro-batch shares "
                       f"differs from the whole batch's by {grad:.1e} of its largest value ({loss:.1g} relative in "
                       "the loss), so the pipelined step differs from one process's by as much (an auxiliary loss "
                       "over the rows it sees, such as a router's load balancing, or a sum); fewer, larger "
                       "micro-batches stay closer")
        norms = batch_norms(step)
        if norms:
            out.append(f"batch norm ({norms[0]}{' and others' if len(norms) > 1 else ''}) normalises each micro-batch "
                       "on its own statistics, not the whole batch's: fewer, larger micro-batches stay closer")
    if draws_random(step, batch):
        out.append("the model draws random numbers in training (dropout): each worker draws its own, so losses and "
                   "weights differ from one process's; `hetplan run --no-dropout` turns dropout off to compare")
    return out
