"""Where the sum of isolated node times and the whole step differ (issue 3 follow-up).

Cuts gpt2 (batch 8 x 128) into blocks, runs the pieces in sequence as one training step (timing
each piece's forward in place, and the backward as a whole), then times each piece in isolation
as the profiler does, and prints both side by side.

    .venv/bin/python bench/profile_gap.py [--model gpt2] [--granularity block]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hetplan.profile.split import split_step
from hetplan.profile.timing import time_cpu, warm_pass
from hetplan.zoo import load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--granularity", default="block")
    args = parser.parse_args()
    zm = load_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len)
    step = zm.step.train()
    split = split_step(step, zm.batch, args.granularity, zm.block_classes)

    def in_sequence() -> tuple[dict[str, float], float, float]:
        for p in step.parameters():
            p.grad = None
        env = {n: zm.batch[k] for k, n in zip(split.input_keys, split.input_names, strict=True)}
        fwd: dict[str, float] = {}
        t0 = time.perf_counter()
        for piece in split.pieces:
            t = time.perf_counter()
            env.update(zip(piece.outputs, piece.module(*(env[n] for n in piece.inputs)), strict=True))
            fwd[piece.name] = time.perf_counter() - t
        t1 = time.perf_counter()
        env[split.loss].backward()
        return fwd, t1 - t0, time.perf_counter() - t1

    in_sequence()
    runs = [in_sequence() for _ in range(3)]
    seq_fwd = {k: statistics.median(r[0][k] for r in runs) for k in runs[0][0]}
    with torch.no_grad():
        _, values = split.run(zm.batch, capture=True)
    iso = {}
    for piece in split.pieces:
        inputs = [values[n] for n in piece.inputs]
        warm_pass(piece, inputs)
        iso[piece.name] = time_cpu(piece, inputs, 3)
    print(f"in sequence: forward {statistics.median(r[1] for r in runs):.3f} s, "
          f"backward {statistics.median(r[2] for r in runs):.3f} s")
    print(f"isolated (sum of node medians): forward {sum(t.fwd_s for t in iso.values()):.3f} s, "
          f"backward {sum(t.bwd_s for t in iso.values()):.3f} s")
    for name, t in seq_fwd.items():
        print(f"{name:32s} forward in sequence {t * 1e3:8.1f} ms, isolated {iso[name].fwd_s * 1e3:8.1f} ms; "
              f"backward isolated {iso[name].bwd_s * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
