"""`heterps`: schedule layers to resource types with RL, then provision devices (HeterPS).

Liu et al., "HeterPS: Distributed Deep Learning With Reinforcement Learning Based Scheduling in
Heterogeneous Environments" (2021/2023). Two steps:

1. **Scheduling.** An LSTM policy reads the units (runs of layers, as in `PlanEnv`) in order and
   picks a resource *type* for each (CPU, T4, V100, A100, ...); types whose one device cannot
   hold a unit's weights, gradients and optimizer state are masked out. Consecutive units of one
   type form a stage, so every choice is a valid pipeline and no repair is needed. Trained with
   REINFORCE and a moving-average baseline, the reward being -log(value / v_ref) (value: the
   objective, `cost` by default; v_ref the value of running on every device at the reference
   time). The logarithm keeps a plan 10% cheaper worth as much whatever the price scale, and
   keeps the penalties of plans that need more devices of a type than there are from drowning
   the differences between plans that fit.
2. **Provisioning.** Each stage starts with one device of its type; while the throughput is
   below the user's floor (objective `cost`) or the step still gets shorter (objective `time`),
   the stage with the longest per-replica busy time (its compute over its replicas, plus its
   all-reduce and optimizer step) gets one more device of its type, while there are devices of
   that type left. HeterPS computes these counts from its cost model in the same spirit: the
   fewest resources per stage that meet the throughput constraint. Every provisioned plan is
   scored by the fast path at each allowed number of micro-batches, and the final candidates by
   the event simulator.

By default the run is warm: dp's plan and every all-one-type configuration are candidates, and
the policy's logits start biased towards the types of dp's stages; `faithful` is the cold
set-up. `all_one_type` gives, for one
type, the provisioned plan that puts every layer on that type (HeterPS's comparison: the
cheapest single-type configuration that meets the floor).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from hetplan.cluster import Cluster
from hetplan.cost.stage_table import StageTable, prefix_states
from hetplan.graph import Graph
from hetplan.plan import Plan, Stage
from hetplan.planners import objectives
from hetplan.planners.dp import warm_start
from hetplan.planners.kit import WARM_NATS, Budget, learn_budget_s, microbatch_choices
from hetplan.planners.options import PlanOptions
from hetplan.planners.rl.env import unit_starts
from hetplan.planners.rl.features import hierarchical_features
from hetplan.planners.rl.loop import (
    KEEP,
    Advantages,
    Iterations,
    LearnConfig,
    finish,
    reinforce_step,
    seeded_torch,
    thin,
)
from hetplan.planners.scoring import Scorer

# HeterPS's REINFORCE: 8 samples a batch, Adam at 3e-3, a baseline decaying by 0.9, reward
# -log(value / v_ref), and (warm) a bias of WARM_NATS towards dp's types fading over half the run
LEARN = LearnConfig("reinforce", batch=8, lr=3e-3, baseline_decay=0.9, reward="neg_log", warm_nats=WARM_NATS)


class TypePolicy(nn.Module):
    """LSTM over the units in order; each unit's hidden state scores the resource types."""

    def __init__(self, n_in: int, types: int, hidden: int = 64) -> None:
        super().__init__()
        self.lstm = nn.LSTM(n_in, hidden, batch_first=True)
        self.head = nn.Linear(hidden, types)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.unsqueeze(0))
        return self.head(out[0])  # (U, types)


