"""A step's timeline: every action and message as a span on a device's or a link's row.

The simulator predicts one (`hetplan.sim.engine`), the runtime records one from a run
(`hetplan.runtime.trace`), and the report draws both alike (`hetplan.timeline.gantt`): its own
module, so that none of them imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass

ALLREDUCE = "AR"
OPTIMIZER = "OPT"


@dataclass(frozen=True)
class Span:
    """One piece of work on the timeline.

    `resource` is a device id, or `"a->b"` for transfers from device a to device b. `kind` is F
    (a forward pass, or activations on a link), B (a backward pass, or gradients on a link), I and
    W (the two halves of a backward split by a zero-bubble schedule: inputs', weights') or AR
    (the stage's gradient all-reduce, drawn on each replica's row) or OPT (the optimizer step after
    the last backward pass and the all-reduce). `stage` is the stage doing the
    work (on links, the sending stage, and `to_stage` the receiving one); `microbatch` is -1 for AR."""

    resource: str
    kind: str
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    to_stage: int = -1

    @property
    def label(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}" if self.microbatch >= 0 else f"{self.stage}{self.kind}"


@dataclass(frozen=True)
class Timeline:
    """Every action of a simulated step, with the rows to draw them on (devices then links)."""

    spans: tuple[Span, ...]
    devices: tuple[str, ...]
    links: tuple[str, ...]
    step_s: float
