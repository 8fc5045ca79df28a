"""The learning loop shared by `reinforce` and `ppo`, and how their result is chosen.

Each iteration samples a batch of plans from the policy, scores them with the fast path
(`PlanEnv.score`), turns values into rewards, and updates the policy:

- REINFORCE (Williams 1992), as the Hierarchical placer trains it: loss = -(R - b) log pi(plan),
  b an exponential moving average of the rewards; reward -sqrt(value / v_ref);
- PPO (Schulman et al. 2017), as Trinity trains it: several epochs over the batch of the clipped
  surrogate min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi(plan) / pi_old(plan), A = R - b with
  b an exponential moving average; reward -value / v_ref; exploration noise on the logits for the
  first iterations; gradient norm clipped to 1.0.

v_ref is the median value of the first batch, so that rewards are about -1 whatever the
objective's unit. Adam on all parameters; one torch thread, a torch generator seeded from the
options, and the global torch RNG forked and seeded, so that a run with `max_iters` is the same
every time (a run with only a time budget does as many iterations as the machine allows).

The best plans the fast path found (distinct, up to `KEEP`) are re-scored with the event
simulator (`Scorer`), and the best of them is the result; by default the warm start (dp's plan)
is among the candidates, so the planner never returns a worse plan than dp.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch

from hetplan.errors import InfeasibleError
from hetplan.plan import Plan
from hetplan.planners.options import PlanOptions
from hetplan.planners.rl.env import PlanEnv
from hetplan.planners.rl.policy import PlanPolicy
from hetplan.planners.scoring import Scorer

KEEP = 8  # plans re-scored by the event simulator at the end
LOG_RATIO_LIMIT = 20.0  # PPO: |log pi/pi_old| beyond this is clamped (exp(20) = 5e8 is still finite)
CURVE_POINTS = 400


@dataclass(frozen=True)
class LearnConfig:
    algorithm: str  # "reinforce" or "ppo"
    batch: int = 8  # plans sampled per iteration
    lr: float = 3e-3
    baseline_decay: float = 0.9
    entropy: float = 0.0
    epochs: int = 1  # PPO epochs per batch
    clip: float = 0.2  # PPO ratio clip
    grad_clip: float | None = None
    noise_std: float = 0.0  # exploration noise on the logits ...
    noise_iters: float = 0.0  # ... for this fraction of the run
    warm_nats: float = 0.0  # bias towards the warm start, in logits, fading out over half the run
    reward: str = "neg"  # "neg_sqrt": -sqrt(v / v_ref), "neg": -v / v_ref


def guarded_update(opt: torch.optim.Optimizer, loss: torch.Tensor, grad_clip: float | None = None) -> bool:
    """One optimizer update, unless the loss or a gradient is not finite (rewards of plans the
    simulator scores as infinite, a log-probability of -inf): then the update is skipped and the
    learning rate halved, so that no NaN reaches the policy's weights (issue 13: PPO on resnet50
    crashed at update 597 with 'probability tensor contains either inf, nan'). Returns whether it
    updated; callers count the skipped ones in the run's record."""
    params = [p for group in opt.param_groups for p in group["params"]]
    opt.zero_grad()
    finite = bool(torch.isfinite(loss))
    if finite:
        loss.backward()
        finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
    if not finite:
        opt.zero_grad()
        for group in opt.param_groups:
            group["lr"] *= 0.5
        return False
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    return True


@dataclass(frozen=True)
class Learned:
    """What a run found: the best fast-path candidates, the learning curve and counters."""

    candidates: tuple[tuple[float, tuple, tuple, int], ...]  # (value, stages, devices, m), best first
    curve: tuple[tuple[int, int, float, float, float], ...]  # (iteration, plans, seconds, mean, best)
    iterations: int
    evaluations: int
    seconds: float
    skipped_updates: int = 0  # updates skipped for a non-finite loss or gradient (`guarded_update`)


def budget(options: PlanOptions, default_s: float) -> tuple[int | None, float]:
    """(iterations or None, seconds): `max_iters` alone runs that many iterations whatever the
    time; otherwise the time budget (the planner's default when none is given)."""
    if options.max_iters is not None:
        return options.max_iters, math.inf if options.budget_s is None else options.budget_s
    return None, options.budget_s or default_s


