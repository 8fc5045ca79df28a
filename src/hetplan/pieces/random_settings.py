"""The probabilities with which a model draws random numbers without a dropout module.

transformers' layers keep `self.dropout = config.dropout` and call `nn.functional.dropout(x,
p=self.dropout)` (OPT, BART, wav2vec2); attention takes `dropout_p`; LayerDrop (Fan et al. 2019)
skips whole layers at random, and SpecAugment (Park et al. 2019) masks random spans of a speech
model's features (`mask_time_prob`). The last two choose in Python, with `torch.rand` or numpy,
which code runs: no trace can follow that (`hetplan.pieces.tracing` says so when it fails).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

RANDOM_SETTING = re.compile(r"dropout|(^|_)drop(_|$)|layerdrop|drop_path|drop_prob|drop_rate|mask_time_prob|"
                            r"mask_feature_prob", re.IGNORECASE)
CHOOSES_PATH = re.compile(r"layerdrop|mask_time_prob|mask_feature_prob", re.IGNORECASE)


def _holders(step: nn.Module) -> list[Any]:
    """Every module, and every module's configuration (read when the module runs)."""
    out: list[Any] = []
    for mod in step.modules():
        out.append(mod)
        config = getattr(mod, "config", None)
        if config is not None and not isinstance(config, nn.Module) and hasattr(config, "__dict__"):
            out.append(config)
    return out


def _probabilities(step: nn.Module, names: re.Pattern):
    """(holder, name, value) of every probability above 0 kept under such a name (SpecAugment's
    only where it is on: `apply_spec_augment`)."""
    for holder in _holders(step):
        masks = getattr(holder, "apply_spec_augment", True) is not False
        for name, value in list(vars(holder).items()):
            if (names.search(name) and isinstance(value, float) and 0.0 < value < 1.0
                    and (masks or not name.startswith("mask_"))):
                yield holder, name, value


def random_settings(step: nn.Module, names: re.Pattern = RANDOM_SETTING) -> dict[str, float]:
    """The probabilities above 0 the model keeps under such names: attribute name -> value."""
    found: dict[str, float] = {}
    for _, name, value in _probabilities(step, names):
        found.setdefault(name, value)
    return found


def zero_random_settings(step: nn.Module) -> None:
    """Every such probability at 0."""
    for holder, name, _ in list(_probabilities(step, RANDOM_SETTING)):
        setattr(holder, name, 0.0)
