"""Random plans: the starting points of search, and the sample over which the fast path is held
against the event simulator.

A random plan cuts a topological order of the graph into consecutive pieces (always convex and
in pipeline order, see `hetplan.planners.baselines`), gives each piece one or more devices that
no other piece uses, and draws the number of micro-batches and the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetplan.cluster import Cluster
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import cluster_from_spec
from hetplan.plan import Plan, Stage
from hetplan.schedule import ONE_STAGE_PER_RANK


def random_plan(graph: Graph, cluster: Cluster, rng: np.random.Generator, *, stages: int | None = None,
                max_replicas: int = 1, microbatches: Sequence[int] = (1, 2, 4, 8, 16),
                schedules: Sequence[str] = ONE_STAGE_PER_RANK) -> Plan:
    """A random valid plan; `stages` None draws it from 1 .. min(nodes, devices)."""
    order = graph.topo_order
    most = min(len(order), len(cluster.devices))
    k = int(rng.integers(1, most + 1)) if stages is None else min(stages, most)
    cuts = sorted(rng.choice(np.arange(1, len(order)), size=k - 1, replace=False).tolist()) if k > 1 else []
    bounds = [0, *cuts, len(order)]
    pool = [cluster.ids[i] for i in rng.permutation(len(cluster.ids))]
    spare = len(pool) - k
    plan_stages = []
    for i in range(k):
        extra = int(rng.integers(0, min(max_replicas - 1, spare) + 1)) if spare > 0 else 0
        spare -= extra
        devices, pool = pool[:1 + extra], pool[1 + extra:]
        plan_stages.append(Stage(order[bounds[i]:bounds[i + 1]], tuple(devices)))
    fitting = [m for m in microbatches if m <= graph.batch_size] or [1]
    return Plan(tuple(plan_stages), int(rng.choice(fitting)), str(rng.choice(list(schedules))), "random")


def random_problem(rng: np.random.Generator, max_nodes: int = 12, max_devices: int = 4,
                   max_types: int = 2) -> tuple[Graph, Cluster]:
    """A small random planning problem: a chain or a branchy DAG (forks of two or three branches
    joined again, as in Inception or ResNet) with node times on every device type (the second
    type 1.2-4x slower, varying by node), parameters, stashed activations and tensor sizes; and
    a cluster of 2 to `max_devices` devices of 1 to `max_types` types on one or two hosts, whose
    memory is sometimes too small for the whole model."""
    types = [str(t) for t in rng.choice(["v100-16gb", "t4-16gb", "a100-40gb", "l4-24gb"],
                                        size=int(rng.integers(1, max_types + 1)), replace=False)]
    slowdown = {types[0]: 1.0}
    for t in types[1:]:
        slowdown[t] = float(rng.uniform(1.2, 4.0))
    n_target = int(rng.integers(3, max_nodes + 1))
    nodes: list[Node] = []
    edges: list[Edge] = []
    branchy = bool(rng.integers(0, 2))

    def new_node() -> str:
        nid = f"n{len(nodes)}"
        t = float(rng.uniform(1e-3, 20e-3))
        fwd = {ty: t * s * float(rng.uniform(0.8, 1.25)) for ty, s in slowdown.items()}
        nodes.append(Node(nid, "Linear", fwd, {ty: 2 * v for ty, v in fwd.items()},
                          param_bytes=int(rng.integers(0, 2**28)), act_bytes=int(rng.integers(0, 2**29)),
                          out_bytes=int(rng.integers(2**16, 2**26))))
        return nid

    def edge(a: str, b: str) -> None:
        edges.append(Edge(a, b, nodes[int(a[1:])].out_bytes))

    last = new_node()
    while len(nodes) < n_target:
        room = n_target - len(nodes)
        if branchy and room >= 3 and rng.random() < 0.6:
            width = int(rng.integers(2, 4))
            ends = []
            for _ in range(width):
                if len(nodes) >= n_target - 1:
                    break
                length = int(rng.integers(1, 3))
                prev = last
                for _ in range(length):
                    if len(nodes) >= n_target - 1:
                        break
                    cur = new_node()
                    edge(prev, cur)
                    prev = cur
                ends.append(prev)
            join = new_node()
            for end in ends:
                edge(end, join)
            last = join
        else:
            cur = new_node()
            edge(last, cur)
            last = cur
    graph = Graph("random", tuple(nodes), tuple(edges), batch_size=int(rng.choice([8, 16, 32, 64])),
                  profiled_on=types[0])
    k = int(rng.integers(2, max_devices + 1))
    hosts = int(rng.integers(1, 3))
    need = 4 * graph.param_bytes_total + sum(n.act_bytes for n in nodes)
    devices = []
    for i in range(k):
        t = types[i % len(types)] if i < len(types) else types[int(rng.integers(0, len(types)))]
        mem = max(2**30, int(need * float(rng.uniform(0.3, 1.5))))
        devices.append({"id": f"d{i}", "type": t, "host": f"h{i % hosts}", "memory": mem})
    spec = {"name": "random", "devices": devices,
            "network": {"intra_host": {"bandwidth": f"{int(rng.integers(5, 100))}GB/s", "latency": "5us"},
                        "inter_host": {"bandwidth": f"{int(rng.integers(1, 25))}Gbit/s", "latency": "30us"}}}
    return graph, cluster_from_spec(spec, "random")


def synthetic_graph(n_nodes: int, rng: np.random.Generator, device_type: str = "v100-16gb",
                    batch_size: int = 64) -> Graph:
    """A large model-like graph: residual blocks (three nodes and a skip connection around them,
    as in ResNet) and now and then an Inception-like fork of three branches, with node times of
    0.1-2 ms, parameters up to 16 MB, activations up to 64 MB and FLOPs in proportion to time
    (so projection to other device types works)."""
    nodes: list[Node] = []
    edges: list[Edge] = []

    def new_node(op: str) -> str:
        nid = f"n{len(nodes)}"
        t = float(rng.uniform(1e-4, 2e-3))
        out = int(rng.integers(2**18, 2**24))
        nodes.append(Node(nid, op, {device_type: t}, {device_type: 2 * t}, flops=t * 5e12,
                          param_bytes=int(rng.integers(0, 2**24)), out_bytes=out,
                          act_bytes=int(rng.integers(2**20, 2**26))))
        return nid

    def edge(a: str, b: str) -> None:
        edges.append(Edge(a, b, nodes[int(a[1:])].out_bytes))

    last = new_node("Input")
    while len(nodes) < n_nodes:
        room = n_nodes - len(nodes)
        if room >= 5 and rng.random() < 0.15:  # fork of three branches, joined
            ends = []
            for _ in range(3):
                b = new_node("Conv2d")
                edge(last, b)
                ends.append(b)
            join = new_node("Cat")
            for b in ends:
                edge(b, join)
            last = join
        elif room >= 4:  # residual block
            a = new_node("Conv2d")
            b = new_node("Conv2d")
            c = new_node("Conv2d")
            add = new_node("Add")
            edge(last, a)
            edge(a, b)
            edge(b, c)
            edge(c, add)
            edge(last, add)
            last = add
        else:
            cur = new_node("Linear")
            edge(last, cur)
            last = cur
    return Graph(f"synthetic-{n_nodes}", tuple(nodes), tuple(edges), batch_size=batch_size, profiled_on=device_type)


def synthetic_cluster(devices: int, types: tuple[str, ...] = ("a100-40gb", "v100-32gb", "t4-16gb")) -> Cluster:
    """`devices` devices spread evenly over `types`, four to a host."""
    spec_devices = [{"id": f"g{i}", "type": types[i % len(types)], "host": f"h{i // 4}"} for i in range(devices)]
    return cluster_from_spec({"name": f"synthetic-{devices}", "devices": spec_devices,
                              "network": {"intra_host": {"bandwidth": "50GB/s", "latency": "5us"},
                                          "inter_host": {"bandwidth": "25Gbit/s", "latency": "50us"}}},
                             f"synthetic-{devices}")
