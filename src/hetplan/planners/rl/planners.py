"""`reinforce` (Hierarchical placer / TAPP) and `ppo` (Trinity): set-ups of the shared loop.

- `reinforce`: Mirhoseini et al., "A Hierarchical Model for Device Placement" (ICLR 2018): a
  feed-forward grouper and a sequence-to-sequence placer trained jointly with REINFORCE on reward
  -sqrt(runtime), with a moving-average baseline. TAPP (task allocation for pipelines) scores
  the same choices by the pipeline's step time, which is what hetplan's simulator gives.
  `faithful`: cold start, no entropy bonus, Adam at lr 0.01; the paper's placer has 512 hidden
  units for thousands of operations, graphs here are coarsened to at most 64 units, so 64 hidden
  units (sizes and rates the papers leave open are ours).
- `ppo`: Zeng et al., "Trinity" (2022): node features (Z-scored runtime, Node2vec embedding,
  operator vocabulary, output size), a partition MLP with hidden sizes 64 and 128 and 30%
  dropout, an LSTM encoder-decoder schedule network with attention and a trainable device
  embedding, sampling through softmax(5 tanh(u / 10)), PPO with a clipped ratio (0.2), an
  exponential-moving-average baseline, Adam, gradient clipping 1.0 and exploration noise on the
  logits for the first 20% of the run; reward from the user's objective (`mdpe` is Trinity's).

By default (not `faithful`) both start warm: the policy's logits get a bias of `WARM_NATS`
(`hetplan.planners.kit`) towards dp's plan (`hetplan.planners.dp.warm_start`) that fades out over
the first half of the run, and dp's plan is among the final candidates, so the result is never
worse than dp's (both scored by the event simulator). Time budgets: `kit.learn_budget_s`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from hetplan.cluster import Cluster
from hetplan.graph import Graph
from hetplan.plan import Plan
from hetplan.planners.dp import warm_start
from hetplan.planners.kit import WARM_NATS
from hetplan.planners.options import PlanOptions
from hetplan.planners.rl.env import PlanEnv
from hetplan.planners.rl.features import device_features, hierarchical_features, trinity_features
from hetplan.planners.rl.loop import LearnConfig, finish, learn
from hetplan.planners.rl.policy import PlanPolicy, Squash
from hetplan.planners.scoring import Scorer


def _run(graph: Graph, cluster: Cluster, options: PlanOptions, planner: str, policy_fn, cfg: LearnConfig,
         progress: Callable[[float], None] | None) -> Plan:
    env = PlanEnv(graph, cluster, options)
    with torch.random.fork_rng():  # the initial weights come from the seed, not the process's RNG
        torch.manual_seed(options.seed)
        policy = policy_fn(env)
    warm = None if options.faithful else warm_start(graph, cluster, options)
    if warm is not None:
        stages, devices = env.from_plan(warm)
        policy.warm(stages, devices, cfg.warm_nats)
    else:
        cfg = replace(cfg, warm_nats=0.0)
    learned = learn(env, policy, cfg, options, progress)
    found = [env.to_plan(np.array(s), np.array(d), m, planner) for _, s, d, m in learned.candidates]
    run = {"iterations": learned.iterations, "skipped_updates": learned.skipped_updates,
           "fast_evaluations": learned.evaluations,
           "seconds": round(learned.seconds, 3), "curve": learned.curve, "faithful": options.faithful,
           "units": env.units, "algorithm": cfg.algorithm}
    return finish(Scorer(graph, cluster, options), planner, found, warm, run,
                  "give it a larger --budget-s or --max-iters")


def reinforce(graph: Graph, cluster: Cluster, options: PlanOptions,
              progress: Callable[[float], None] | None = None) -> Plan:
    def policy(env: PlanEnv) -> PlanPolicy:
        return PlanPolicy(env, hierarchical_features(graph, cluster, env.starts), device_features(graph, cluster),
                          group_hidden=(64,), placer_hidden=64)

    cfg = LearnConfig("reinforce", batch=8, lr=0.01 if options.faithful else 3e-3, baseline_decay=0.9,
                      entropy=0.0 if options.faithful else 1e-3, reward="neg_sqrt", warm_nats=WARM_NATS)
    return _run(graph, cluster, options, "reinforce", policy, cfg, progress)


def ppo(graph: Graph, cluster: Cluster, options: PlanOptions,
        progress: Callable[[float], None] | None = None) -> Plan:
    def policy(env: PlanEnv) -> PlanPolicy:
        return PlanPolicy(env, trinity_features(graph, cluster, env.starts, seed=options.seed),
                          device_features(graph, cluster), group_hidden=(64, 128), dropout=0.3, placer_hidden=64,
                          squash=Squash(5.0, 10.0))

    cfg = LearnConfig("ppo", batch=8, lr=3e-3, baseline_decay=0.9, epochs=4, clip=0.2, grad_clip=1.0,
                      noise_std=1.0, noise_iters=0.2, entropy=1e-3, reward="neg", warm_nats=WARM_NATS)
    return _run(graph, cluster, options, "ppo", policy, cfg, progress)
