"""Checkpoints: each stage's weights, optimizer state and random state, written atomically
(to a temporary file, then renamed), so a crash never leaves half a checkpoint. Replicas hold
the same weights and state, so the first writes for all; where they shard the optimizer's state
(`hetplan.runtime.sharding`, `hetplan.runtime.zero`) each holds its own share, and each writes its
own file, the whole weights and its share of the optimizer's state."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from hetplan.errors import HetplanError, first_line
from hetplan.runtime.supervise import space_left


def stage_path(directory: Path, stage: int, replica: int = 0) -> Path:
    """The file of a stage, or of replica `replica` of a stage whose replicas shard their state."""
    return directory / (f"stage{stage}.pt" if replica == 0 else f"stage{stage}.replica{replica}.pt")


def save_stage(directory: Path, stage: int, module: nn.Module, optimizer: torch.optim.Optimizer | None,
               step: int, replica: int = 0, shard: int = 0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    path = stage_path(directory, stage, replica)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save({"step": step, "shard": shard, "model": module.state_dict(),
                    "optimizer": optimizer.state_dict() if optimizer is not None else None,
                    "rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:  # torch says a full disk as "unexpected pos N vs M"
        tmp.unlink(missing_ok=True)
        raise HetplanError(f"{path}: cannot write the checkpoint ({first_line(exc)}): "
                           f"{space_left(directory)}") from None


def load_stage(directory: Path, stage: int, module: nn.Module, optimizer: torch.optim.Optimizer | None,
               replica: int = 0) -> int:
    state = torch.load(stage_path(directory, stage, replica), weights_only=False, map_location="cpu")
    module.load_state_dict(state["model"])
    if optimizer is not None:  # a stage without parameters has none
        optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def shard_level(directory: Path, stage: int) -> int:
    """What the replicas of the stage whose checkpoint this is sharded (`Stage.shard`); a file
    without the field: 1 where each replica wrote its own, else 0."""
    state = torch.load(stage_path(directory, stage), weights_only=False, map_location="cpu", mmap=True)
    return int(state.get("shard", 1 if stage_path(directory, stage, 1).exists() else 0))


def checkpoint_step(directory: Path, stages: Sequence[int]) -> int | None:
    """The step the checkpoints of `stages` have all reached (None when one has none); a worker
    holding several stages (interleaved) writes one, under its first stage."""
    steps = []
    for s in stages:
        path = stage_path(directory, s)
        if not path.exists():
            return None
        steps += [int(torch.load(p, weights_only=False)["step"])
                  for p in (path, *sorted(directory.glob(f"stage{s}.replica*.pt")))]
    if len(set(steps)) != 1:
        return None
    return steps[0]
