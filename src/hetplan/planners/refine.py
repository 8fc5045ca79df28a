"""Local improvements of a finished plan, every step scored by the event simulator.

The planners' own models rank plans approximately (dp's program splits micro-batches exactly
where the runtime splits whole rows, `scale`'s ignores latencies); a steepest-descent polish of
the plan they return, in the spirit of the boundary refinement of graph partitioners
(Kernighan and Lin, "An efficient heuristic procedure for partitioning graphs", 1970), recovers
what that costs near their plan: the neighbouring micro-batch counts, and one node moved across
a stage boundary, the best move of a round taken while it improves the objective (the moves
shortlisted by the fast path, the shortlist simulated).
"""

from __future__ import annotations

import math
from dataclasses import replace

from hetplan.cost import CostModel
from hetplan.plan import Plan, Stage, plan_problems
from hetplan.planners.interleave import interleavings
from hetplan.planners.options import RECOMPUTE_UNITS, selective_allowed
from hetplan.planners.scoring import Scorer
from hetplan.schedule import SCHEDULE_NAMES, get_schedule

MAX_ROUNDS = 8  # boundary moves taken at most
ROUND_EVENTS = 100_000  # a round's moves are all simulated where they take at most this many events,
SHORTLIST = 2  # else the best this many by the fast path;
POLISH_EVENTS = 300_000  # events the polish may simulate (`Scorer.events`)


def refine_microbatches(scorer: Scorer, plan: Plan, choices: tuple[int, ...], budget: float = math.inf) -> Plan:
    """The plan with the neighbouring micro-batch counts of `choices`, one step at a time while
    the simulated objective improves (and the scorer has simulated fewer events than `budget`)."""
    best, value = plan, scorer.value(plan)
    for step in (1, -1):
        k = choices.index(best.microbatches) if best.microbatches in choices else None
        while k is not None and 0 <= k + step < len(choices) and scorer.simulated_events <= budget:
            k += step
            other = replace(best, microbatches=choices[k])
            other_value = scorer.value(other)
            if not other_value < value:
                break
            best, value = other, other_value
    return best


def best_schedule(scorer: Scorer, plan: Plan, names: tuple[str, ...] = SCHEDULE_NAMES) -> Plan:
    """The plan under the schedule of `names` whose simulated objective is best (ties: the
    plan's own, then the first named): under a schedule of one stage per rank, its stages and
    micro-batches as they are (zero bubble holds more micro-batches than 1F1B, so a plan that fits
    under one may not under the other: the simulator says); under an interleaved one, the plan's
    devices with the model cut again (`interleave.interleavings`). The plan itself if `names`
    gives no candidate."""
    candidates = [plan] if plan.schedule in names else []
    for name in names:
        if get_schedule(name).interleaved:
            candidates += [_runnable_under(p) for p in interleavings(scorer.cost, plan, name)]
        elif name != plan.schedule:
            candidates.append(_runnable_under(replace(plan, schedule=name, predicted=None)))
    return min(candidates, key=scorer.value, default=plan)


def with_sequence_parallel(plan: Plan, on: bool) -> Plan:
    """The plan with every tensor-parallel stage sequence-parallel where `on`
    (`PlanOptions.sequence_parallel`), none where not."""
    stages = tuple(replace(s, sequence_parallel=on and s.tp > 1) for s in plan.stages)
    return plan if stages == plan.stages else replace(plan, stages=stages, predicted=None)


def _runnable_under(plan: Plan) -> Plan:
    """The plan with its selective recomputation made per block, and its gradients' sharding
    made ZeRO-1's, where its schedule splits the backward (`plan.plan_problems`: torch's selective
    checkpoint allows one backward per block; sharded gradients are reduced when a backward has
    made them all)."""
    if not get_schedule(plan.schedule).split_backward or all(s.recompute != "selective" and s.shard < 2
                                                             for s in plan.stages):
        return plan
    return replace(plan, stages=tuple(replace(s, recompute="block" if s.recompute == "selective" else s.recompute,
                                              shard=min(s.shard, 1)) for s in plan.stages))


def with_recompute(cost: CostModel, plan: Plan, mode: str) -> Plan:
    """The plan with recomputation set on more of its stages (`PlanOptions.recompute_units`):
    under `always` on every stage, otherwise on each stage with a replica whose peak memory
    (`CostModel.stage_replicas_memory_bytes`) is over its device's; each at the allowed unit
    that runs again the least of its forward (`CostModel.rebuilt_forward_s`) among those whose
    replicas fit, else at the one whose replicas need the least. Never taken off a stage that
    has it (a planner that weighs it, dp, chose it). With `never`, the plan as it is."""
    units = [u for u in RECOMPUTE_UNITS[mode]
             if u != "none" and (u != "selective" or selective_allowed(cost.graph, plan.schedule))]
    if not units:
        return plan
    stages = list(plan.stages)
    for k, st in enumerate(plan.stages):
        if st.recomputes or (mode != "always" and not _over(cost, plan, k)):
            continue
        allowed = [u for u in units if st.tp == 1 or u == "stage"]  # (`plan._tp_problems`)
        if not allowed:
            continue
        trials = [replace(plan, stages=tuple(stages[:k]) + (replace(st, recompute=u),) + tuple(stages[k + 1:]))
                  for u in allowed]
        stages[k] = min(trials, key=lambda p: _recompute_rank(cost, p, k)).stages[k]
    if tuple(stages) == plan.stages:
        return plan
    return replace(plan, stages=tuple(stages), predicted=None)


