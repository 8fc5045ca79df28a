"""How much slower a training step gets when another worker runs on the machine's other core.

    .venv/bin/python bench/corun.py [--seconds 8] [-o bench/results/corun.json]

For each model of bench/predicted_vs_measured.py: one process times its whole training step
(forward, backward, Adam; one thread, pinned to core 0) for `--seconds`, alone; then two such
processes, pinned to cores 0 and 1, run at once. The profiler times nodes alone, while the
workers of a plan run side by side, so this ratio is what the prediction misses on this machine
when the workers contend for memory bandwidth and cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = [("gpt2-tiny", 8, 64), ("mlp", 64, None), ("inception-tiny", 16, None)]


def child(model: str, batch: int, seq: int | None, seconds: float) -> None:
    import torch

    from hetplan.zoo import load_model

    torch.set_num_threads(1)
    zm = load_model(model, batch_size=batch, seq_len=seq)
    opt = torch.optim.Adam(zm.step.parameters())
    for _ in range(3):
        zm.step(**zm.batch).backward()
    times = []
    end = time.time() + seconds
    while time.time() < end:
        t0 = time.perf_counter()
        opt.zero_grad()
        zm.step(**zm.batch).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"median_s": statistics.median(times), "steps": len(times)}))


def run(model: str, batch: int, seq: int | None, seconds: float, cores: list[int]) -> list[dict]:
    procs = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, __file__, "--child", model, str(batch),
                               str(seq or 0), str(seconds)], stdout=subprocess.PIPE, text=True) for c in cores]
    return [json.loads(p.communicate()[0]) for p in procs]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, batch, seq, seconds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) or None, float(sys.argv[5])
        child(model, batch, seq, seconds)
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("results") / "corun.json")
    args = parser.parse_args()
    rows = []
    for model, batch, seq in MODELS:
        alone = run(model, batch, seq, args.seconds, [0])[0]
        pair = run(model, batch, seq, args.seconds, [0, 1])
        slow = statistics.mean(p["median_s"] for p in pair) / alone["median_s"] - 1
        rows.append({"model": model, "batch": batch, "seq_len": seq, "alone_s": alone["median_s"],
                     "side_by_side_s": [p["median_s"] for p in pair], "slowdown": slow})
        both = " / ".join(format(p["median_s"] * 1e3, ".1f") for p in pair)
        print(f"{model:>14}: alone {alone['median_s'] * 1e3:.1f} ms, side by side {both} ms: {slow:+.0%}", flush=True)
    args.output.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
