"""A zoo of real model architectures with random weights, built from their configurations.

Nothing is downloaded: the language and vision models are `transformers` model classes built
from a configuration with `HF_HUB_OFFLINE=1`, and `inception-tiny` and `mlp` are written in
`hetplan.zoo.models`. Each entry makes an example batch and a `TrainStep`: a module whose forward
takes the batch and returns the scalar training loss, so that profiling and running cover the
whole training step, loss included. `block_classes` names the repeated unit of each model for
`--granularity block` (a transformer block, a ResNet bottleneck, an Inception branch).

A user's own model is `module.path:factory`: `factory(batch_size=..., seq_len=...)` returns a
`ZooModel`, or a pair `(model, batch)` where `batch` is a dict of keyword tensors and the model's
output is the loss (or has `.loss`, or is a tensor whose mean is taken).

This module does not import torch, so that listing the zoo stays fast; building a model does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hetplan._frozen import FrozenMap
from hetplan.errors import HetplanError
from hetplan.zoo.model import ZooModel


@dataclass(frozen=True)
class ZooEntry:
    """`builder` names a function of `hetplan.zoo.models`: (batch_size, seq_len, seed, **kwargs)."""

    name: str
    summary: str
    builder: str
    default_batch_size: int
    default_seq_len: int = 0  # 0: the model takes no sequence length
    kwargs: Mapping[str, Any] = field(default_factory=FrozenMap)
    transformers: bool = True  # built from a transformers class (its workers import the library)

    @property
    def language_model(self) -> bool:
        """Takes batches of token ids (so it has a sequence length, and can train on text)."""
        return self.default_seq_len > 0


ZOO: MappingProxyType[str, ZooEntry] = MappingProxyType({e.name: e for e in (
    ZooEntry("gpt2", "GPT-2 small, 124M parameters, 12 blocks", "gpt2", 8, 128,
             FrozenMap(dict(layers=12, embd=768, heads=12, vocab=50257, positions=1024))),
    ZooEntry("gpt2-tiny", "GPT-2 with 4 blocks of width 128 and a byte vocabulary (tests, demo)", "gpt2", 8, 64,
             FrozenMap(dict(layers=4, embd=128, heads=4, vocab=256, positions=512))),
    ZooEntry("bert-base", "BERT base, 110M parameters, masked-LM head", "bert", 8, 128),
    ZooEntry("llama-tiny", "Llama with 4 decoder layers of width 128, grouped-query attention", "llama_tiny", 8, 64),
    ZooEntry("resnet50", "ResNet-50 (transformers), 224x224 images, 1000 classes", "resnet50", 32),
    ZooEntry("vit-base", "ViT-B/16, 224x224 images, 1000 classes", "vit_base", 8),
    ZooEntry("inception-tiny", "Inception-style CNN, 3 modules of 4 parallel branches, 32x32 images",
             "inception_tiny", 32, transformers=False),
    ZooEntry("mlp", "5-layer perceptron 784-1024x4-10", "mlp", 64, transformers=False),
    # Batch 256: the parser, the lookups and the MLP's GEMMs then outweigh per-call overheads, an eighth
    # (32, the profiler's second batch) is still a real micro-batch, and a layer profile takes seconds on one core.
    ZooEntry("ctr-dnn", "CTR model on synthetic Criteo click logs: line parser, 26 embedding bags (5.57M rows, "
             "356 MB), MLP 512-256-128-1", "ctr_dnn", 256, transformers=False),
)})


def zoo_names() -> tuple[str, ...]:
    return tuple(ZOO)


def uses_transformers(name: str) -> bool:
    """Whether building the model imports transformers: a zoo entry says; a user's own model is
    taken to where transformers is installed (most are its classes)."""
    if name in ZOO:
        return ZOO[name].transformers
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def load_model(name: str, *, batch_size: int | None = None, seq_len: int | None = None, seed: int = 0) -> ZooModel:
    """A zoo model by name, or `module.path:factory` for a user's own."""
    if batch_size is not None and batch_size < 1:
        raise HetplanError(f"--batch-size {batch_size}: must be >= 1")
    if seq_len is not None and seq_len < 1:
        raise HetplanError(f"--seq-len {seq_len}: must be >= 1")
    if name in ZOO:
        from hetplan.zoo import models

        entry = ZOO[name]
        built = getattr(models, entry.builder)(batch_size or entry.default_batch_size,
                                               seq_len or entry.default_seq_len, seed, **entry.kwargs)
        return ZooModel(name, built.step, built.batch, built.block_classes, built.batches)
    if ":" in name:
        from hetplan.zoo import models

        return models.user_model(name, batch_size, seq_len)
    raise HetplanError(f"unknown model {name!r} (zoo: {', '.join(ZOO)}; or module.path:factory for your own)")
