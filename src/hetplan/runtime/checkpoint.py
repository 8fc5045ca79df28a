"""Checkpoints that any plan of the same model loads, in the manner of torch.distributed.checkpoint's
sharded state dicts: every worker writes what it holds under the model's own names, and a reader
takes from all the files the parts its own plan needs, whatever plan wrote them.

A checkpoint of step S is the folder `step-S` of the checkpoint folder: `meta.json` (what the run
trains: model, optimizer, batch, data, the plan that wrote it; rank 0 writes it) and one file per
worker, `rank{r}.pt`, each written atomically (a temporary name, then renamed). It is whole when
every worker of the plan that wrote it has its file. A file holds entries (name, what, region,
shape) and their tensors: `name` a parameter or buffer of the whole model (`named_parameters()`:
a tied weight has one name), `what` "param", "buffer" or a key of the optimizer's state for that
parameter (Adam's "exp_avg", "exp_avg_sq", "step"), `shape` the whole tensor's, and `region` the
part of it the entry holds:

- ("whole",): all of it (the first replica of a stage writes it: the replicas hold the same);
- ("dim", d, lo, hi): the slice lo..hi along dimension d (a tensor-parallel worker's shard);
- ("flat", lo, hi): elements lo..hi of the flattened tensor (a replica's share where a stage's
  replicas shard their state, ZeRO 1 to 3: each writes its own share of the weights and of the
  optimizer's state, and nothing is gathered to be written).

A reader assembles each tensor its worker needs from the regions that cover it, reading the files
through mmap (a worker reads what its own stages hold), and cuts it as its plan holds it. The data
position is the step (a step's batch is a function of the step and the seed: `runtime.data`). Each
worker's random state is in its file, restored onto the same plan only: dropout's masks follow the
plan's cut of the batch, which another plan cuts otherwise. A worker's first checkpoint after the
previous whole one removes the older ones, so a crash while writing leaves the last whole one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetplan.errors import HetplanError, InputError, first_line
from hetplan.io.serde import atomic_write_text
from hetplan.runtime.supervise import space_left

FORMAT = 2
Region = tuple  # ("whole",) | ("dim", d, lo, hi) | ("flat", lo, hi)
# what a checkpoint's run must share with the run that resumes it: the same training, whatever the plan
SAME_TRAINING = ("model", "optimizer", "batch_size", "seq_len", "seed", "data")


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def _steps(directory: Path) -> list[tuple[int, Path]]:
    out = []
    for path in Path(directory).glob("step-*"):
        tail = path.name.removeprefix("step-")
        if tail.isdigit() and path.is_dir():
            out.append((int(tail), path))
    return sorted(out)


def read_meta(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def whole_step(folder: Path) -> bool:
    """Whether every worker of the plan that wrote the checkpoint in `folder` has its file there."""
    meta = read_meta(folder)
    return meta is not None and all((folder / f"rank{r}.pt").exists() for r in range(int(meta["world"])))


def latest_step(directory: Path) -> int | None:
    """The step of the folder's latest whole checkpoint (None where it has none)."""
    whole = [step for step, folder in _steps(directory) if whole_step(folder)]
    return whole[-1] if whole else None


def clear_partial(directory: Path) -> None:
    """The checkpoints a failed run left part-written (not every worker's file) removed."""
    for _, folder in _steps(directory):
        if not whole_step(folder):
            shutil.rmtree(folder, ignore_errors=True)


def legacy(directory: Path) -> bool:
    """Whether the folder holds a checkpoint of the earlier format (a file per stage of one plan)."""
    return any(Path(directory).glob("stage*.pt"))


# --- writing ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    name: str
    what: str
    region: Region
    shape: tuple[int, ...]
    tensor: torch.Tensor