def _recompute_rank(cost: CostModel, plan: Plan, k: int) -> tuple[bool, float, float]:
    """Stage k's unit first where it fits, then by the forward it runs again, then by memory."""
    stage, need = plan.stages[k], cost.stage_replicas_memory_bytes(plan, k)
    again = max(cost.rebuilt_forward_s(stage.nodes, cost.cluster.device(d).type, stage.recompute)[0]
                for d in stage.devices)
    return _over(cost, plan, k), again, max(need.values())


def _over(cost: CostModel, plan: Plan, k: int) -> bool:
    """Whether a replica of stage k needs more memory than its device has."""
    return any(need > cost.cluster.device(d).mem_bytes for d, need in cost.stage_replicas_memory_bytes(plan, k).items())


def shardable(cost: CostModel, stage) -> bool:
    """Whether a stage's replicas can shard its optimizer state: two workers or more, not
    tensor-parallel, and dense gradients (the rows of a table with sparse ones are not split
    into shares)."""
    by_id = cost.graph.by_id
    return len(set(stage.devices)) > 1 and stage.tp == 1 and all(by_id[n].updated_bytes is None for n in stage.nodes)


def with_shard(cost: CostModel, plan: Plan, mode: str) -> Plan:
    """The plan with ZeRO-1 (`shard` 1) on every stage that can shard (`shardable`) under
    `replicated`; under `where-needed` too, and on a stage whose replicas do not fit their devices
    so, the first deeper level at which they fit (2, the gradients; 3, the weights too: their
    collectives cost time, `CostModel.shard_passes_s`), or 3 where none does, unless the schedule
    splits the backward; with `never`, the plan as it is."""
    if mode == "never":
        return plan
    stages = list(plan.stages)
    for k, s in enumerate(stages):
        if not shardable(cost, s):
            continue
        stages[k] = replace(s, shard=max(s.shard, 1))
        deeper = mode == "where-needed" and not get_schedule(plan.schedule).split_backward
        for level in (2, 3) if deeper else ():
            if _fits(cost, replace(plan, stages=tuple(stages)), k):
                break
            stages[k] = replace(stages[k], shard=max(s.shard, level))
    stages_t = tuple(stages)
    return plan if stages_t == plan.stages else replace(plan, stages=stages_t, predicted=None)


def _fits(cost: CostModel, plan: Plan, k: int) -> bool:
    """Whether every replica of stage k fits its device (`CostModel.stage_replicas_memory_bytes`)."""
    need = cost.stage_replicas_memory_bytes(plan, k)
    return all(need[d] <= cost.cluster.device(d).mem_bytes for d in need)


def boundary_moves(plan: Plan) -> list[Plan]:
    """The plans with one node moved across one stage boundary: the last node of a stage (in its
    stage's order) to the start of the next, or the first of the next to the end of the stage;
    never emptying a stage. Convexity is the caller's check (`plan_problems`)."""
    out = []
    for k in range(len(plan.stages) - 1):
        a, b = plan.stages[k], plan.stages[k + 1]
        if len(a.nodes) > 1:  # each stage keeps its devices and its recompute choice
            out.append(_with(plan, k, replace(a, nodes=a.nodes[:-1]), replace(b, nodes=(a.nodes[-1], *b.nodes))))
        if len(b.nodes) > 1:
            out.append(_with(plan, k, replace(a, nodes=(*a.nodes, b.nodes[0])), replace(b, nodes=b.nodes[1:])))
    return out


def _with(plan: Plan, k: int, a: Stage, b: Stage) -> Plan:
    stages = list(plan.stages)
    stages[k:k + 2] = [a, b]
    return replace(plan, stages=tuple(stages), predicted=None)


def polish(scorer: Scorer, plan: Plan, choices: tuple[int, ...], rounds: int = MAX_ROUNDS) -> Plan:
    """Steepest descent from `plan`: the micro-batch counts around it, then the best boundary
    move of each round while one improves the objective (at most `rounds`), then the counts
    again, while the polish has simulated at most POLISH_EVENTS (`Scorer.events`: a deep
    pipeline of many micro-batches takes a second to simulate). Never worse than `plan`."""
    budget = scorer.simulated_events + POLISH_EVENTS
    best = refine_microbatches(scorer, plan, choices, budget)
    value = scorer.value(best)
    for _ in range(rounds):
        if scorer.simulated_events > budget:
            break
        moves = [p for p in boundary_moves(best) if not plan_problems(p, scorer.graph, scorer.cluster)]
        # the event simulator scores every move where a round of them is cheap; else the fast
        # path shortlists them (it folds replicated stages: its order of close moves is not the
        # simulator's)
        every = len(moves) * Scorer.events(best) <= ROUND_EVENTS
        shortlist = moves if every else scorer.shortlist(moves, SHORTLIST)
        scored = sorted(((scorer.value(p), i, p) for i, p in enumerate(shortlist)), key=lambda x: (x[0], x[1]))
        if not scored or not scored[0][0] < value:
            break
        value, _, best = scored[0]
    return refine_microbatches(scorer, best, choices, budget) if best is not plan else best
