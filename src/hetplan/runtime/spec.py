"""RUN.json, the spec every worker of a run reads: `RunSpec`, one `RankSpec` per worker.

`hetplan.runtime.launch.run_spec` makes it from a plan and a cluster; the launcher writes it into
the run folder and each worker (`python -m hetplan.runtime.worker RUN.json`, under `hetplan run`
or torchrun) reads it back. `RunSpec.from_json(spec.to_json()) == spec`: the file holds every
field, the plan as `hetplan.io.serde` writes plans, paths as text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hetplan.io.serde import from_dict, to_dict
from hetplan.plan import Plan


@dataclass(frozen=True)
class RankSpec:
    """One worker (rank): replica `replica` of stage `stage`, standing for device `device` of
    the cluster, on host `host`, run on `binding` (cpu, cuda or cuda:K) with `threads` threads."""

    stage: int
    replica: int
    device: str
    host: str
    binding: str
    threads: int

    @property
    def on_cuda(self) -> bool:
        return self.binding.startswith("cuda")


@dataclass(frozen=True)
class RunSpec:
    """A run's plan, model and settings, the replicas' weights (per stage, their speeds, which
    split the batch's rows: `hetplan.rows`) and the ranks, stage by stage, replica by replica."""

    plan: Plan
    model: str
    batch_size: int
    seq_len: int | None
    granularity: str
    out_dir: Path
    replica_weights: tuple[tuple[float, ...], ...]
    ranks: tuple[RankSpec, ...]
    block_classes: tuple[str, ...] = ()
    steps: int = 10
    warmup: int = 2
    seed: int = 0
    optimizer: str = "adam"
    lr: float = 1e-3
    data: str = "synthetic"
    timeout_s: float = 60.0
    no_dropout: bool = False
    return_weights: bool = False
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume_step: int = 0
    trace: bool = False  # record the last step's actions, messages, all-reduce and optimizer step

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))
        object.__setattr__(self, "block_classes", tuple(self.block_classes))
        object.__setattr__(self, "replica_weights", tuple(tuple(w) for w in self.replica_weights))
        object.__setattr__(self, "ranks", tuple(self.ranks))

    @property
    def world(self) -> int:
        """The number of workers."""
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of RUN.json."""
        return {
            "plan": to_dict(self.plan), "model": self.model, "batch_size": self.batch_size, "seq_len": self.seq_len,
            "granularity": self.granularity, "block_classes": list(self.block_classes), "steps": self.steps,
            "warmup": self.warmup, "seed": self.seed, "optimizer": self.optimizer, "lr": self.lr, "data": self.data,
            "out_dir": str(self.out_dir), "timeout_s": self.timeout_s, "no_dropout": self.no_dropout,
            "return_weights": self.return_weights,
            "checkpoint_dir": str(self.checkpoint_dir) if self.checkpoint_dir is not None else None,
            "checkpoint_every": self.checkpoint_every, "resume_step": self.resume_step, "trace": self.trace,
            "replica_weights": [list(w) for w in self.replica_weights],
            "ranks": [asdict(r) for r in self.ranks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        """A spec from RUN.json's object; the settings a spec may leave out take their defaults."""
        optional = ("block_classes", "steps", "warmup", "seed", "optimizer", "lr", "data", "timeout_s", "no_dropout",
                    "return_weights", "checkpoint_dir", "checkpoint_every", "resume_step", "trace")
        return cls(plan=from_dict(data["plan"]), model=data["model"], batch_size=data["batch_size"],
                   seq_len=data["seq_len"], granularity=data["granularity"], out_dir=Path(data["out_dir"]),
                   replica_weights=data["replica_weights"], ranks=tuple(RankSpec(**r) for r in data["ranks"]),
                   **{k: data[k] for k in optional if data.get(k) is not None})

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls.from_dict(json.loads(text))
