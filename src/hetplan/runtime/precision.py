"""fp16's loss scaling across a pipeline's workers.

fp16 represents nothing below 6e-8, where small gradients fall: the loss is multiplied by a large
scale before the backward (the last stage does it), every gradient comes out that much larger,
and each worker divides its gradients by the scale before its optimizer step (Micikevicius et al.,
"Mixed Precision Training", ICLR 2018). The scale is dynamic, as torch.amp.GradScaler keeps it:
2**16 to start, halved and the step skipped when a gradient is inf or nan, doubled after
`GROWTH_INTERVAL` steps without. GradScaler decides for one process; here every worker holds
only its stages' gradients, so each says whether it found one, the verdicts are summed over all
workers (one all-reduce of a number), and all skip or step together with the same next scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
BACKOFF, GROWTH = 0.5, 2.0


class LossScaler:
    """The scale of one run, the same on every worker."""

    def __init__(self, scale: float = INITIAL_SCALE, growth_interval: int = GROWTH_INTERVAL) -> None:
        self.scale, self.growth_interval = scale, growth_interval
        self.good_steps = 0
        self.skipped = 0

    def unscale(self, params: Sequence[torch.Tensor]) -> bool:
        """Divide the gradients by the scale, in place; whether one of them is inf or nan."""
        found = False
        for p in params:
            if p.grad is None:
                continue
            grad = p.grad.coalesce().values() if p.grad.is_sparse else p.grad
            found = found or not bool(torch.isfinite(grad).all())
            p.grad.mul_(1.0 / self.scale)
        return found

    def update(self, anyone_found: bool) -> bool:
        """The next scale, from whether any worker found an inf or nan; whether to step."""
        if anyone_found:
            self.scale *= BACKOFF
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= GROWTH
            self.good_steps = 0
        return True


def agreed_step(scaler: LossScaler, params: Sequence[torch.Tensor],
                sum_over_workers: Callable[[torch.Tensor], None]) -> bool:
    """Unscale this worker's gradients, sum every worker's verdict (`sum_over_workers` sums a
    tensor in place over all of them) and update the scale; whether the optimizer steps."""
    verdict = torch.tensor([1.0 if scaler.unscale(params) else 0.0])
    sum_over_workers(verdict)
    return scaler.update(bool(verdict.item() > 0))