@contextmanager
def seeded_torch(seed: int) -> Iterator[torch.Generator]:
    """One torch thread (small networks: threads cost more than they give, and one thread keeps
    results the same) and torch's global RNG seeded, both restored afterwards; yields a seeded
    generator for sampling."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            yield torch.Generator().manual_seed(seed)
    finally:
        torch.set_num_threads(threads)


def thin(curve: list) -> list:
    """At most CURVE_POINTS rows, evenly spread, the last kept: plan files stay small."""
    if len(curve) <= CURVE_POINTS:
        return curve
    keep = np.unique(np.linspace(0, len(curve) - 1, CURVE_POINTS).astype(int))
    return [curve[k] for k in keep]


def learn(env: PlanEnv, policy: PlanPolicy, cfg: LearnConfig, options: PlanOptions, default_budget_s: float,
          progress: Callable[[float], None] | None = None) -> Learned:
    max_iters, budget_s = budget(options, default_budget_s)
    with seeded_torch(options.seed) as gen:
        return _learn(env, policy, cfg, max_iters, budget_s, gen, progress)


def _learn(env: PlanEnv, policy: PlanPolicy, cfg: LearnConfig, max_iters: int | None, budget_s: float,
           gen: torch.Generator, progress) -> Learned:
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    began = time.perf_counter()
    best: list[tuple[float, int, tuple, tuple, int]] = []  # max-heap by -value of the KEEP best
    seen: set = set()
    curve = []
    baseline = None
    v_ref = None
    it = skipped = 0
    best_v = math.inf
    while True:
        elapsed = time.perf_counter() - began
        frac = it / max_iters if max_iters is not None else elapsed / budget_s
        if frac >= 1.0 or elapsed >= budget_s:
            break
        scale = max(0.0, 1.0 - 2.0 * frac) if cfg.warm_nats else 0.0  # of the warm start's bias
        noise = cfg.noise_std if frac < cfg.noise_iters else 0.0
        policy.eval()  # no dropout while sampling; dropout regularises the updates
        sample = policy.sample(cfg.batch, gen, bias_scale=scale, noise_std=noise)
        scored = env.score(sample.stages, sample.devices)
        values = scored.value
        if v_ref is None:
            finite = values[np.isfinite(values)]
            v_ref = float(np.median(finite)) if len(finite) else 1.0
            v_ref = v_ref if v_ref > 0 else 1.0
        rel = np.minimum(values / v_ref, 1e6)
        rewards = -np.sqrt(rel) if cfg.reward == "neg_sqrt" else -rel
        for i in range(cfg.batch):
            n = int(scored.n[i])
            key = (tuple(int(x) for x in scored.stages[i]), tuple(int(x) for x in scored.devices[i, :n]),
                   int(scored.microbatches[i]))
            if key in seen or not scored.feasible[i]:
                continue
            seen.add(key)
            item = (-float(values[i]), len(seen), key[0], key[1], key[2])
            if len(best) < KEEP:
                heapq.heappush(best, item)
            elif item > best[0]:
                heapq.heapreplace(best, item)
            best_v = min(best_v, float(values[i]))
        mean_r = float(rewards.mean())
        baseline = mean_r if baseline is None else cfg.baseline_decay * baseline + (1 - cfg.baseline_decay) * mean_r
        adv = torch.as_tensor(rewards - baseline, dtype=torch.float32)
        policy.train()
        if cfg.algorithm == "reinforce":
            logp, ent = policy.log_prob(sample, scale)
            loss = -(adv * logp).mean() - cfg.entropy * ent
            skipped += not guarded_update(opt, loss, cfg.grad_clip)
        else:
            if adv.std() > 0:
                adv = adv / (adv.std() + 1e-8)
            with torch.no_grad():
                old, _ = policy.log_prob(sample, scale)
            for _ in range(cfg.epochs):
                logp, ent = policy.log_prob(sample, scale)
                # The partition network's dropout (Trinity's 30%) differs between `old` and this pass,
                # and a plan's log-probability sums 64 units' choices: the log-ratio reached 140 on
                # resnet50 and exp() overflowed to inf (issue 13). Clamped, it stays finite; the
                # PPO clip and the gradient-norm clip bound the update as before.
                ratio = torch.exp((logp - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
                surrogate = torch.min(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv)
                loss = -surrogate.mean() - cfg.entropy * ent
                skipped += not guarded_update(opt, loss, cfg.grad_clip)
        it += 1
        curve.append((it, env.evaluations, time.perf_counter() - began, float(values.mean()),
                      best_v if math.isfinite(best_v) else None))
        if progress is not None and it % 5 == 0:
            progress(min(1.0, frac))
    if progress is not None:
        progress(1.0)
    curve = thin(curve)
    cands = sorted(((-v, s, d, m) for v, _, s, d, m in best), key=lambda c: c[0])
    return Learned(tuple(cands), tuple(curve), it, env.evaluations, time.perf_counter() - began, skipped)


def finish(scorer: Scorer, planner: str, found: list[Plan], warm: Plan | None, run: dict, hint: str) -> Plan:
    """Re-score the plans a run found with the event simulator and return the best, the warm start
    among them when given, with what the run did (`run`: iterations, counters, curve, settings) in
    `meta[planner]`. `hint` says what to try when nothing fits."""
    plans = [*found, *([replace(warm, planner=planner, predicted=None, meta={})] if warm is not None else [])]
    if not plans:
        raise InfeasibleError(f"{planner} found no plan that fits and meets the objective in {run['iterations']} "
                              f"iterations: {hint}")
    chosen = scorer.best(plans, planner)
    learned_v = min((scorer.value(p) for p in found), default=math.inf)
    warm_v = scorer.value(plans[-1]) if warm is not None else math.inf
    meta = {
        **run, "event_simulations": scorer.simulations,
        "learned_value": learned_v if math.isfinite(learned_v) else None,
        "warm_start": warm.planner if warm is not None else None,
        "warm_value": warm_v if math.isfinite(warm_v) else None,
        "returned": "warm start" if warm is not None and chosen is plans[-1] else "learned",
        "curve": [list(row) for row in run["curve"]],
    }
    return replace(chosen, planner=planner, objective=scorer.options.objective, meta={planner: meta})
