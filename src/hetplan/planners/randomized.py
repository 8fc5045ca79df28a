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
from hetplan.graph import Graph
from hetplan.plan import SCHEDULES, Plan, Stage


def random_plan(graph: Graph, cluster: Cluster, rng: np.random.Generator, *, stages: int | None = None,
                max_replicas: int = 1, microbatches: Sequence[int] = (1, 2, 4, 8, 16),
                schedules: Sequence[str] = SCHEDULES) -> Plan:
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
