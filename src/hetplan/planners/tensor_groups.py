"""Tensor parallelism for every planner: plan on the cluster with its devices grouped.

A grouping cuts the devices of each host and type into tensor-parallel groups (`hetplan.tp`).
On the grouped problem each group is one device: its type is the base type times t (t times its
memory, price and peak rate), and the grouped graph gives that type each node's time on the
group (`hetplan.cost.tensor.node_tp_times_s`: the part that scales with the samples 1/t where the
node splits, plus its all-reduces) and the base types' times as the cost model has them. Any
planner plans the grouped problem as it plans any other; its plan, each group's device put
back as the group, is scored by the simulator on the real problem, and the best plan of all
groupings wins, the plan of the ungrouped problem among them: never worse than without.

Which groupings: per class of devices (one host, one type) of n devices, every way to cut n
into groups of the degrees the graph allows (2 .. --max-tp, dividing some node's `tp_units`)
and single devices, when all classes' ways multiply to at most MAX_GROUPINGS; otherwise every
device of a type in groups of one degree (leftovers of a host single), chosen a type at a time:
each degree of the first type, the best kept, then each of the next, and so on (types x degrees
plans in all, not every combination). The grouped
problem's memory is approximate (t times a device's, where only the weights split): the
simulator's estimate on the real problem decides what fits. A stage's replicas may be groups of
unlike degrees (the A100s of a host one by one beside the V100s of another as one group).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from hetplan.cluster import Cluster, Device
from hetplan.cost import CostModel
from hetplan.cost.stage_table import StageTable
from hetplan.errors import HetplanError
from hetplan.graph import Graph
from hetplan.plan import Plan, plan_problems
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer

MAX_GROUPINGS = 64
Grouping = tuple[tuple[str, ...], ...]  # the groups of two devices or more


def degrees(graph: Graph, max_tp: int) -> tuple[int, ...]:
    """The degrees from 2 to `max_tp` that split some node evenly."""
    units = {n.tp_units for n in graph.nodes if n.tp_units}
    return tuple(t for t in range(2, max_tp + 1) if any(u % t == 0 for u in units))


def type_degrees(graph: Graph, cluster: Cluster, max_tp: int | None) -> dict[str, tuple[int, ...]]:
    """Per device type, the tensor-parallel degrees a stage on it may take: those of `degrees`
    up to the most devices of the type on one host, and up to `max_tp`; with `max_tp` None (the
    default, "auto"), GPU types only (a group of CPU workers is slower than one: BENCHMARKS.md)."""
    per_host: dict[str, int] = {}
    for (_, t), ids in _classes(cluster).items():
        per_host[t] = max(per_host.get(t, 0), len(ids))
    out = {}
    for t, most in per_host.items():
        if max_tp is None and cluster.types[t].kind != "gpu":
            continue
        cap = most if max_tp is None else min(most, max_tp)
        out[t] = degrees(graph, cap) if cap > 1 else ()
    return out


def check_max_tp(graph: Graph, max_tp: int | None) -> None:
    """`--max-tp` above 1 on a graph that cannot split: one line that says why and what to do."""
    if max_tp is None or max_tp == 1 or degrees(graph, max_tp):
        return
    if all(n.tp_units is None for n in graph.nodes):
        raise HetplanError(f"--max-tp {max_tp}: graph {graph.name!r} does not say how its nodes split tensor-parallel "
                           "(no node has tp_units); profile the model again (hetplan profile records it), or add "
                           "\"tp_units\" to its transformer blocks in the graph file (their heads and MLP units' "
                           "greatest common divisor)")
    most = max((n.tp_units or 0) for n in graph.nodes)
    raise HetplanError(f"--max-tp {max_tp}: no node of graph {graph.name!r} splits into 2 to {max_tp} equal parts "
                       f"(the most ways a node splits: {most}); use --max-tp 1 or a degree that divides its nodes' "
                       "heads and MLP units")


def _cuts(n: int, allowed: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The multisets of group sizes (from `allowed`, largest first) that fit in n devices (the rest single)."""
    out: list[tuple[int, ...]] = [()]
    for t in sorted(allowed, reverse=True):
        out = [c + (t,) * j for c in out for j in range((n - sum(c)) // t + 1)]
    return out


def _classes(cluster: Cluster) -> dict[tuple[str, str], list[str]]:
    classes: dict[tuple[str, str], list[str]] = {}
    for d in cluster.devices:
        classes.setdefault((d.host, d.type), []).append(d.id)
    return classes


def _groups(ids: list[str], sizes: tuple[int, ...]) -> tuple[tuple[str, ...], ...]:
    out, at = [], 0
    for t in sizes:
        out.append(tuple(ids[at:at + t]))
        at += t
    return tuple(out)


def small_groupings(graph: Graph, cluster: Cluster, max_tp: int) -> list[Grouping] | None:
    """Every grouping of a small cluster but the one without groups, or None where there are
    more than MAX_GROUPINGS (see the module's docstring)."""
    allowed = degrees(graph, max_tp)
    classes = _classes(cluster)
    per_class = [_cuts(len(ids), allowed) for ids in classes.values()]
    if _product(len(c) for c in per_class) > MAX_GROUPINGS:
        return None
    picks = itertools.product(*per_class)
    found = [tuple(g for ids, sizes in zip(classes.values(), pick, strict=True) for g in _groups(ids, sizes))
             for pick in picks]
    return [g for g in found if g]


def by_type(cluster: Cluster, degree: dict[str, int]) -> Grouping:
    """Every device of each type in groups of its type's degree, host by host (leftovers single)."""
    return tuple(g for (_, t), ids in _classes(cluster).items() if degree.get(t, 1) > 1
                 for g in _groups(ids, (degree[t],) * (len(ids) // degree[t])))


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def grouped(graph: Graph, cluster: Cluster, grouping: Grouping, cost: CostModel) -> tuple[Graph, Cluster]:
    """The problem with each group of `grouping` as one device (named as its first device)."""
    group_of = {g[0]: g for g in grouping}
    dropped = {d for g in grouping for d in g[1:]}
    types = dict(cluster.types)
    virtual: dict[str, tuple[str, tuple[str, ...]]] = {}  # name -> (base type, an example group)
    devices = []
    for d in cluster.devices:
        if d.id in dropped:
            continue
        group = group_of.get(d.id)
        if group is None:
            devices.append(d)
            continue
        t, base = len(group), cluster.types[d.type]
        name = f"{d.type}*{t}"
        if name not in virtual:
            virtual[name] = (d.type, group)
            types[name] = replace(base, name=name, peak_flops=base.peak_flops * t,
                                  peak_flops_fp16=base.peak_flops_fp16 * t, mem_bytes=base.mem_bytes * t,
                                  mem_bw_Bps=base.mem_bw_Bps * t, usd_per_hour=base.usd_per_hour * t)
        devices.append(Device(d.id, name, d.host, d.mem_bytes * t, d.usd_per_hour * t, d.threads, d.binding,
                              d.action_overhead_s, d.step_overhead_s, d.optimizer_points))
    used = {d.type for d in devices}
    plain = sorted(t for t in used if t not in virtual)
    # each node's passes on each type, and on each group (`StageTable.raw_passes_s` of a one-node stage)
    table = StageTable.of_chain(cost)
    at = np.arange(len(table.order))
    kinds = {**{t: table.type_kind(t) for t in plain}, **{name: table.kind(g) for name, (_, g) in virtual.items()}}
    passes = {name: np.array(table.raw_passes_s(kind, at, at + 1)[:4]) for name, kind in kinds.items()}
    nodes = []
    for n in graph.nodes:
        k = table.order.index(n.id)
        per = {name: p[:, k] for name, p in passes.items()}
        nodes.append(replace(n, fwd_s={t: float(v[0]) for t, v in per.items()},
                             bwd_s={t: float(v[1]) for t, v in per.items()},
                             fwd_fixed_s={t: float(v[2]) for t, v in per.items()},
                             bwd_fixed_s={t: float(v[3]) for t, v in per.items()},
                             opt_s={t: v for t, v in n.opt_s.items() if t in plain}))
    profiled = plain[0] if plain else next(iter(virtual))
    return (replace(graph, nodes=tuple(nodes), profiled_on=profiled),
            replace(cluster, devices=tuple(devices), types={t: types[t] for t in used}))


def ungrouped(plan: Plan, grouping: Grouping) -> Plan:
    """The grouped problem's plan on the real devices: each stage's groups as its replicas (a
    group's stage recomputing whole where it recomputed per block: `plan._tp_problems`)."""
    group_of = {g[0]: g for g in grouping}
    stages = []
    for st in plan.stages:
        groups = tuple(group_of.get(d, (d,)) for d in st.devices)
        t = max(map(len, groups))
        recompute = "stage" if t > 1 and st.recompute in ("block", "selective") else st.recompute
        stages.append(replace(st, tp=t, tp_devices=groups if t > 1 else (), shard=st.shard if t == 1 else 0,
                              recompute=recompute))
    return replace(plan, stages=tuple(stages), predicted=None)


def with_tensor_groups(run: Callable[[Graph, Cluster, PlanOptions], Plan], graph: Graph, cluster: Cluster,
                       options: PlanOptions) -> Plan:
    """The best of `run`'s plans on the problem as it is and on each grouping (module docstring),
    where the user asked for tensor parallelism (`--max-tp N`, N > 1); by default (`max_tp`
    None) the planner's plan as it is (dp and the per-type program weigh tensor-parallel groups
    themselves, `type_degrees`)."""
    check_max_tp(graph, options.max_tp)
    if options.max_tp is None:
        return run(graph, cluster, options)
    flat = replace(options, max_tp=1)
    best = run(graph, cluster, flat)
    if options.max_tp == 1:
        return best
    search = _Search(run, graph, cluster, flat, best)
    small = small_groupings(graph, cluster, options.max_tp)
    if small is not None:
        for grouping in small:
            search.consider(grouping)
    else:  # one degree per type, a type at a time, each keeping the others' best so far
        chosen: dict[str, int] = {}
        for t in sorted({d.type for d in cluster.devices}):
            for degree in degrees(graph, options.max_tp):
                if search.consider(by_type(cluster, {**chosen, t: degree})):
                    chosen[t] = degree
    return replace(search.best, meta={**search.best.meta, "tp_groupings": search.tried})


class _Search:
    """The best plan so far, on the real problem, of the groupings considered."""

    def __init__(self, run, graph: Graph, cluster: Cluster, options: PlanOptions, best: Plan) -> None:
        self.run, self.graph, self.cluster, self.options = run, graph, cluster, options
        self.scorer, self.cost = Scorer(graph, cluster, options), CostModel(graph, cluster)
        self.best, self.value, self.tried = best, self.scorer.value(best), 0

    def consider(self, grouping: Grouping) -> bool:
        """Plan on the grouping; whether its plan is the best so far."""
        if not grouping:
            return False
        try:
            plan = ungrouped(self.run(*grouped(self.graph, self.cluster, grouping, self.cost), self.options), grouping)
        except HetplanError:  # the grouped problem has no plan (too few devices for the planner)
            return False
        self.tried += 1
        if plan_problems(plan, self.graph, self.cluster):
            return False
        value = self.scorer.value(plan)
        if value < self.value:
            self.best, self.value = plan, value
            return True
        return False
