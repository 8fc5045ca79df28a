"""Which stage replicas sum which gradients after a step, and in which order: the one rule that
the runtime follows (`hetplan.runtime.rank.gradient_groups`) and the cost model charges
(`hetplan.cost.CostModel.sync_costs`).

A parameter used by one stage is summed over that stage's replicas. A parameter that several
stages use (GPT-2's token embedding, which is also its output layer: a tied weight) is summed
over the replicas of all those stages, since each holds a copy and computes a part of its
gradient. Parameters held by the same replicas travel together, one collective per group.
Every rank runs its groups in one global order, by their members' ranks (`rank_numbers`: host
by host, as torchrun numbers them), and blocks in each collective until its group's other
members reach it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass


def rank_numbers(stage_devices: Sequence[Sequence[str]], host_of: Callable[[str], str],
                 stage_ranks: Sequence[int] | None = None) -> dict[tuple[int, int], int]:
    """The rank of every (stage, replica) of a plan whose stage k runs on `stage_devices[k]`:
    host by host, hosts in the order the plan first uses them, and within a host stage by stage,
    replica by replica (torchrun numbers the ranks of a job host by host). With `stage_ranks`
    (an interleaved schedule: `Plan.stage_ranks`, the pipeline rank of each stage), a worker
    holds replica p of all the stages of one pipeline rank and is numbered by the first of them."""
    holder = list(range(len(stage_devices))) if stage_ranks is None else list(stage_ranks)
    first = {r: holder.index(r) for r in holder}  # each pipeline rank's first stage
    members = [(k, p) for k in sorted(first.values()) for p in range(len(stage_devices[k]))]
    hosts = list(dict.fromkeys(host_of(stage_devices[k][p]) for k, p in members))
    members.sort(key=lambda m: hosts.index(host_of(stage_devices[m[0]][m[1]])))
    workers = {m: r for r, m in enumerate(members)}
    return {(k, p): workers[(first[holder[k]], p)] for k, devices in enumerate(stage_devices)
            for p in range(len(devices))}


@dataclass(frozen=True)
class SyncGroup:
    """Replicas that sum the gradients of `params` (the caller's keys for them), members as
    (stage, replica) in rank order."""

    members: tuple[tuple[int, int], ...]
    params: tuple[Hashable, ...]


def sync_groups(holders: Mapping[Hashable, Collection[int]], ranks: Mapping[tuple[int, int], int]) -> list[SyncGroup]:
    """The groups, in the order every rank runs them (by their members' ranks). `holders`: per
    parameter, the stages that use it, in any order of parameters (a group keeps its parameters
    in `holders`' order); `ranks`: the rank of every (stage, replica) (`rank_numbers`). Groups of
    one member are kept (nothing to sum: callers skip them). Members on one rank (a worker that
    holds several stages) share one gradient: callers sum over the members' distinct ranks."""
    by_stage: dict[int, list[tuple[int, int]]] = {}
    for member in ranks:
        by_stage.setdefault(member[0], []).append(member)
    groups: dict[tuple[tuple[int, int], ...], list[Hashable]] = {}
    for param, stages in holders.items():
        members = tuple(sorted((m for k in set(stages) for m in by_stage[k]), key=ranks.__getitem__))
        groups.setdefault(members, []).append(param)
    order = sorted(groups, key=lambda members: [ranks[m] for m in members])
    return [SyncGroup(members, tuple(groups[members])) for members in order]
