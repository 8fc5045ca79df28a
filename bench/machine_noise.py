"""How steady this machine is: a fixed fp32 matrix product (2048^3, torch's default threads)
timed for 60 s. The spread is the floor under every timing comparison made on this machine.

    .venv/bin/python bench/machine_noise.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(3):
        a @ b
    rates: list[tuple[float, float]] = []  # (seconds since start, GFLOP/s)
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        rates.append((time.perf_counter() - start, 10 * 2 * 2048**3 / (time.perf_counter() - t) / 1e9))
    g = sorted(r for _, r in rates)
    windows: dict[int, list[float]] = {}
    for at, r in rates:
        windows.setdefault(int(at // 5), []).append(r)
    print(f"threads {torch.get_num_threads()}, {len(g)} samples: GFLOP/s median {statistics.median(g):.0f}, "
          f"min {g[0]:.0f}, max {g[-1]:.0f}, p10 {g[len(g) // 10]:.0f}, p90 {g[9 * len(g) // 10]:.0f}")
    print("means of 5 s windows:", [round(statistics.mean(v)) for _, v in sorted(windows.items())])


if __name__ == "__main__":
    main()
