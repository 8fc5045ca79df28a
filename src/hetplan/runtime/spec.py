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
from typing import Any

from hetplan.io.serde import from_dict, to_dict
from hetplan.plan import Plan
from hetplan.runtime.settings import RunSettings


@dataclass(frozen=True)
class RankSpec:
    """One worker (rank): replica `replica` of stage `stage`, standing for device `device` of
    the cluster, on host `host`, run on `binding` (cpu, cuda or cuda:K) with `threads` threads;
    `tp`: its place in the replica's tensor-parallel group (0: the replica's first device, the one
    that sends and receives its messages)."""

    stage: int
    replica: int
    device: str
    host: str
    binding: str
    threads: int
    tp: int = 0

    @property
    def on_cuda(self) -> bool:
        return self.binding.startswith("cuda")


@dataclass(frozen=True)
class RunSpec:
    """A run's plan, model and settings (`RunSettings`, complete: sizes worked out), the replicas'
    weights (per stage, their speeds, which split the batch's rows: `hetplan.rows`) and the
    workers, host by host (`hetplan.sync.rank_numbers`)."""

    plan: Plan
    model: str
    settings: RunSettings
    replica_weights: tuple[tuple[float, ...], ...]
    ranks: tuple[RankSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "replica_weights", tuple(tuple(w) for w in self.replica_weights))
        object.__setattr__(self, "ranks", tuple(self.ranks))

    @property
    def world(self) -> int:
        """The number of workers."""
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of RUN.json."""
        return {"plan": to_dict(self.plan), "model": self.model, "settings": self.settings.to_dict(),
                "replica_weights": [list(w) for w in self.replica_weights], "ranks": [asdict(r) for r in self.ranks]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        """A spec from RUN.json's object."""
        return cls(plan=from_dict(data["plan"]), model=data["model"], settings=RunSettings.from_dict(data["settings"]),
                   replica_weights=data["replica_weights"], ranks=tuple(RankSpec(**r) for r in data["ranks"]))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls.from_dict(json.loads(text))
