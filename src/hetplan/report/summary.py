"""Summaries of graphs, clusters and plans as plain, JSON-ready dicts (the `info --json` output)."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.graph import Graph
from hetplan.io.serde import plain, to_dict
from hetplan.plan import Estimate, Plan

GRAPH_FILE, CLUSTER_REF = "graph_file", "cluster_ref"  # what plan and compare record of their inputs
PAIRS_LISTED_UP_TO = 64  # devices; above, `links` lists only the pairs a cluster file sets


def graph_summary(graph: Graph) -> dict[str, Any]:
    largest = max(graph.nodes, key=lambda n: n.out_bytes)
    out_degree = {n.id: len(graph.successors(n.id)) for n in graph.nodes}
    return {
        "kind": "graph",
        "name": graph.name,
        "granularity": graph.meta.get("granularity"),
        "source": graph.source,
        "nodes": len(graph.nodes),
        "edges": len(graph.edges),
        "batch_size": graph.batch_size,
        "profiled_on": graph.profiled_on,
        "device_types": list(graph.device_types),
        "fwd_s_total": graph.fwd_s_total(),
        "bwd_s_total": graph.bwd_s_total(),
        "param_bytes_total": graph.param_bytes_total,
        "act_bytes_total": graph.act_bytes_total,
        "flops_total": sum(n.flops for n in graph.nodes),
        "largest_activation": {"node": largest.id, "op": largest.op, "bytes": largest.out_bytes},
        "input_nodes": [n.id for n in graph.nodes if n.is_input],
        "sources": list(graph.sources),
        "sinks": list(graph.sinks),
        "max_out_degree": max(out_degree.values()),
        "skip_edges": len(graph.skip_edges),
        "skip_edge_examples": [list(e) for e in graph.skip_edges[:5]],
        "ops": dict(sorted(Counter(n.op for n in graph.nodes).items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def cluster_summary(cluster: Cluster) -> dict[str, Any]:
    devices = []
    for d in cluster.devices:
        t = cluster.types[d.type]
        devices.append({
            "id": d.id, "type": d.type, "host": d.host, "mem_bytes": d.mem_bytes,
            "peak_flops": t.peak_flops, "peak_flops_fp16": t.peak_flops_fp16,
            "mem_bw_Bps": t.mem_bw_Bps, "usd_per_hour": d.usd_per_hour,
            "threads": d.threads, "binding": d.binding, "action_overhead_s": d.action_overhead_s,
            "step_overhead_s": d.step_overhead_s, "optimizer_points": [list(x) for x in d.optimizer_points],
        })
    # every pair of a small cluster; of a big one only the links set per pair (the rest follow
    # intra_host and inter_host): n^2/2 pairs of 1,024 devices took seconds and 700 MB to list
    pairs = itertools.combinations(cluster.ids, 2) if len(cluster.ids) <= PAIRS_LISTED_UP_TO else (
        o.between for o in cluster.links)
    links = []
    for a, b in pairs:
        link = cluster.link(a, b)
        links.append({"between": [a, b], "bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s})
    return {
        "kind": "cluster",
        "links_listed": "every pair" if len(cluster.ids) <= PAIRS_LISTED_UP_TO else "the links set per pair",
        "name": cluster.name,
        "devices": devices,
        "hosts": list(cluster.hosts),
        "usd_per_hour_total": sum(d.usd_per_hour for d in cluster.devices),
        "intra_host": {"bandwidth_Bps": cluster.intra_host.bandwidth_Bps, "latency_s": cluster.intra_host.latency_s},
        "inter_host": {"bandwidth_Bps": cluster.inter_host.bandwidth_Bps, "latency_s": cluster.inter_host.latency_s},
        "host_nic_Bps": {h: cluster.nic_Bps(h) for h in cluster.hosts},
        "links": links,
        "calibration": plain(cluster.calibration),
    }


def plan_summary(plan: Plan) -> dict[str, Any]:
    body = to_dict(plan)
    body.pop("schema_version")
    body["num_stages"] = len(plan.stages)
    return body


def estimate_summary(est: Estimate) -> dict[str, Any]:
    """The estimate as JSON values, with the busiest link and its utilisation."""
    body = to_dict(est)
    body.pop("schema_version")
    body.pop("kind", None)
    body["usd_per_1k_samples"] = est.usd_per_1k_samples
    peak = est.peak_link
    body["peak_link"] = None if peak is None else {
        "link": peak[0], "bytes": peak[1],
        "utilisation": est.link_busy_s.get(peak[0], 0.0) / est.step_s if est.step_s else 0.0,
    }
    return body


def input_refs(graph_ref: str, cluster_ref: str) -> dict[str, str]:
    """The graph file and cluster (a file's absolute path, or a preset's name) a plan or comparison
    was made from, recorded in it so that `hetplan report` can draw it again."""
    cluster = Path(cluster_ref)
    return {GRAPH_FILE: str(Path(graph_ref).resolve()),
            CLUSTER_REF: str(cluster.resolve()) if cluster.is_file() else cluster_ref}


def _counted_notes(graph: Graph, cluster: Cluster) -> list[str]:
    """A counted graph's (`hetplan.zoo.llm`) times rest on an achieved fraction of each type's
    peak that was measured on one GPU only: said, with the types it is assumed for."""
    fraction = graph.meta.get("achieved_fraction")
    if graph.source != "analytic" or fraction is None:
        return []
    types = ", ".join(sorted({d.type for d in cluster.devices}))
    return [f"graph '{graph.name}' is counted, not measured: its {graph.precision} times assume every GPU ({types}) "
            f"reaches {fraction} of its {graph.precision} peak, as the counted blocks did on one H200 "
            "(BENCHMARKS.md); profile a block on your GPUs (hetplan profile MODEL --granularity block --precision "
            f"{graph.precision}) to measure it"]


def estimate_notes(graph: Graph, cluster: Cluster, cluster_ref: str | None = None) -> list[str]:
    """What a prediction on this graph and cluster rests on that was not measured: the device
    types whose times are projected (a graph profiled on cpu-2t and planned on cpu-1t workers is
    otherwise silently a guess), and a cluster of real workers that was not calibrated. Said by
    the commands after they succeed and shown on the report page."""
    notes = _counted_notes(graph, cluster)
    projected = CostModel(graph, cluster).projected_types()
    if projected:
        pairs = ", ".join(f"{target} (from {source})" for target, source in projected.items())
        notes.append(f"graph '{graph.name}' has no times measured on {pairs}: they are projected by the "
                     "roofline model; profile on those devices to measure them")
    if cluster.calibration is None and any(d.binding is not None for d in cluster.devices):
        notes.append(f"cluster '{cluster.name}' is not calibrated: the prediction uses catalog figures for its "
                     "links, all-reduces and optimizer steps and no runtime costs; run `hetplan calibrate "
                     f"--cluster {cluster_ref or cluster.name} -o cal.json` and pass --cluster cal.json")
    return notes
