"""Reinforcement-learning planners: `reinforce` (Hierarchical placer / TAPP), `ppo` (Trinity) and
`heterps` (HeterPS), on hetplan's plan space (`env`), scored by the simulator's fast path.

These planners use torch (CPU, one thread) for their policy networks; nothing here touches a
device or `torch.distributed`, and every run is seeded.
"""

from hetplan.planners.rl.heterps import all_one_type, heterps
from hetplan.planners.rl.planners import ppo, reinforce

__all__ = ["all_one_type", "heterps", "ppo", "reinforce"]