class Provisioner:
    """Turns a type per unit into a provisioned plan and scores it (memoised by the type runs)."""

    def __init__(self, graph: Graph, cluster: Cluster, options: PlanOptions, starts: np.ndarray) -> None:
        self.graph, self.cluster, self.options, self.starts = graph, cluster, options, starts
        self.order = graph.topo_order
        self.types = sorted({d.type for d in cluster.devices})
        # devices of a type in the order they are given out: the roomiest first
        self.pool = {t: [d.id for d in sorted(cluster.devices, key=lambda d: -d.mem_bytes) if d.type == t]
                     for t in self.types}
        self.scorer = Scorer(graph, cluster, options)  # mdpe, and the final choice, by the event simulator
        self.cost, self.t_ref_s = self.scorer.cost, self.scorer.t_ref_s
        self.m_choices = microbatch_choices(graph, options)
        self.table = StageTable(self.cost, prefix_states(len(self.order)), self.order)  # states: prefixes of the order
        # the objective's scale: every device busy for the reference time (cost), or that time
        usd_per_hour = sum(d.usd_per_hour for d in cluster.devices)
        self.scale = objectives.objective(options).lower(self.t_ref_s, self.t_ref_s, usd_per_hour, graph.batch_size,
                                                         options, self.t_ref_s)
        self.cache: dict[tuple, tuple[float, Plan | None, bool]] = {}
        self.evaluations = 0

    def _fast(self, plans: list[Plan]) -> list[tuple[float, bool, Plan]]:
        """Objective value (finite; see PlanEnv) and feasibility of plans, by the fast path for time
        and cost; mdpe needs the busiest link's share, which the fast path does not give for
        replicated stages, so it is the event simulator's (and throughput's, which needs the
        replicated stages' all-reduce)."""
        if objectives.objective(self.options).event_only:  # counted in the scorer's simulations
            return [(self.scorer.search_value(p), math.isfinite(self.scorer.value(p)), p) for p in plans]
        self.evaluations += len(plans)
        steps = self.scorer.fast_step_s(plans)
        out = []
        opts, batch = self.options, self.graph.batch_size
        for plan, step in zip(plans, steps, strict=True):
            over = 0.0
            for k, st in enumerate(plan.stages):
                for d in st.devices:
                    need = self.cost.stage_memory_bytes(plan, k, d)
                    over = max(over, need / self.cluster.device(d).mem_bytes - 1.0)
            devices = [d for st in plan.stages for d in st.devices]
            usd = self.cost.usd_per_step(devices, float(step))
            base = objectives.objective(opts).base(float(step), usd, math.nan, math.nan, math.nan, batch, opts,
                                                   self.t_ref_s)  # time or cost: no link, memory or steady state
            short = float(objectives.shortfall(batch / max(float(step), 1e-300), opts))
            out.append((float(objectives.penalised(base, over, short)), over == 0.0 and short == 0.0, plan))
        return out

    def runs(self, types: np.ndarray) -> list[tuple[int, int, int]]:
        """Stages as (first unit, last unit + 1, type index): maximal runs of one type."""
        out, start = [], 0
        for u in range(1, len(types) + 1):
            if u == len(types) or types[u] != types[start]:
                out.append((start, u, int(types[start])))
                start = u
        return out

    def _plan(self, runs, counts, m: int) -> Plan | None:
        used = {t: 0 for t in self.types}
        stages = []
        for (lo, hi, t), k in zip(runs, counts, strict=True):
            name = self.types[t]
            devs = self.pool[name][used[name]:used[name] + k]
            if len(devs) < k:
                return None
            used[name] += k
            stages.append(Stage(self.order[self.starts[lo]:self.starts[hi]], tuple(devs)))
        return Plan(tuple(stages), m, self.options.schedule, "heterps", objective=self.options.objective)

    def _best_m(self, runs, counts) -> tuple[float, bool, Plan] | None:
        plans = [p for m in self.m_choices if (p := self._plan(runs, counts, m)) is not None]
        if not plans:
            return None
        return min(self._fast(plans), key=lambda x: (not x[1], x[0]))

    def provision(self, types: np.ndarray) -> tuple[float, Plan | None, bool]:
        runs = self.runs(types)
        key = tuple(runs)
        if key in self.cache:
            return self.cache[key]
        counts = [1] * len(runs)
        free = {t: len(self.pool[t]) for t in self.types}
        for _, _, t in runs:
            free[self.types[t]] -= 1
        if min(free.values()) < 0:  # more stages of a type than devices of it
            short = -min(free.values())
            result = (self.scale * 100.0 * (1.0 + short), None, False)
            self.cache[key] = result
            return result
        best = self._best_m(runs, counts)
        while True:
            value, ok, plan = best
            floor = objectives.objective(self.options).floor
            step_ok = not floor or ok
            if floor and step_ok:
                break
            # the stage with the longest per-replica busy time that can still grow
            busy = []
            for k, (lo, hi, t) in enumerate(runs):
                if free[self.types[t]] <= 0 or counts[k] >= (self.options.max_replicas or counts[k] + 1):
                    continue
                st, i, j = plan.stages[k], int(self.starts[lo]), int(self.starts[hi])
                one = float(self.table.whole_s(self.table.kind(st.devices[:1]), i, j)) / counts[k]
                busy.append((one + float(self.table.tail_s(st.devices, i, j)), k))
            if not busy:
                break
            _, k = max(busy)
            trial = counts.copy()
            trial[k] += 1
            cand = self._best_m(runs, trial)
            if cand is None:
                break
            if not floor and not (cand[0] < value):
                break  # objective time/mdpe: stop when one more device no longer helps
            counts = trial
            free[self.types[runs[k][2]]] -= 1
            best = cand
        value, ok, plan = best
        self.cache[key] = (value, plan, ok)
        return self.cache[key]


def all_one_type(graph: Graph, cluster: Cluster, options: PlanOptions, device_type: str) -> Plan | None:
    """Every layer on `device_type`, provisioned as `heterps` does (None if no such device)."""
    starts = unit_starts(graph, cluster)
    prov = Provisioner(graph, cluster, options, starts)
    if device_type not in prov.types:
        return None
    _, plan, _ = prov.provision(np.full(len(starts) - 1, prov.types.index(device_type)))
    return plan


