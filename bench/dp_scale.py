"""dp on big clusters: planning time and memory at 8-64 devices, monotonicity in
devices, and what the 160-state limit costs.

    .venv/bin/python bench/dp_scale.py [-o bench/results/dp_scale.json]

Clusters: 1, 2, 4 and 8 hosts of 8 devices (even hosts V100, odd hosts T4; 10 Gbit/s between
hosts), each containing the one before. Graphs: resnet50 (PipeDream's profile) and gpt2
(`bench/results/gpt2-b8-s128-block.json`, profiled on this machine's CPU, projected to the GPUs).
Each dp run is a process of its own (`make_plan(..., "dp")`, time objective), timed, with its
peak memory (ru_maxrss). Monotone: on each cluster, every smaller cluster's plan is re-scored by
the event simulator; dp's plan must be no slower. The state limit: resnet50 on 8 devices with
dp's 160 cut states and with all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hetplan.io import serde
from hetplan.io.clusters import cluster_from_spec
from hetplan.io.pipedream import import_pipedream
from hetplan.planners import PlanOptions
from hetplan.planners.dp import dp_candidates
from hetplan.planners.scoring import Scorer
from hetplan.sim import simulate

HERE = Path(__file__).resolve().parent
PROFILES = HERE.parent.parent / "shared" / "data" / "pipedream-profiles"
RUN = """
import json, resource, sys, time
from hetplan.io import serde
from hetplan.planners import PlanOptions, make_plan
graph, cluster = serde.load(sys.argv[1]), serde.load(sys.argv[2])
options = PlanOptions(**json.loads(sys.argv[3]))
start = time.perf_counter()
plan = make_plan(graph, cluster, "dp", options)
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_mib": resource.getrusage(
    resource.RUSAGE_SELF).ru_maxrss / 1024, "plan": serde.to_dict(plan)}))
"""


def cluster_of(hosts: int):
    devices = [{"id": f"h{h}", "type": "v100-16gb" if h % 2 == 0 else "t4-16gb", "host": f"h{h}", "count": 8}
               for h in range(hosts)]
    return cluster_from_spec({"devices": devices, "network": {"inter_host": {"bandwidth": "10Gbit/s"}}},
                             f"{hosts * 8}-devices")


class DpFailed(SystemExit):
    """dp's process ended with an error. A SystemExit, so that scripts which do not catch it stop
    with dp's message; `bench/llm_deep.py` catches it and goes on with the next problem."""


def run_dp(graph_file: Path, cluster, tmp: Path, timeout_s: float = 3600, options: dict | None = None) -> dict:
    """dp (`make_plan(..., "dp")` with `PlanOptions(**options)`, the defaults unless given) in a
    process of its own: its wall seconds, peak memory (ru_maxrss) and plan. Raises
    `subprocess.TimeoutExpired` (the process killed) past `timeout_s`, and `DpFailed` with the
    last line dp wrote to stderr if it fails."""
    cluster_file = tmp / f"{cluster.name}.json"
    serde.dump(cluster, cluster_file)
    out = subprocess.run([sys.executable, "-c", RUN, str(graph_file), str(cluster_file), json.dumps(options or {})],
                         capture_output=True,
                         text=True, timeout=timeout_s, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode != 0:
        # a process killed by the kernel (out of memory) writes nothing: say how it ended
        lines = out.stderr.strip().splitlines()
        raise DpFailed(lines[-1] if lines else f"dp's process ended with status {out.returncode}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["plan"] = serde.from_dict(result["plan"])
    return result


def state_limit(graph) -> dict:
    cluster = cluster_of(1)
    options = PlanOptions()
    out = {}
    for label, limit in (("160 states", 160), ("all states", 10**9)):
        scorer = Scorer(graph, cluster, options)
        import time
        start = time.perf_counter()
        plans, meta = dp_candidates(graph, cluster, options, scorer, max_states=limit)
        best = scorer.best(plans, "dp")
        out[label] = {"seconds": time.perf_counter() - start, "step_s": scorer.estimate(best).step_s,
                      "states_used": meta["states_used"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", nargs="*", type=int, default=[1, 2, 4, 8])
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "dp_scale.json")
    args = parser.parse_args()
    graphs = {"resnet50": import_pipedream(PROFILES / "resnet50" / "graph.txt"),
              "gpt2": serde.load(HERE / "results" / "gpt2-b8-s128-block.json")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, graph in graphs.items():
            graph_file = Path(tmp) / f"{name}.json"
            serde.dump(graph, graph_file)
            earlier = []
            for hosts in args.hosts:
                cluster = cluster_of(hosts)
                result = run_dp(graph_file, cluster, Path(tmp))
                step = simulate(graph, cluster, result["plan"], timeline=False).estimate.step_s
                smaller = [simulate(graph, cluster, p, timeline=False).estimate.step_s for p in earlier]
                row = {"graph": name, "devices": len(cluster.devices), "seconds": result["seconds"],
                       "peak_rss_mib": result["peak_rss_mib"], "step_s": step,
                       "stages": len(result["plan"].stages),
                       "replicas": [len(s.devices) for s in result["plan"].stages],
                       "smaller_plans_step_s": smaller, "monotone": all(step <= s * (1 + 1e-9) for s in smaller)}
                rows.append(row)
                earlier.append(result["plan"])
                print(f"{name:>9} {row['devices']:3d} devices: {row['seconds']:6.1f} s, "
                      f"{row['peak_rss_mib']:5.0f} MiB, "
                      f"step {step * 1e3:7.2f} ms ({row['stages']} stages); smaller clusters' plans here: "
                      + ", ".join(f"{s * 1e3:.2f}" for s in smaller) + f" ms; monotone: {row['monotone']}", flush=True)
    limit = state_limit(graphs["resnet50"])
    print(json.dumps(limit))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"rows": rows, "state_limit_resnet50_8": limit, "cpus": os.cpu_count()},
                                      indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