def save(directory: Path, step: int, rank: int, entries: list[Entry], meta: Mapping[str, Any] | None,
         extra: Mapping[str, Any] | None = None) -> None:
    """Worker `rank`'s file of the checkpoint of `step` (with `meta`: rank 0's, `meta.json` too;
    `extra`: numbers of the run's, fp16's loss scale), then, on rank 0, the checkpoints before the
    last whole one removed."""
    folder = step_dir(directory, step)
    before = latest_step(directory) if meta is not None else None  # rank 0 removes the old ones
    path = folder / f"rank{rank}.pt"
    tmp = folder / f".rank{rank}.pt.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if meta is not None:
            atomic_write_text(folder / "meta.json", json.dumps({**meta, "format": FORMAT, "step": step}, indent=1))
        torch.save({"format": FORMAT, "step": step, "rank": rank, "rng": torch.get_rng_state(),
                    "extra": dict(extra or {}), "entries": [(e.name, e.what, e.region, e.shape) for e in entries],
                    "tensors": [e.tensor for e in entries]}, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError, InputError) as exc:  # torch says a full disk as "unexpected pos N vs M"
        tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # where nothing else is in it
        raise HetplanError(f"{path}: cannot write the checkpoint ({first_line(exc)}): "
                           f"{space_left(Path(directory))}") from None
    if meta is not None and before is not None:
        for old, older in _steps(directory):
            if old < before:
                shutil.rmtree(older, ignore_errors=True)


# --- reading ---------------------------------------------------------------------------------------

class Reader:
    """The checkpoint of one step, every worker's file opened through mmap; `whole(name, what)`
    assembles a tensor from the regions its writers held."""

    def __init__(self, directory: Path, step: int) -> None:
        self.folder = step_dir(directory, step)
        self.meta = read_meta(self.folder) or {}
        self.files: list[dict] = []
        self.index: dict[tuple[str, str], list[tuple[Region, tuple[int, ...], torch.Tensor]]] = {}
        for r in range(int(self.meta.get("world", 0))):
            data = torch.load(self.folder / f"rank{r}.pt", map_location="cpu", mmap=True, weights_only=True)
            self.files.append(data)
            for (name, what, region, shape), tensor in zip(data["entries"], data["tensors"], strict=True):
                self.index.setdefault((name, what), []).append((tuple(region), tuple(shape), tensor))

    def rng(self, rank: int) -> torch.Tensor:
        return self.files[rank]["rng"]

    def extra(self, rank: int) -> dict:
        return dict(self.files[rank].get("extra", {}))

    def state_keys(self, name: str) -> list[str]:
        """The optimizer's state the checkpoint holds for parameter `name` (none after SGD)."""
        return sorted(what for (n, what) in self.index if n == name and what not in ("param", "buffer"))

    def whole(self, name: str, what: str) -> torch.Tensor:
        parts = self.index.get((name, what))
        if not parts:
            raise HetplanError(f"{self.folder}: the checkpoint holds no {what} of {name!r}: it was written for "
                               "another model; resume with the model that wrote it, or start afresh without --resume")
        for region, _, tensor in parts:
            if region[0] == "whole":
                return tensor.clone()
        shape = parts[0][1]
        out = torch.empty(shape, dtype=parts[0][2].dtype)
        seen = torch.zeros(shape, dtype=torch.bool)
        for region, _, tensor in parts:
            _view(out, region).copy_(tensor.reshape(_view(out, region).shape))
            _view(seen, region).fill_(True)
        if not bool(seen.all()):
            raise HetplanError(f"{self.folder}: the checkpoint holds only part of {name!r} ({what}): a worker's "
                               "file lacks its share; resume from an earlier checkpoint")
        return out


def _view(full: torch.Tensor, region: Region) -> torch.Tensor:
    if region[0] == "whole":
        return full
    if region[0] == "dim":
        _, d, lo, hi = region
        return full.narrow(d, lo, hi - lo)
    _, lo, hi = region
    return full.view(-1)[lo:hi]


def cut(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The part `region` of a whole tensor, as a worker holds it."""
    return _view(full, region)
