"""What a zoo entry or a user's factory gives: a training step and its example batch. A module
of its own so that the model builders (`hetplan.zoo.models`) and the registry (`hetplan.zoo`)
both import it without importing each other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ZooModel:
    """A model ready to profile or train: `step(**batch)` returns the scalar loss."""

    name: str
    step: Any  # torch.nn.Module
    batch: Mapping[str, Any]  # str -> torch.Tensor
    block_classes: tuple[str, ...] = ()
