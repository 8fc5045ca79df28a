"""How to train a plan: every setting of a run, defined once.

`RunSettings` is what `hetplan run` asks (its flags take their defaults from here and nowhere
else: `from_args`), what the library's `run_plan` takes, and what each worker reads back from
RUN.json (`RunSpec.settings`, serialised by `to_dict` / `from_dict`). A field left None (batch
size, sequence length, granularity) is worked out from the graph before the workers start
(`hetplan.runtime.run.prepare_run`), so a spec's settings are complete.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hetplan.errors import HetplanError

BACKENDS = ("auto", "gloo", "nccl")  # `backend`'s values (`runtime.transport.backend_of`)

# `hetplan run`'s flags whose destination differs from the field they set
FLAG_FIELDS = {"out": "out_dir", "block_class": "block_classes"}
LIBRARY_ONLY = ("return_weights", "resume_step")  # set by the library, not by a flag


@dataclass(frozen=True)
class RunSettings:
    """How to train. None: from the graph (or the plan, or the zoo's default)."""

    steps: int = 10
    warmup: int = 2  # steps left out of the timing
    batch_size: int | None = None
    seq_len: int | None = None
    granularity: str | None = None
    block_classes: tuple[str, ...] = ()  # as profiled: () takes the graph's, else the model's own
    seed: int = 0
    optimizer: str = "adam"
    lr: float = 1e-3
    data: str = "synthetic"  # or "text" (`hetplan.runtime.data`)
    out_dir: Path = Path("out/run")
    timeout_s: float = 60.0  # stop every worker when none moves for this long
    # torch.distributed's backend (`runtime.transport.backend_of`): "auto", NCCL between GPU
    # workers and gloo where a CPU takes part; "gloo"; "nccl", refused where a worker is on a CPU
    backend: str = "auto"
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # save every K steps (0: the last step only, with checkpoint_dir)
    resume: bool = False  # from the checkpoint in checkpoint_dir
    # the launcher may stop the run at a checkpoint to go on under another plan (`runtime.elastic`):
    # the workers agree on its stop step at each step's end
    elastic: bool = False
    no_dropout: bool = False  # every dropout layer at p=0 (`hetplan.zoo.faithful.dropouts`)
    trace: bool = False  # record the last step and draw it under the prediction (`hetplan.runtime.trace`)
    return_weights: bool = False  # each worker saves its trained weights (tests, benchmarks)
    resume_step: int = 0  # the step a resumed run starts at (worked out from the checkpoint)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))
        object.__setattr__(self, "block_classes", tuple(self.block_classes))
        problem = self.problem()
        if problem:
            raise HetplanError(problem)

    def problem(self) -> str | None:
        """What is wrong with these settings, in the words of `hetplan run`'s flags (None: nothing),
        found before any worker starts."""
        if not (_whole(self.steps) and self.steps >= 1 and _whole(self.warmup) and self.warmup >= 0):
            return (f"--steps {self.steps} --warmup {self.warmup}: run at least 1 step, with 0 or more warm-up "
                    "steps")
        for flag, value in (("--lr", self.lr), ("--timeout-s", self.timeout_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                return f"{flag} {value}: must be a number above 0 (and finite)"
        if not _whole(self.checkpoint_every) or self.checkpoint_every < 0:
            return f"--checkpoint-every {self.checkpoint_every}: K must be >= 1 and needs --checkpoint-dir DIR"
        if not _whole(self.seed):
            return f"--seed {self.seed}: must be a whole number"
        if self.backend not in BACKENDS:
            return f"--backend {self.backend!r} is unknown: use one of {', '.join(BACKENDS)}"
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON values (paths as text)."""
        out = asdict(self)
        out["out_dir"] = str(self.out_dir)
        out["checkpoint_dir"] = str(self.checkpoint_dir) if self.checkpoint_dir is not None else None
        out["block_classes"] = list(self.block_classes)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSettings:
        """Settings from `to_dict`'s object; a field it leaves out (or sets to None) takes its default."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known and v is not None})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunSettings:
        """The settings `hetplan run`'s flags give; a flag not given (None) takes the default."""
        given = {FLAG_FIELDS.get(k, k): v for k, v in vars(args).items()}
        return cls.from_dict({f.name: given[f.name] for f in fields(cls) if f.name in given})


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


DEFAULTS = RunSettings()
