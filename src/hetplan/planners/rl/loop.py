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
every time (a run with only a time budget does as many iterations as the machine allows; the
budget is `hetplan.planners.kit.Budget`).

`heterps` trains its type policy with the same pieces: a `LearnConfig` (reward "neg_log",
-log(value / v_ref), v_ref given), `Advantages` (rewards less their moving-average baseline),
`reinforce_step`, and `Iterations` (the budget, the learning curve, progress).

The best plans the fast path found (distinct, up to `KEEP`) are re-scored with the event
simulator (`Scorer`), and the best of them is the result; by default the warm start (dp's plan)
is among the candidates, so the planner never returns a worse plan than dp.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from hetplan.errors import InfeasibleError
from hetplan.plan import Plan
from hetplan.planners.kit import Budget, learn_budget_s
from hetplan.planners.options import PlanOptions
from hetplan.planners.rl.env import PlanEnv, Scored
from hetplan.planners.rl.policy import PlanPolicy, Sample
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
    reward: str = "neg"  # "neg_sqrt": -sqrt(v / v_ref), "neg": -v / v_ref, "neg_log": -log(v / v_ref)

    def warm_scale(self, frac: float) -> float:
        """How much of the warm start's bias is left `frac` into the run: all of it at the start,
        none from half-way (none at all without a warm start)."""
        return max(0.0, 1.0 - 2.0 * frac) if self.warm_nats else 0.0

    def noise(self, frac: float) -> float:
        """The exploration noise on the logits `frac` into the run."""
        return self.noise_std if frac < self.noise_iters else 0.0


def rewards(values: np.ndarray, v_ref: float, kind: str) -> np.ndarray:
    """Rewards of objective values (lower is better) relative to `v_ref` (`LearnConfig.reward`).
    The linear and square-root rewards cap the ratio at 1e6 (penalised plans); the logarithmic one
    needs no cap."""
    if kind == "neg_log":
        return -np.log(np.maximum(values, 1e-30) / v_ref)
    rel = np.minimum(values / v_ref, 1e6)
    return -np.sqrt(rel) if kind == "neg_sqrt" else -rel


@dataclass
class Advantages:
    """Advantages of a run's batches: the rewards less their exponential moving average (the
    baseline). v_ref, the values' unit, is given or the median finite value of the first batch."""

    cfg: LearnConfig
    v_ref: float | None = None
    baseline: float | None = None

    def __call__(self, values: np.ndarray) -> torch.Tensor:
        if self.v_ref is None:
            finite = values[np.isfinite(values)]
            v_ref = float(np.median(finite)) if len(finite) else 1.0
            self.v_ref = v_ref if v_ref > 0 else 1.0
        r = rewards(values, self.v_ref, self.cfg.reward)
        mean_r = float(r.mean())
        decay = self.cfg.baseline_decay
        self.baseline = mean_r if self.baseline is None else decay * self.baseline + (1 - decay) * mean_r
        return torch.as_tensor(r - self.baseline, dtype=torch.float32)


@dataclass
class Iterations:
    """A learning run's iterations within its budget: iterating gives the share of the budget
    used at each iteration's start until it is spent; `record` ends an iteration (a row of the
    learning curve: iteration, plans scored, seconds, mean value, best value so far) and reports
    progress every `every` iterations."""

    budget: Budget
    progress: Callable[[float], None] | None = None
    every: int = 5
    done: int = 0
    skipped: int = 0  # updates skipped (`guarded_update`)
    curve: list[tuple[int, int, float, float, float | None]] = field(default_factory=list)

    def __iter__(self) -> Iterator[float]:
        while (frac := self.budget.fraction(self.done)) is not None:
            yield frac
        if self.progress is not None:
            self.progress(1.0)

    def record(self, evaluations: int, mean: float, best: float, frac: float) -> None:
        self.done += 1
        self.curve.append((self.done, evaluations, self.budget.elapsed_s, mean, best if math.isfinite(best) else None))
        if self.progress is not None and self.done % self.every == 0:
            self.progress(min(1.0, frac))


def guarded_update(opt: torch.optim.Optimizer, loss: torch.Tensor, grad_clip: float | None = None) -> bool:
    """One optimizer update, unless the loss or a gradient is not finite (rewards of plans the
    simulator scores as infinite, a log-probability of -inf): then the update is skipped and the
    learning rate halved, so that no NaN reaches the policy's weights (PPO on resnet50
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


def reinforce_step(opt: torch.optim.Optimizer, cfg: LearnConfig, adv: torch.Tensor, logp: torch.Tensor,
                   entropy: torch.Tensor | None = None) -> int:
    """One REINFORCE update, loss -(A log pi) less the entropy bonus; 1 when it was skipped."""
    loss = -(adv * logp).mean()
    if entropy is not None:
        loss = loss - cfg.entropy * entropy
    return int(not guarded_update(opt, loss, cfg.grad_clip))


@dataclass(frozen=True)
class Learned:
    """What a run found: the best fast-path candidates, the learning curve and counters."""

    candidates: tuple[tuple[float, tuple, tuple, int], ...]  # (value, stages, devices, m), best first
    curve: tuple[tuple[int, int, float, float, float], ...]  # (iteration, plans, seconds, mean, best)
    iterations: int
    evaluations: int
    seconds: float
    skipped_updates: int = 0  # updates skipped for a non-finite loss or gradient (`guarded_update`)


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


def learn(env: PlanEnv, policy: PlanPolicy, cfg: LearnConfig, options: PlanOptions,
          progress: Callable[[float], None] | None = None) -> Learned:
    with seeded_torch(options.seed) as gen:
        return _learn(env, policy, cfg, Budget.of(options, learn_budget_s(options)), gen, progress)


class _Found:
    """The best distinct feasible plans a run sampled (up to KEEP, by fast-path value)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, tuple, tuple, int]] = []  # max-heap by -value
        self.seen: set = set()
        self.best_v = math.inf

    def add(self, scored: Scored) -> None:
        for i in range(len(scored.value)):
            n = int(scored.n[i])
            key = (tuple(int(x) for x in scored.stages[i]), tuple(int(x) for x in scored.devices[i, :n]),
                   int(scored.microbatches[i]))
            if key in self.seen or not scored.feasible[i]:
                continue
            self.seen.add(key)
            item = (-float(scored.value[i]), len(self.seen), key[0], key[1], key[2])
            if len(self.heap) < KEEP:
                heapq.heappush(self.heap, item)
            elif item > self.heap[0]:
                heapq.heapreplace(self.heap, item)
            self.best_v = min(self.best_v, float(scored.value[i]))

    def candidates(self) -> tuple[tuple[float, tuple, tuple, int], ...]:
        return tuple(sorted(((-v, s, d, m) for v, _, s, d, m in self.heap), key=lambda c: c[0]))


