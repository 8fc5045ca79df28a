"""What planners optimise, as one number per estimate (lower is better).

- `time`: the step time, for plans that fit in memory (highest throughput).
- `cost`: the price per sample, `usd_per_step / batch_size`, for plans that fit and reach the
  throughput floor `min_samples_per_s`; devices may stay unused (HeterPS, Liu et al. 2021:
  minimise monetary cost under a throughput constraint).
- `mdpe`: Trinity's multi-dimensional performance model (Zeng et al. 2022), which the paper
  describes as runtime plus penalties when communication or memory pass user limits. We read it
  as a weighted sum of three dimensionless terms:

      mdpe = alpha * T / T_ref
           + beta  * max(0, C / C_tol - 1)
           + gamma * max(0, M / M_tol - 1)

  T is the step time and T_ref the graph's total forward and backward time on the fastest
  device type the cluster has (so the first term is about 1 for one device and falls with a
  good split); C is the busiest link's busy share of the step and C_tol its tolerance
  (`comm_tolerance`, default 0.5); M is the largest share of a device's memory in use and M_tol
  its tolerance (`mem_tolerance`, default 0.8). Defaults alpha 0.5, beta 0.3, gamma 0.2. A plan
  that does not fit in memory at all is infeasible under every objective.
- `throughput`: PipeDream's question (Narayanan et al., SOSP 2019): the steady-state time per
  batch of a pipeline that never flushes, the slowest stage's compute (plus its all-reduce,
  shared by its replicas) or cut's communication (`hetplan.cost.CostModel.bottleneck_s`),
  for plans that fit in memory. `time` answers for the flushed step hetplan's runtime runs.

`value` is infinite for infeasible plans; `search_value` stays finite and grows with how far a
plan is from feasible, so that a search can walk through infeasible plans back to feasible ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.cost.stage_table import StageTable
from hetplan.graph import Graph
from hetplan.plan import Estimate
from hetplan.planners.options import PlanOptions


def reference_time_s(graph: Graph, cluster: Cluster, cost: CostModel | None = None) -> float:
    """The graph's forward + backward time on the fastest device type of the cluster."""
    cm = cost or CostModel(graph, cluster)
    return cm.whole_graph_s(cm.fastest_type())


def memory_share(est: Estimate, cluster: Cluster) -> float:
    """The largest share of a device's memory the plan uses."""
    return max((need / cluster.device(d).mem_bytes for d, need in est.peak_mem_bytes.items()), default=0.0)


def link_share(est: Estimate) -> float:
    """The busiest link's busy time as a share of the step."""
    if not est.link_busy_s or est.step_s <= 0:
        return 0.0
    return max(est.link_busy_s.values()) / est.step_s


def mdpe_of(step_s, link: object, memory: object, options: PlanOptions, t_ref_s: float):
    """mdpe from the step, the busiest link's share and the fullest memory share; numbers or
    numpy arrays alike (the RL planners score batches of plans with it)."""
    return (options.alpha * step_s / max(t_ref_s, 1e-30)
            + options.beta * np.maximum(0.0, link / options.comm_tolerance - 1.0)
            + options.gamma * np.maximum(0.0, memory / options.mem_tolerance - 1.0))


def mdpe(est: Estimate, options: PlanOptions, cluster: Cluster, t_ref_s: float) -> float:
    return float(mdpe_of(est.step_s, link_share(est), memory_share(est, cluster), options, t_ref_s))


def penalised(base, over, short):
    """`search_value` from an objective and how far a plan is from feasible (memory overflow as a
    share of the device, shortfall as a share of the floor): numbers or numpy arrays alike."""
    return np.where((over == 0.0) & (short == 0.0), base, (base + 1e-12) * (10.0 + 10.0 * (over + short)))


