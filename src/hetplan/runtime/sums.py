"""A worker's gradient sums after its passes, run as its list says (`hetplan.lowering`): one
`REDUCE_GRAD` op per sum it takes part in, in the order of its list, the sum's ranks in the op.
What each sum does is the worker's (`rank.Prepared.sums`, made by `rank.summed` in the global
order `hetplan.sync.sync_groups` gives every rank): a dense all-reduce of a group's gradients
(`gradients.reduce_gradients`), a sum over replicas of unlike tensor-parallel degrees
(`tensor_parallel.mixed_sum`), a stage sharding its optimizer's state reduce-scatters into its
share (`sharding.ShardedParameters.reduce`); a stage that shards its gradients reduced them in
its backward, and its op marks where the simulator charges the gathers it runs after the step.
Sums over the same ranks run in the order the list has them.
"""

from __future__ import annotations

from collections import deque

from hetplan.errors import HetplanError
from hetplan.lowering import REDUCE_GRAD
from hetplan.runtime.gradients import reduce_gradients
from hetplan.runtime.tensor_parallel import mixed_sum


def run_sums(prepared, transport, where=None) -> None:
    """Every sum of the worker's list, in its order, each op in `where.at` while it runs (the
    heartbeat's `executor.Where`); refuses a list that names a sum the worker has no part in, or
    leaves one out (the others would wait for it)."""
    me = prepared.role.rank
    work: dict[tuple[int, ...], deque[tuple[str, int]]] = {}
    for what, ranks in prepared.sums:
        if me in ranks:
            work.setdefault(ranks, deque()).append(what)
    for op in prepared.ops:
        if op.kind == REDUCE_GRAD:
            if not work.get(op.group):
                raise HetplanError(f"rank {me}'s list sums over ranks {op.group}, a sum it has no gradients for; "
                                   "its list and its stages disagree (a bug: report it with the plan)")
            if where is not None:
                where.at = str(op)
            _run(prepared, transport, work[op.group].popleft(), op.group)
    left = [ranks for ranks, queue in work.items() if queue]
    if left:
        raise HetplanError(f"rank {me}'s list leaves out its gradient sum over ranks {left[0]}; "
                           "its list and its stages disagree (a bug: report it with the plan)")


def _run(prepared, transport, what: tuple[str, int], ranks: tuple[int, ...]) -> None:
    kind, i = what
    if kind == "mixed":
        mixed_sum(prepared, transport, prepared.mixed[i])
        return
    _, params, _ = prepared.groups[i]
    first = id(params[0])
    shard = next((sh for sh in prepared.shards if any(id(p) == first for p in sh.params)), None)
    if shard is not None:
        shard.reduce(transport)
    elif not any(id(p) == first for units in prepared.units for p in units.params):
        reduce_gradients([(ranks, params)], transport, prepared.sparse)
