"""Training data that exists offline on every machine.

`synthetic` (the default): batches shaped like the model's example batch, drawn afresh at every
step, that keep the example's structure and can be learnt: masks and other tensors that are the
same in every row stay as they are; token ids follow a hidden bigram rule (a fixed permutation of a
small vocabulary, so a language model has something to predict); a per-row class comes first and
a float input is a noisy prototype of its class ("Gaussian blobs"); float targets are a fixed
linear map of the input. The rule is drawn from the seed alone, so every step, every worker and a
resumed run share it.

`text`: the Python standard library's own source files, read as bytes, as a corpus for the
language models (byte-level: a byte is a token id, so any vocabulary of at least 256 works). A
step's batch is a set of windows of the corpus at positions drawn from the step number and the
seed, so every worker, and a resumed run, draws the same batch for the same step.
"""

from __future__ import annotations

import sysconfig
from functools import cache
from pathlib import Path

import torch

CORPUS_BYTES = 8 * 2**20


@cache  # the corpus is read once per process; it never changes during a run
def corpus() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= CORPUS_BYTES:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).to(torch.long)


def input_vocab(module: torch.nn.Module) -> int | None:
    """The rows of the model's first embedding table (its vocabulary), if it has one."""
    return next((m.num_embeddings for m in module.modules() if isinstance(m, torch.nn.Embedding)), None)


def text_batch(example: dict[str, torch.Tensor], step: int, seed: int = 0,
               vocab: int | None = None) -> dict[str, torch.Tensor]:
    """A batch shaped like `example` (input_ids, and labels equal to them) from the corpus. A
    vocabulary smaller than a byte's 256 values gets the bytes modulo its size: the corpus is
    mostly ASCII, but its few UTF-8 bytes above 127 would index past a 128-row table."""
    if "input_ids" not in example:
        raise ValueError("--data text is for language models (a batch with input_ids)")
    batch, seq = example["input_ids"].shape
    data = corpus()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    ids = torch.stack([data[s:s + seq] for s in starts.tolist()])
    if vocab is not None and vocab < 256:
        ids = ids % vocab
    out = {k: v.clone() for k, v in example.items()}
    out["input_ids"] = ids
    if "labels" in out:
        out["labels"] = ids.clone()
    if "attention_mask" in out:
        out["attention_mask"] = torch.ones_like(ids)
    return out


TARGETS = ("labels", "label", "y", "target", "targets")
RULE_VOCAB = 256  # token ids of synthetic batches: few enough that every bigram is seen early
RULE_CLASSES = 16  # per-row classes: enough to be a task, few enough to learn in tens of steps


def _kept(key: str, value: torch.Tensor) -> bool:
    """Masks, token types, positions: integer tensors with one row repeated (or named a mask)."""
    if value.is_floating_point():
        return False
    return "mask" in key or value.dim() == 0 or bool((value == value[:1]).all())


def _tokens(shape, vocab: int, perm: torch.Tensor, gen) -> torch.Tensor:
    """Sequences whose next id is perm[id]: learnable by any language model."""
    ids = torch.empty(shape, dtype=torch.long)
    ids[..., 0] = torch.randint(0, vocab, shape[:-1], generator=gen)
    for i in range(1, shape[-1]):
        ids[..., i] = perm[ids[..., i - 1]]
    return ids


def _blobs(shape, classes: torch.Tensor, protos: torch.Tensor, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen) + protos[classes]


def _target(example: torch.Tensor, main: torch.Tensor, main_example: torch.Tensor, classes, rule) -> torch.Tensor:
    """A target from the input by the hidden rule, shaped and typed like the example's."""
    if example.is_floating_point():
        flat = main.float().reshape(len(main), -1)
        weight = torch.randn(flat.shape[1], example[0].numel(), generator=rule) / flat.shape[1] ** 0.5
        return (flat @ weight).reshape(example.shape).to(example.dtype)
    if example.dim() == 1 and classes is not None:
        return classes.to(example.dtype)
    if example.shape == main_example.shape and torch.equal(example, main_example):
        return main.clone()  # a language model's labels are its input ids
    if example.dim() == 2 and not main.is_floating_point() and example.shape[1] <= main.shape[1]:
        high = max(int(example.max()) + 1, 2)
        out = torch.randperm(min(high, RULE_VOCAB), generator=rule)[main[:, :example.shape[1]] % min(high, RULE_VOCAB)]
        return torch.where(example == -100, example, out.to(example.dtype))  # ignored positions stay ignored
    return torch.randint(0, max(int(example.max()) + 1, 2), example.shape, generator=rule, dtype=example.dtype)


def _input(value: torch.Tensor, classes, n_classes: int, rule, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An input like `value`, and the per-row classes (for token ids, the first token's bucket)."""
    if value.is_floating_point():
        if classes is None:
            return torch.randn(value.shape, generator=gen, dtype=value.dtype), None
        protos = torch.randn((n_classes, *value.shape[1:]), generator=rule)
        return _blobs(value.shape, classes, protos, gen).to(value.dtype), classes
    vocab = min(max(int(value.max()) + 1, 2), RULE_VOCAB)
    ids = _tokens(value.shape, vocab, torch.randperm(vocab, generator=rule), gen).to(value.dtype)
    if classes is not None:
        classes = ids.reshape(len(value), -1)[:, 0] * n_classes // vocab
    return ids, classes


def synthetic_batch(example: dict[str, torch.Tensor], step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fresh batch shaped like `example`, following a hidden rule fixed by `seed` (module doc)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)

    def rule():  # the same generator state at every call: the rule does not depend on the step
        return torch.Generator().manual_seed(seed * 7_919 + 17)

    out = {k: v.clone() for k, v in example.items() if _kept(k, v)}
    free = [k for k in example if k not in out]
    inputs = [k for k in free if k not in TARGETS] or free[:1]
    per_row = [example[k] for k in free
               if k in TARGETS and example[k].dim() == 1 and not example[k].is_floating_point()]
    n_classes = min(max(int(per_row[0].max()) + 1, 2), RULE_CLASSES) if per_row else 0
    classes = torch.randint(0, n_classes, (len(per_row[0]),), generator=gen) if per_row else None
    for key in inputs:
        out[key], found = _input(example[key], classes, n_classes, rule(), gen)
        classes = found if found is not None else classes
    main = inputs[0]
    for key in free:
        if key not in inputs:
            out[key] = _target(example[key], out[main], example[main], classes, rule())
    return {k: out[k] for k in example}
