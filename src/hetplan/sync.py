"""Which stage replicas sum which gradients after a step, and in which order: the one rule that
the runtime follows (`hetplan.runtime.rank.gradient_groups`) and the cost model charges
(`hetplan.cost.CostModel.sync_costs`).

A parameter used by one stage is summed over that stage's replicas. A parameter that several
stages use (GPT-2's token embedding, which is also its output layer: a tied weight) is summed
over the replicas of all those stages, since each holds a copy and computes a part of its
gradient. Parameters held by the same replicas travel together, one collective per group.
Every rank runs its groups in one global order, the order of their members: ranks are numbered
stage by stage, replica by replica, so a group's members in (stage, replica) order are its
ranks in order, and a rank blocks in each collective until its group's other members reach it.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SyncGroup:
    """Replicas that sum the gradients of `params` (the caller's keys for them), members as
    (stage, replica) in rank order."""

    members: tuple[tuple[int, int], ...]
    params: tuple[Hashable, ...]


def sync_groups(holders: Mapping[Hashable, Collection[int]], replicas: Sequence[int]) -> list[SyncGroup]:
    """The groups, in the order every rank runs them. `holders`: per parameter, the stages that
    use it, in any order of parameters (a group keeps its parameters in `holders`' order);
    `replicas[k]`: how many replicas stage k has. Groups of one member are kept (nothing to sum:
    callers skip them)."""
    groups: dict[tuple[tuple[int, int], ...], list[Hashable]] = {}
    for param, stages in holders.items():
        members = tuple((k, p) for k in sorted(set(stages)) for p in range(replicas[k]))
        groups.setdefault(members, []).append(param)
    return [SyncGroup(members, tuple(params)) for members, params in sorted(groups.items())]
