"""Faithfulness and cost of the profiler.

For each model, runs the CLI exactly as a user would,

    hetplan profile MODEL --batch-size B [--seq-len S] --device cpu --granularity G --check -o OUT --json

and reports the sum of node times (pieces run in sequence) against the measured whole
forward+backward step of the unsplit model, timed just before each repeat (the `--check` ratios:
the median of the repeat-by-repeat ratios, and the sum of node medians over the median whole
step). With `--profiling-time`, also times a plain profile of gpt2 at batch 8, sequence 128
(no --check) from the shell, model construction and start-up included.

    .venv/bin/python bench/profile_faithfulness.py [--repeats N] [--out bench/results/F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HETPLAN = str(Path(sys.executable).with_name("hetplan"))
CASES = [  # the zoo's default batch sizes
    ("gpt2-tiny", 8, 64, "layer"), ("gpt2-tiny", 8, 64, "block"),
    ("mlp", 64, None, "layer"),
    ("inception-tiny", 32, None, "layer"), ("inception-tiny", 32, None, "block"),
]


def run(args: list[str]) -> tuple[dict, float]:
    start = time.perf_counter()
    proc = subprocess.run([HETPLAN, *args, "--json"], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {proc.stderr}")
    return json.loads(proc.stdout), wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/profile_faithfulness_insequence.json"))
    parser.add_argument("--profiling-time", action="store_true", help="also time plain profiles of gpt2")
    parser.add_argument("--repeats", type=int, default=5,
                        help="hetplan profile --repeats (5: what --check takes at least; more: less noise)")
    args = parser.parse_args()
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    with tempfile.TemporaryDirectory() as tmp:
        # Two rounds, so that each case is measured twice at different times: this machine's
        # speed drifts, and the spread between the rounds shows by how much.
        for model, batch, seq, gran in CASES * 2:
            cmd = ["profile", model, "--batch-size", str(batch), "--device", "cpu", "--granularity", gran,
                   "--check", "--repeats", str(args.repeats), "-o", f"{tmp}/{model}-{gran}.json"]
            if seq:
                cmd[4:4] = ["--seq-len", str(seq)]
            info, wall = run(cmd)
            dtype = info["device_types"][0]
            rows.append({"command": "hetplan " + " ".join(cmd).replace(tmp + "/", ""), "model": model,
                         "batch": batch, "seq_len": seq, "granularity": gran, "nodes": info["nodes"],
                         "sum_nodes_s": info["fwd_s_total"] + info["bwd_s_total"],
                         "whole_step_s": info["whole_step_s"][dtype],
                         "whole_step_range_s": info["whole_step_range_s"][dtype], "ratio": info["check_ratio"][dtype],
                         "ratio_median": info["check_ratio_median"][dtype],
                         "profile_s": info["profile_s"], "wall_s": wall})
            print(json.dumps(rows[-1]), flush=True)
        timed = []
        for _ in range(2 if args.profiling_time else 0):
            _, wall = run(["profile", "gpt2", "--batch-size", "8", "--seq-len", "128", "--device", "cpu",
                           "-o", f"{tmp}/gpt2-plain.json"])
            timed.append(wall)
            print(json.dumps({"gpt2_profile_wall_s": wall}), flush=True)
    result = {"machine": f"{platform.processor() or platform.machine()}, {platform.node()}, "
                         f"{os.cpu_count()} cores", "started": started, "rows": rows,
              "gpt2_b8_s128_profile_wall_s": timed}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