@dataclass(frozen=True)
class Objective:
    """One objective: the number it gives a plan from the plan's figures, scalars or numpy arrays
    alike (`base(step_s, usd_per_step, bottleneck_s, link_share, memory_share, batch, options,
    t_ref_s)`), a lower bound on it from a step at least `bound_s` long whose slowest stage
    computes `slowest_s` on devices costing `usd_per_hour` (`lower`), whether the throughput
    floor binds (`floor`), and how to say it (`says(options)`). Planners read it here rather than
    branching on the name:

    - `rank(step_s, usd_per_step, steady_s, slow)`: the key a search ranks candidates by, before
      they are simulated (a tuple, compared in order; numbers or arrays alike); `slow`: below the
      throughput floor, as far as the search can tell;
    - `bound`: what dp's first bound is and what a found plan tightens: "step" (the baselines'
      simulated steps), "steady" (their steady states), "floor" (the step the floor allows; a
      plan tightens the price), or "" (none);
    - `track`: what dp's labels keep besides the step: "price", "steady" or "";
    - `event_only`: its figures need the event simulator (the busiest link, the steady state of
      replicated stages), not the fast path;
    - `cheap_first`: device orders also put the cheapest work first, and the fastest plans join
      the candidates (a price under a floor)."""

    name: str
    base: Callable[..., Any]
    lower: Callable[..., float]
    says: Callable[[PlanOptions], str]
    rank: Callable[..., tuple]
    floor: bool = False
    bound: str = ""
    track: str = ""
    event_only: bool = False
    cheap_first: bool = False


OBJECTIVES = {o.name: o for o in (
    Objective("time", lambda step, usd, neck, link, mem, batch, opt, ref: step,
              lambda bound, slowest, usd_h, batch, opt, ref: bound, lambda opt: "shortest step",
              lambda step, usd, steady, slow: (step,), bound="step"),
    Objective("cost", lambda step, usd, neck, link, mem, batch, opt, ref: usd / batch,
              lambda bound, slowest, usd_h, batch, opt, ref: StageTable.usd_per_step(usd_h, bound) / batch,
              lambda opt: f"lowest price per sample at >= {opt.min_samples_per_s:g} samples/s",
              lambda step, usd, steady, slow: (slow, usd), floor=True, bound="floor", track="price",
              cheap_first=True),
    Objective("throughput", lambda step, usd, neck, link, mem, batch, opt, ref: neck,
              lambda bound, slowest, usd_h, batch, opt, ref: slowest,
              lambda opt: "highest steady-state throughput (PipeDream's slowest stage or cut)",
              lambda step, usd, steady, slow: (steady, step), bound="steady", track="steady", event_only=True),
    Objective("mdpe", lambda step, usd, neck, link, mem, batch, opt, ref: mdpe_of(step, link, mem, opt, ref),
              lambda bound, slowest, usd_h, batch, opt, ref: opt.alpha * bound / ref,
              lambda opt: (f"mdpe (alpha {opt.alpha:g}, beta {opt.beta:g}, gamma {opt.gamma:g}, link tolerance "
                           f"{opt.comm_tolerance:g}, memory tolerance {opt.mem_tolerance:g})"),
              lambda step, usd, steady, slow: (step,), event_only=True),
)}


def objective(options: PlanOptions) -> Objective:
    return OBJECTIVES[options.objective]


def shortfall(samples_per_s, options: PlanOptions):
    """How far below the throughput floor a plan is, as a share of the floor (0 when it meets it
    or the objective has none): numbers or numpy arrays alike."""
    if not objective(options).floor or not options.min_samples_per_s:
        return np.zeros_like(np.asarray(samples_per_s, dtype=float))
    return np.maximum(0.0, options.min_samples_per_s / np.maximum(samples_per_s, 1e-30) - 1.0)


def meets_floor(est: Estimate, options: PlanOptions) -> bool:
    return not objective(options).floor or est.samples_per_s >= (options.min_samples_per_s or 0.0) * (1 - 1e-12)


def value(est: Estimate, options: PlanOptions, cluster: Cluster, batch_size: int, t_ref_s: float) -> float:
    """The objective of a plan's estimate; infinite when the plan is infeasible."""
    if not est.feasible or not meets_floor(est, options):
        return math.inf
    return _raw(est, options, cluster, batch_size, t_ref_s)


def _raw(est: Estimate, options: PlanOptions, cluster: Cluster, batch_size: int, t_ref_s: float) -> float:
    return float(objective(options).base(est.step_s, est.usd_per_step, est.bottleneck_s, link_share(est),
                                         memory_share(est, cluster), batch_size, options, t_ref_s))


def search_value(est: Estimate, options: PlanOptions, cluster: Cluster, batch_size: int, t_ref_s: float) -> float:
    """Like `value`, but finite: an infeasible plan costs its objective times a factor that grows
    with its memory overflow and its shortfall below the throughput floor."""
    over = max(0.0, memory_share(est, cluster) - 1.0)
    short = float(shortfall(est.samples_per_s, options))
    return float(penalised(_raw(est, options, cluster, batch_size, t_ref_s), over, short))


def describe(options: PlanOptions) -> str:
    return objective(options).says(options)
