"""How far the roofline projection is from a measurement.

Profiles each model on 1 and 2 CPU threads in one run, then projects every node's time from
cpu-1t to cpu-2t with `hetplan.cost.projection` (the cost model's rule for a device type a graph was
not profiled on) and compares with the times measured on cpu-2t: per node (median absolute
relative error, weighted by time) and for the whole model (sum of nodes).

    .venv/bin/python bench/projection_error.py [--out bench/results/projection_error.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hetplan import catalog
from hetplan.cost import CostModel
from hetplan.graph import Graph
from hetplan.io.clusters import load_cluster
from hetplan.profile import profile_step
from hetplan.zoo import load_model

CASES = [("gpt2", {"batch_size": 4, "seq_len": 128}), ("resnet50", {"batch_size": 8}),
         ("bert-base", {"batch_size": 4, "seq_len": 128})]


def only(graph: Graph, dtype: str) -> Graph:
    """The graph as if it had been profiled on `dtype` alone."""
    from dataclasses import replace

    nodes = tuple(replace(n, fwd_s={dtype: n.fwd_s[dtype]}, bwd_s={dtype: n.bwd_s[dtype]}) for n in graph.nodes)
    return replace(graph, nodes=nodes, profiled_on=dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/projection_error.json"))
    args = parser.parse_args()
    cluster = load_cluster("local")
    rows = []
    for name, kw in CASES:
        zm = load_model(name, **kw)
        g = profile_step(zm.step, zm.batch, name=name, devices=["cpu:1", "cpu:2"]).graph
        projected = CostModel(only(g, "cpu-1t"), cluster)._node_times_s("cpu-2t")
        errors, weights = [], []
        for n in g.nodes:
            measured = n.fwd_s["cpu-2t"] + n.bwd_s["cpu-2t"]
            if measured > 1e-4:
                errors.append(abs(sum(projected[n.id]) - measured) / measured)
                weights.append(measured)
        total_measured = g.fwd_s_total("cpu-2t") + g.bwd_s_total("cpu-2t")
        total_projected = sum(f + b for f, b in projected.values())
        total_1t = g.fwd_s_total("cpu-1t") + g.bwd_s_total("cpu-1t")
        row = {"model": name, **kw, "nodes": len(g.nodes), "sum_1t_s": total_1t, "sum_2t_measured_s": total_measured,
               "sum_2t_projected_s": total_projected,
               "total_rel_error": (total_projected - total_measured) / total_measured,
               "measured_speedup_2t": total_1t / total_measured,
               "node_median_abs_rel_error": statistics.median(errors),
               "node_time_weighted_abs_rel_error":
                   sum(e * w for e, w in zip(errors, weights, strict=True)) / sum(weights)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"cpu_flops_per_thread": catalog.CPU_FLOPS_PER_THREAD, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