def _type_mask(graph: Graph, cluster: Cluster, prov: Provisioner, starts: np.ndarray) -> torch.Tensor:
    """(U, types): a type whose one device cannot hold a unit's weights, gradients and optimizer
    state is masked out (every type allowed for a unit that fits on none)."""
    table = prov.table
    weights = table.weights_bytes(table.kind(prov.pool[prov.types[0]][:1]), starts[:-1], starts[1:])
    biggest = np.array([max(cluster.device(d).mem_bytes for d in prov.pool[t]) for t in prov.types], float)
    mask = torch.as_tensor(weights[:, None] <= biggest[None, :])
    mask[~mask.any(dim=1)] = True
    return mask


def _warm_bias(graph: Graph, cluster: Cluster, options: PlanOptions, prov: Provisioner, starts: np.ndarray,
               nats: float) -> tuple[Plan | None, torch.Tensor]:
    """The warm start (dp's plan; none when `faithful`) and the logits' bias towards its types,
    `nats` on each unit's type in it (zero without a warm start)."""
    units = len(starts) - 1
    bias = torch.zeros(units, len(prov.types))
    warm = None if options.faithful else warm_start(graph, cluster, options)
    if warm is not None:
        type_of = {v: prov.types.index(cluster.device(st.devices[0]).type) for st in warm.stages for v in st.nodes}
        for u in range(units):
            bias[u, type_of[prov.order[starts[u]]]] = nats
    return warm, bias


def _keep(best: dict, value: float, plan: Plan | None, ok: bool) -> None:
    """Keep a provisioned plan that fits and meets the floor among the candidates (by its key)."""
    if ok and plan is not None:
        best[Scorer.key(plan)] = (value, plan)


def _one_type_plans(prov: Provisioner, units: int) -> dict:
    """Every all-one-type configuration is a point of HeterPS's action space; trying them first
    costs a few provisionings and makes the result never dearer than the best of them."""
    best: dict = {}
    for t in range(len(prov.types)):
        _keep(best, *prov.provision(np.full(units, t)))
    return best


def _learn_types(prov: Provisioner, feats: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor, cfg: LearnConfig,
                 options: PlanOptions, best: dict, progress: Callable[[float], None] | None) -> Iterations:
    """Scheduling: REINFORCE on the type policy (`cfg`), every sampled plan provisioned and the
    good ones kept in `best`; returns the run's iterations and curve."""
    with seeded_torch(options.seed) as gen:
        policy = TypePolicy(feats.shape[1], len(prov.types))
        opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
        run = Iterations(Budget.of(options, learn_budget_s(options)), progress, every=2)
        advantages = Advantages(cfg, v_ref=prov.scale if prov.scale > 0 else 1.0)
        for frac in run:
            logits = (policy(feats) + cfg.warm_scale(frac) * bias).masked_fill(~mask, float("-inf"))
            logp_all = torch.log_softmax(logits, dim=-1)
            with torch.no_grad():
                picks = torch.multinomial(logp_all.exp(), cfg.batch, replacement=True, generator=gen).T  # (B, U)
            values = []
            for row in picks.numpy():
                value, plan, ok = prov.provision(row)
                values.append(value)
                _keep(best, value, plan, ok)
            values = np.array(values)
            logp = logp_all.gather(1, picks.T).sum(dim=0)  # (B,)
            run.skipped += reinforce_step(opt, cfg, advantages(values), logp)
            run.record(prov.evaluations, float(values.mean()), min((v for v, _ in best.values()), default=math.inf),
                       frac)
    return run


def heterps(graph: Graph, cluster: Cluster, options: PlanOptions,
            progress: Callable[[float], None] | None = None) -> Plan:
    starts = unit_starts(graph, cluster)
    units = len(starts) - 1
    prov = Provisioner(graph, cluster, options, starts)
    feats = torch.as_tensor(hierarchical_features(graph, cluster, starts))
    mask = _type_mask(graph, cluster, prov, starts)
    warm, bias = _warm_bias(graph, cluster, options, prov, starts, LEARN.warm_nats)
    cfg = LEARN if warm is not None else replace(LEARN, warm_nats=0.0)
    best = {} if options.faithful else _one_type_plans(prov, units)
    run = _learn_types(prov, feats, mask, bias, cfg, options, best, progress)
    found = [p for _, p in sorted(best.values(), key=lambda x: x[0])[:KEEP]]
    meta = {"iterations": run.done, "skipped_updates": run.skipped, "fast_evaluations": prov.evaluations,
            "seconds": round(run.budget.elapsed_s, 3),
            "curve": thin(run.curve), "faithful": options.faithful, "units": units, "types": prov.types,
            "algorithm": "reinforce (types) + provisioning"}
    return finish(prov.scorer, "heterps", found, warm, meta,
                  "give it a larger --budget-s or --max-iters, or lower --min-samples-per-s")
