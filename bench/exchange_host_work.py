"""The host's share of replicas' gradient sum: `hetplan.runtime.gradients.reduce_gradients` over
one replica's gradients with collectives that do nothing, so what is timed is the torch calls
around them (joining the gradients into one buffer and back; for ctr-dnn's tables also finding
each replica's rows, their union, placing them, the sparse results).

    .venv/bin/python bench/exchange_host_work.py [--model ctr-dnn] [--batch 512] [--repeats 30]

One process, one thread, the model's gradients from one backward pass over half a batch (as one
of two replicas; `--batch`: the whole batch, default the zoo's), the sum repeated `--repeats`
times (median after 5). To compare two versions
of the runtime, run it from two checkouts one after the other (`PYTHONPATH=CHECKOUT/src`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hetplan.pieces.hostmem import keep_freed_memory
from hetplan.runtime.gradients import reduce_gradients, sparse_parameter_ids
from hetplan.zoo import load_model


class NoCollectives:
    """A transport whose all-reduces leave the buffer as it is (rank 0 of two)."""

    rank = 0

    def all_reduce(self, tensor, ranks) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="ctr-dnn", help="a zoo model")
    parser.add_argument("--batch", type=int, default=None, help="the whole batch (default: 512 for ctr-dnn)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the runtime's workers
    batch = args.batch or (512 if args.model == "ctr-dnn" else None)
    zm = load_model(args.model, batch_size=batch)
    zm.step(**{k: v[0::2] for k, v in zm.batch.items()}).backward()
    params = [p for _, p in sorted((n, p) for n, p in zm.step.named_parameters() if p.grad is not None)]
    made, sparse, times = [p.grad.clone() for p in params], sparse_parameter_ids(zm.step), []
    for _ in range(args.repeats + 5):
        for p, g in zip(params, made, strict=True):
            p.grad = g.clone()
        began = time.perf_counter()
        reduce_gradients([((0, 1), params)], NoCollectives(), sparse)
        times.append(time.perf_counter() - began)
    print(f"{args.model}: host work of the gradient sum: median {statistics.median(times[5:]) * 1e3:.2f} ms, "
          f"fastest {min(times) * 1e3:.2f} ms over {args.repeats} repeats")


if __name__ == "__main__":
    main()