def _ppo_step(policy: PlanPolicy, opt: torch.optim.Optimizer, cfg: LearnConfig, sample: Sample, scale: float,
              adv: torch.Tensor) -> int:
    """PPO's epochs over one batch; the number of updates skipped."""
    if adv.std() > 0:
        adv = adv / (adv.std() + 1e-8)
    with torch.no_grad():
        old, _ = policy.log_prob(sample, scale)
    skipped = 0
    for _ in range(cfg.epochs):
        logp, ent = policy.log_prob(sample, scale)
        # The partition network's dropout (Trinity's 30%) differs between `old` and this pass,
        # and a plan's log-probability sums 64 units' choices: the log-ratio reached 140 on
        # resnet50 and exp() overflowed to inf. Clamped, it stays finite; the
        # PPO clip and the gradient-norm clip bound the update as before.
        ratio = torch.exp((logp - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
        surrogate = torch.min(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv)
        loss = -surrogate.mean() - cfg.entropy * ent
        skipped += not guarded_update(opt, loss, cfg.grad_clip)
    return skipped


def _update(policy: PlanPolicy, opt: torch.optim.Optimizer, cfg: LearnConfig, sample: Sample, scale: float,
            adv: torch.Tensor) -> int:
    """The policy's update from one batch (REINFORCE or PPO); the number of updates skipped."""
    policy.train()
    if cfg.algorithm == "reinforce":
        logp, ent = policy.log_prob(sample, scale)
        return reinforce_step(opt, cfg, adv, logp, ent)
    return _ppo_step(policy, opt, cfg, sample, scale, adv)


def _learn(env: PlanEnv, policy: PlanPolicy, cfg: LearnConfig, budget: Budget, gen: torch.Generator,
           progress: Callable[[float], None] | None) -> Learned:
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    run = Iterations(budget, progress, every=5)
    found = _Found()
    advantages = Advantages(cfg)
    for frac in run:
        scale = cfg.warm_scale(frac)  # of the warm start's bias
        policy.eval()  # no dropout while sampling; dropout regularises the updates
        sample = policy.sample(cfg.batch, gen, bias_scale=scale, noise_std=cfg.noise(frac))
        scored = env.score(sample.stages, sample.devices)
        found.add(scored)
        run.skipped += _update(policy, opt, cfg, sample, scale, advantages(scored.value))
        run.record(env.evaluations, float(scored.value.mean()), found.best_v, frac)
    return Learned(found.candidates(), tuple(thin(run.curve)), run.done, env.evaluations, budget.elapsed_s,
                   run.skipped)


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
