"""Training data that exists offline on every machine.

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


def text_batch(example: dict[str, torch.Tensor], step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch shaped like `example` (input_ids, and labels equal to them) from the corpus."""
    if "input_ids" not in example:
        raise ValueError("--data text is for language models (a batch with input_ids)")
    batch, seq = example["input_ids"].shape
    data = corpus()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    ids = torch.stack([data[s:s + seq] for s in starts.tolist()])
    out = {k: v.clone() for k, v in example.items()}
    out["input_ids"] = ids
    if "labels" in out:
        out["labels"] = ids.clone()
    if "attention_mask" in out:
        out["attention_mask"] = torch.ones_like(ids)
    return out
