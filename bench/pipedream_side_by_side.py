"""dp against PipeDream's own optimizer, on PipeDream's question and PipeDream's settings.

    git clone https://github.com/msr-fiddle/pipedream /tmp/pipedream   # or any checkout of it
    .venv/bin/python bench/pipedream_side_by_side.py --pipedream /tmp/pipedream \
        [-o bench/results/pipedream_side_by_side.json]

For every shared profile (`../shared/data/pipedream-profiles`) x {4, 8} devices x {straight,
replicated} at 10 GB/s, both tools plan on the same machine in the same run:

- PipeDream: `optimizer/optimizer_graph_hierarchical.py -f graph.txt -n N -b 1e10
  [--straight_pipeline] -o DIR`, run as a process of its own with python3 (its `graph` package
  imports `graphviz` only to draw; a stub stands in for it), timed from start to exit. Branchy
  graphs (a node with two consumers) first go through PipeDream's `Graph.compress_branches`, as
  its README says, and both tools plan the compressed graph. Its printed "Time per stage in
  pipeline" is its optimum; its stages are read off the `stage_id` of each node of the graph it
  writes, its replication factors off its printed configuration.
- hetplan: `import pipedream --input-time zero` (PipeDream's optimizer zeroes the Input nodes),
  and dp with `--objective throughput` (`--max-replicas 1` for straight) on a cluster that
  states PipeDream's model: N V100s with memory to spare (PipeDream plans without its memory
  constraint by default), links so fast that pipeline transfers cost nothing (PipeDream counts
  them only with an activation compression ratio), and an all-reduce of 4 (r - 1) / r x bytes /
  10 GB/s among r replicas (PipeDream's data-parallel term), given as a calibration curve.

On that cluster hetplan's steady state (`CostModel.bottleneck_s`) is PipeDream's objective, and
the check column proves it: PipeDream's own plan, re-scored by hetplan, against the figure
PipeDream printed. gnmt is left out: PipeDream's optimizer drops its 20 `__getitem__` sinks, so
the two tools would not plan the same graph.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import write_results

from hetplan.cluster import AllreduceCurve, Calibration
from hetplan.cost import CostModel
from hetplan.io.clusters import cluster_from_spec
from hetplan.io.pipedream import import_pipedream
from hetplan.plan import Plan, Stage
from hetplan.planners import PlanOptions, make_plan

HERE = Path(__file__).resolve().parent
PROFILES = HERE.parent.parent / "shared" / "data" / "pipedream-profiles"
MODELS = ("alexnet", "vgg16", "resnet18", "resnet50", "squeezenet1_0")
STUB = ("class Digraph:\n    def __init__(self, *a, **k): pass\n"
        "    def __getattr__(self, name): return lambda *a, **k: None\n")
COMPRESS = ("import builtins, sys; builtins.xrange = range; sys.path.insert(0, sys.argv[1]); import graph\n"
            "g = graph.Graph.from_str(open(sys.argv[2]).read()); c = g.compress_branches(); g.check_fidelity(c)\n"
            "open(sys.argv[3], 'w').write(str(c))\n")


def pipedream_cluster(n: int, bandwidth_Bps: float):
    """N V100s as PipeDream's optimizer sees them (see the module's docstring)."""
    spec = {"devices": [{"id": f"gpu{i}", "type": "v100-16gb", "host": "box", "memory": "1PB"} for i in range(n)],
            "network": {"intra_host": {"bandwidth": "1PB/s", "latency": "0s"}}}
    cluster = cluster_from_spec(spec, f"pipedream-{n}")
    curves = tuple(AllreduceCurve(r, ((1e9, 4 * (r - 1) / r * 1e9 / bandwidth_Bps),)) for r in range(2, n + 1))
    return cluster.__class__(**{**cluster.__dict__, "calibration": Calibration("PipeDream's optimizer", curves)})


def branchy(path: Path) -> bool:
    edges = re.findall(r"^\t(\S+) -- \S+\s*$", path.read_text(), flags=re.M)
    return len(edges) != len(set(edges))


def run_pipedream(checkout: Path, graph_txt: Path, n: int, bandwidth: float, straight: bool, work: Path) -> dict:
    out = work / graph_txt.stem / f"out-{n}-{int(straight)}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "optimizer_graph_hierarchical.py", "-f", str(graph_txt), "-n", str(n), "-b", str(bandwidth),
           "-o", str(out), *(["--straight_pipeline"] if straight else [])]
    env = {**os.environ, "PYTHONPATH": str(work / "stub")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=checkout / "optimizer", env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"PipeDream's optimizer failed on {graph_txt} (n={n}): {proc.stderr.strip().splitlines()[-1]}")
    best = float(re.search(r"Time per stage in pipeline: (\S+)", proc.stdout)[1])
    config = proc.stdout.split("replication factor per stage:")[-1]
    replicas = [int(m[1]) for m in re.finditer(r"^\(\d+, \d+\) \S+ (\d+)$", config, flags=re.M)]
    stage_of = {m[1]: int(m[2]) for m in re.finditer(r"^(\S+) -- .* -- stage_id=(\d+)$",
                                                      (out / f"gpus={n}.txt").read_text(), flags=re.M)}
    return {"bottleneck_s": best, "seconds": seconds, "replicas": replicas, "stage_of": stage_of}


def pipedream_plan(graph, pd: dict) -> Plan:
    """PipeDream's answer as a hetplan plan: its stages in order, each on as many V100s as it said."""
    stages, first = [], 0
    for k, r in enumerate(pd["replicas"]):
        nodes = tuple(v for v in graph.topo_order if pd["stage_of"].get(v, 0) == k)
        stages.append(Stage(nodes, tuple(f"gpu{first + i}" for i in range(r))))
        first += r
    return Plan(tuple(stages), 1, "1f1b", "pipedream", "throughput")


