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

import itertools
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

    def overlaps(self, stage: int, other_stage: int, microbatch: int) -> list[tuple[int, int, int, int]]:
        """(replica, other replica, first, end) of every pair of the two stages' replicas whose
        slices of a micro-batch share rows: both stages' slices tile the micro-batch in order, so
        one walk along both finds them (`shared_rows` of every pair, without the pairs that share none)."""
        a, b = self.slices[stage][microbatch], self.slices[other_stage][microbatch]
        p = q = 0
        out = []
        while p < len(a) and q < len(b):
            lo, hi = max(a[p][0], b[q][0]), min(a[p][1], b[q][1])
            if hi > lo:
                out.append((p, q, lo, hi))
            if a[p][1] <= b[q][1]:
                p += 1
            else:
                q += 1
        return out

    def replicas(self, stage: int) -> int:
        return len(self.slices[stage][0])


def stage_slices(micro: Sequence[int], weights: Sequence[float]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per micro-batch (of `micro[j]` rows), each replica's (first, end) of its rows, the replicas
    weighted by `weights`."""
    per_mb = []
    for j, n in enumerate(micro):
        parts = split_rows(n, weights, rotate=j) if len(weights) > 1 else (n,)
        bounds = [0, *itertools.accumulate(parts)]
        per_mb.append(tuple((bounds[i], bounds[i + 1]) for i in range(len(parts))))
    return tuple(per_mb)


def idle_replicas(rows: StepRows, every: Sequence[bool]) -> list[tuple[int, int]]:
    """(stage, replica) of each replica of a stage of several that gets no row of any
    micro-batch, or, where `every[stage]` (its replicas run collectives in each micro-batch's
    actions: `Stage.shard` 2 or 3, `hetplan.runtime.zero`), no row of some micro-batch."""
    out = []
    for k, per_mb in enumerate(rows.slices):
        for p in range(len(per_mb[0]) if per_mb else 0):
            got = [hi > lo for lo, hi in (mb[p] for mb in per_mb)]
            if len(per_mb[0]) > 1 and not (all(got) if every[k] else any(got)):
                out.append((k, p))
    return out


def step_rows(batch_size: int, microbatches: int, weights: Sequence[Sequence[float]],
              slices=stage_slices) -> StepRows:
    """The split of a step: `weights[k]` are the replicas' weights of stage k (`slices`: how a
    stage's rows are split, `stage_slices` or a memo of it)."""
    micro = microbatch_rows(batch_size, microbatches)
    start = tuple(itertools.accumulate(micro, initial=0))[:-1]
    return StepRows(batch_size, micro, start, tuple(slices(micro, tuple(w)) for w in weights))
