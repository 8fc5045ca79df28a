"""A stage's backward pass in two actions, for zero-bubble schedules (Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024): first the gradients of the stage's inputs (I), which the
stage before waits for, then those of its weights (W), which nobody waits for.

As torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight` do, I runs
only the part of autograd's graph between the outputs and the inputs, and keeps the gradient
arriving at each node of that part from which a weight's branch leaves it (an "intermediate":
a matmul's node, whose weight gradient is the other half of its work); W starts from those
gradients and runs the weights' branches only, so no node's work is done twice. The weights are
grouped by the intermediates they hang from, one `torch.autograd.grad` per group, so that a
group's call does not run back through another group's nodes; within a group, a hook pins each
intermediate's gradient to the one I saw, so a path from one intermediate to another counts
nothing twice. This is written here rather than called from torch's private module, which
changed between the versions hetplan supports (2.11 summed a node's several output gradients
into one, 2.13 keeps them apart).

Where the split cannot be made, the whole backward runs in one of the two actions, with the
same gradients: in W where no input needs a gradient (the first stage: the batch), in I where an
output does not depend on the inputs (its gradient would reach weights past the part I runs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node | None:
    """The graph node a tensor's gradient enters: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's AccumulateGrad, made on demand


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from `roots`, the nodes that feed it gradients."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    todo = deque(roots)
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(node)
    return parents


def _upwards(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from `starts` against the gradients' flow, not passing `stop`; and the
    nodes of `stop` met."""
    seen, met = set(starts), set()
    todo = deque(starts)
    while todo:
        for p in parents.get(todo.popleft(), ()):
            if p in stop:
                met.add(p)
            elif p not in seen:
                seen.add(p)
                todo.append(p)
    return seen, met


@dataclass
class _Group:
    params: list[torch.Tensor] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)  # the intermediates
    grads: dict[Node, tuple] = field(default_factory=dict)  # what reached each in I


@dataclass(frozen=True)
class WeightsLeft:
    """What I leaves for W: the groups to run, or the whole backward to run (`whole`)."""

    groups: tuple[_Group, ...]
    whole: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None


def _groups(params: Sequence[torch.Tensor], parents: dict[Node, list[Node]], on_path: set[Node]) -> list[_Group]:
    """Weights grouped by the intermediates they hang from (weights sharing one, one group)."""
    by_node: dict[Node, _Group] = {}
    for prm in params:
        acc = _node(prm)
        if acc not in parents:
            continue  # the outputs do not depend on it
        _, met = _upwards([acc], parents, on_path)
        found = {id(by_node[n]): by_node[n] for n in met if n in by_node}
        group = _Group([prm], sorted(met, key=id))
        for other in found.values():  # merge the groups it touches
            group.params += other.params
            group.nodes = sorted(set(group.nodes) | set(other.nodes), key=id)
        for n in group.nodes:
            by_node[n] = group
    return list({id(g): g for g in by_node.values()}.values())


def backward_inputs(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                    params: Sequence[torch.Tensor]) -> WeightsLeft:
    """I: the inputs' gradients, into their `.grad`; returns what W needs. `grads` are the
    outputs' gradients (for a loss, a tensor of ones)."""
    wanted = [x for x in inputs if x.requires_grad]
    roots = [n for n in (_node(o) for o in outputs) if n is not None]
    if not wanted or not roots:
        return WeightsLeft((), (list(outputs), list(grads)))
    parents = _parents(roots)
    on_path, _ = _upwards([n for n in (_node(x) for x in wanted) if n in parents], parents, set())
    if not all(r in on_path for r in roots):  # an output the inputs do not reach: all of it now
        torch.autograd.backward(list(outputs), list(grads))
        return WeightsLeft(())
    groups = _groups(params, parents, on_path)
    hooks = [n.register_prehook(_keeper(g, n)) for g in groups for n in g.nodes]
    try:
        got = torch.autograd.grad(list(outputs), wanted, list(grads), retain_graph=True, allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    for x, g in zip(wanted, got, strict=True):
        if g is not None:
            x.grad = g if x.grad is None else x.grad + g
    return WeightsLeft(tuple(groups))


def _keeper(group: _Group, node: Node) -> Any:
    def keep(grad_outputs: tuple) -> None:
        group.grads[node] = grad_outputs
    return keep


def backward_weights(left: WeightsLeft) -> None:
    """W: the weights' gradients, added to their `.grad`."""
    if left.whole is not None:
        torch.autograd.backward(*left.whole)
        return
    for group in left.groups:
        edges, grads = [], []
        for n in group.nodes:
            for i, g in enumerate(group.grads.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    grads.append(g)
        if not edges:
            continue
        pins = [n.register_prehook(lambda _, saved=group.grads[n]: saved) for n in group.nodes
                if len(group.nodes) > 1 and n in group.grads]
        try:
            got = torch.autograd.grad(edges, [GradientEdge(_node(p), 0) for p in group.params], grads,
                                      retain_graph=True, allow_unused=True)
        finally:
            for h in pins:
                h.remove()
        for prm, g in zip(group.params, got, strict=True):
            if g is not None:
                prm.grad = g if prm.grad is None else prm.grad + g