def one(checkout: Path, graph_txt: Path, model: str, n: int, straight: bool, bandwidth: float, work: Path) -> dict:
    compressed = branchy(graph_txt)
    if compressed:
        target = work / f"{model}-compressed.txt"
        subprocess.run([sys.executable, "-c", COMPRESS, str(checkout), str(graph_txt), str(target)], check=True,
                       capture_output=True, timeout=900, env={**os.environ, "PYTHONPATH": str(work / "stub")})
        graph_txt = target
    pd = run_pipedream(checkout, graph_txt, n, bandwidth, straight, work)
    graph = import_pipedream(graph_txt, name=model, input_time="zero")
    cluster = pipedream_cluster(n, bandwidth)
    cost = CostModel(graph, cluster)
    options = PlanOptions(objective="throughput", max_replicas=1 if straight else None)
    plan = make_plan(graph, cluster, "dp", options)
    rescored = cost.bottleneck_s(pipedream_plan(graph, pd))
    dp_s = cost.bottleneck_s(plan)
    return {"model": model, "nodes": len(graph.nodes), "compressed": compressed, "devices": n,
            "pipeline": "straight" if straight else "replicated",
            "pipedream_bottleneck_s": pd["bottleneck_s"], "pipedream_s": pd["seconds"],
            "pipedream_replicas": pd["replicas"], "pipedream_rescored_s": rescored,
            "check": rescored / pd["bottleneck_s"] - 1,
            "dp_bottleneck_s": dp_s, "dp_s": plan.meta["planning_s"],
            "dp_replicas": [len(s.devices) for s in plan.stages], "dp_over_pipedream": dp_s / pd["bottleneck_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipedream", type=Path, required=True, help="a checkout of msr-fiddle/pipedream")
    parser.add_argument("--profiles", type=Path, default=PROFILES)
    parser.add_argument("--bandwidth", type=float, default=1e10, help="bytes/s (default: 10 GB/s)")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "pipedream_side_by_side.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "stub").mkdir()
        (work / "stub" / "graphviz.py").write_text(STUB)
        for model in args.models:
            for n in (4, 8):
                for straight in (True, False):
                    row = one(args.pipedream.resolve(), args.profiles / model / "graph.txt", model, n, straight,
                              args.bandwidth, work)
                    rows.append(row)
                    print(f"{model:>14} {n} {row['pipeline']:<10} "
                          f"PipeDream {row['pipedream_bottleneck_s'] * 1e3:9.3f} ms "
                          f"in {row['pipedream_s']:6.2f} s (re-scored {row['check']:+.1e}) | dp "
                          f"{row['dp_bottleneck_s'] * 1e3:9.3f} ms in {row['dp_s']:6.2f} s "
                          f"= {row['dp_over_pipedream']:.4f}x", flush=True)
    ratios = [r["dp_over_pipedream"] for r in rows]
    summary = {"runs": len(rows), "dp_never_worse": all(x <= 1 + 1e-9 for x in ratios),
               "median_ratio": statistics.median(ratios), "max_ratio": max(ratios),
               "max_check": max(abs(r["check"]) for r in rows), "cpus": os.cpu_count()}
    write_results(args.output, summary, rows)


if __name__ == "__main__":
    main()
