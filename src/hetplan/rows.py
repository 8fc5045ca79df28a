"""How a training step's samples are split: into micro-batches, and among a stage's replicas.

One owner for the split, read by the cost model and the simulator (which charge each replica for
its rows) and by the runtime (which gives each replica exactly those rows), so that a prediction
and a run split the batch the same way, to the sample.

- Micro-batches split the batch as `torch.tensor_split` does: sizes differ by at most one, the
  larger ones first.
- Replicas of a stage split every micro-batch in proportion to their weights (their speed on the
  stage), by the largest-remainder method (Hamilton's apportionment): each gets the floor of its
  exact share, and the rows left over go to the largest remainders; ties go to the lower index,
  counting from j for micro-batch j, so that equal replicas take turns with the odd rows.
  Replica p takes a contiguous slice of the micro-batch, after the slices of replicas 0..p-1.
- A replica can get no row of a small micro-batch; it then does nothing for it (no compute, no
  message), in the simulator as in the runtime.
- Between neighbouring stages, replica p of stage k sends to replica q of stage k + 1 the rows
  their slices share (`shared_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetplan.errors import HetplanError


def microbatch_rows(batch_size: int, microbatches: int) -> tuple[int, ...]:
    """Rows of each micro-batch, as `torch.tensor_split(batch, microbatches)` makes them."""
    if batch_size < 1 or microbatches < 1:
        raise HetplanError(f"cannot split a batch of {batch_size} into {microbatches} micro-batches: "
                           "both must be at least 1")
    base, extra = divmod(batch_size, microbatches)
    return tuple(base + (1 if i < extra else 0) for i in range(microbatches))


def split_rows(rows: int, weights: Sequence[float], rotate: int = 0) -> tuple[int, ...]:
    """`rows` split in proportion to `weights` (largest remainder; ties to the lower index,
    counting from `rotate`)."""
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise HetplanError(f"replica weights must be finite, non-negative and not all zero, got {list(weights)}")
    total = math.fsum(weights)
    exact = [rows * w / total for w in weights]
    out = [math.floor(x) for x in exact]
    left = rows - sum(out)
    r = len(weights)
    by_remainder = sorted(range(r), key=lambda i: (-(exact[i] - out[i]), (i - rotate) % r))
    for i in by_remainder[:left]:
        out[i] += 1
    return tuple(out)


@dataclass(frozen=True)
class StepRows:
    """The rows of every (stage, micro-batch, replica) of a plan's step.

    `micro[j]` is micro-batch j's number of rows and `start[j]` its first row in the batch;
    `slices[k][j][p]` is (first, end) of replica p of stage k, counted within micro-batch j."""

    batch_size: int
    micro: tuple[int, ...]
    start: tuple[int, ...]
    slices: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]

    def rows(self, stage: int, microbatch: int, replica: int) -> int:
        lo, hi = self.slices[stage][microbatch][replica]
        return hi - lo

    def shared_rows(self, stage: int, microbatch: int, replica: int, other_stage: int,
                    other_replica: int) -> tuple[int, int]:
        """(first, end) of the rows that two replicas' slices of a micro-batch share (first == end: none)."""
        a = self.slices[stage][microbatch][replica]
        b = self.slices[other_stage][microbatch][other_replica]
        lo, hi = max(a[0], b[0]), min(a[1], b[1])
        return (lo, hi) if hi > lo else (lo, lo)

    def replicas(self, stage: int) -> int:
        return len(self.slices[stage][0])


def step_rows(batch_size: int, microbatches: int, weights: Sequence[Sequence[float]]) -> StepRows:
    """The split of a step: `weights[k]` are the replicas' weights of stage k."""
    micro = microbatch_rows(batch_size, microbatches)
    start = tuple(sum(micro[:j]) for j in range(len(micro)))
    slices = []
    for w in weights:
        per_mb = []
        for j, n in enumerate(micro):
            parts = split_rows(n, w, rotate=j) if len(w) > 1 else (n,)
            bounds = [0, *(sum(parts[:i + 1]) for i in range(len(parts)))]
            per_mb.append(tuple((bounds[i], bounds[i + 1]) for i in range(len(parts))))
        slices.append(tuple(per_mb))
    return StepRows(batch_size, micro, start, tuple(slices))
