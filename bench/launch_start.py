"""How long a local launch takes to its workers' first step, with the step traced once for all
workers (`hetplan.runtime.group`, what `hetplan run` does) against each worker tracing its own
(what it did before, and still does where a worker runs on a GPU), side by side in one process.

    .venv/bin/python bench/launch_start.py [--rounds 3] [-o bench/results/launch_start.json]

Each case is one `launch` of a one-step run (steps=1, warm-up 0) of a zoo model, every worker on
one CPU thread; the figure is the launch's wall time from the call to its return (the workers'
start, model build, tracing, the process group, one step, the result). The two ways alternate
within a round, so that the machine's drift falls on both. The worker server (`hetplan.forked`)
is started before the first case, as a notebook or test session has it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from hetplan import forked
from hetplan.io.clusters import cluster_from_spec
from hetplan.pieces.split import split_step
from hetplan.plan import Plan, Stage
from hetplan.runtime import launch as launching
from hetplan.runtime.settings import RunSettings
from hetplan.zoo import load_model

# (model, replicas per stage): 2, 4 and 8 workers
CASES = (("gpt2-tiny", (1, 1)), ("llama-tiny", (2, 2)), ("llama-tiny", (4, 4)))


def spec_of(model: str, replicas: tuple[int, ...], out: Path):
    zm = load_model(model, batch_size=8, seq_len=16, seed=0)
    names = [p.name for p in split_step(zm.step, zm.batch).pieces]
    cut = len(names) // 2
    devices = iter(f"c{i}" for i in range(sum(replicas)))
    cluster = cluster_from_spec({"name": "cpus", "devices": [
        {"id": f"c{i}", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"}
        for i in range(sum(replicas))]}, "cpus")
    stages = tuple(Stage(tuple(nodes), tuple(next(devices) for _ in range(r)))
                   for nodes, r in zip((names[:cut], names[cut:]), replicas, strict=True))
    plan = Plan(stages, 2, "1f1b", "bench")
    return launching.run_spec(plan, cluster, model, RunSettings(batch_size=8, seq_len=16, granularity="layer",
                                                                steps=1, warmup=0, out_dir=out, no_dropout=True))


def timed_launch(spec, once: bool) -> float:
    start = time.perf_counter()
    if once:
        launching.launch(spec)
    else:
        with mock.patch.object(launching, "group_make", lambda spec: None):
            launching.launch(spec)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-o", "--out", type=Path)
    args = ap.parse_args()
    forked.warm()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, replicas in CASES:
            times: dict[str, list[float]] = {"once": [], "each": []}
            for r in range(args.rounds):
                for way in (("once", "each") if r % 2 == 0 else ("each", "once")):
                    spec = spec_of(model, replicas, Path(tmp) / f"{model}-{sum(replicas)}-{way}-{r}")
                    times[way].append(timed_launch(spec, way == "once"))
            row = {"model": model, "workers": sum(replicas), **{f"{way}_s": t for way, t in times.items()},
                   **{f"{way}_median_s": statistics.median(t) for way, t in times.items()}}
            rows.append(row)
            print(f"{model:11s} {sum(replicas)} workers: traced once {row['once_median_s']:6.1f} s, "
                  f"by each worker {row['each_median_s']:6.1f} s (medians of {args.rounds}; "
                  f"once {', '.join(f'{t:.1f}' for t in times['once'])}; each "
                  f"{', '.join(f'{t:.1f}' for t in times['each'])})", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "rounds": args.rounds}, indent=1))


if __name__ == "__main__":
    main()
