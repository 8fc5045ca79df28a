"""What a zoo entry or a user's factory gives: a training step and its example batch. A module
of its own so that the model builders (`hetplan.zoo.models`) and the registry (`hetplan.zoo`)
both import it without importing each other."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ZooModel:
    """A model ready to profile or train: `step(**batch)` returns the scalar loss. `batches`,
    when set, is the model's own data, (step, seed) -> batch, shaped like `batch` (a click log
    that the model reads and parses itself); None: `hetplan run` makes synthetic batches or reads
    text (`hetplan.runtime.data`)."""

    name: str
    step: Any  # torch.nn.Module
    batch: Mapping[str, Any]  # str -> torch.Tensor
    block_classes: tuple[str, ...] = ()
    batches: Callable[[int, int], Mapping[str, Any]] | None = None
