"""A worker's tensor-parallel stages in a run: their group's mesh, the sums of their gradients
over replicas of unlike degrees, and their steps run inside `running`. The stage itself (its
shards, DTensor, Megatron's boundaries, the vocabulary-parallel loss) is
`hetplan.pieces.tensor_stage`'s."""

from __future__ import annotations

import functools
import math

import torch

from hetplan.pieces.tensor_stage import TensorParallelStage, running


def attach_meshes(prepared, transport) -> None:
    """Give the worker's tensor-parallel stages their group's mesh (a group of the transport's)."""
    from torch.distributed.device_mesh import DeviceMesh

    me = prepared.role.rank
    mine = next((g for g in prepared.tp_groups if me in g), None)
    if mine is None:
        return
    mesh = DeviceMesh.from_group(transport.group(mine), prepared.device.type)
    for modules in prepared.traces.by_rows.values():
        for module in modules:
            if isinstance(module, TensorParallelStage):
                module.attach(mesh)


def mixed_sum(prepared, transport, entry) -> None:
    """A sum over replicas of unlike degrees (`rank.tp_sums`; `entry` one of `prepared.mixed`):
    each group joins its shards of every parameter into the whole gradient (its first rank
    adding the whole parameters', which every rank of a group has alike), the groups' first
    ranks sum them, each gives its group the sum, and each rank keeps its shard of it. Three
    collectives; every rank of the sum runs those it is part of."""
    me = prepared.role.rank
    leads, groups, params = entry
    mine = next((g for g in groups if me in g), None)
    if mine is None or not params:
        return
    t, place = len(mine), mine.index(me)
    wholes = [_whole_shape(p, prepared.tp_dims.get(id(p)), t) for p in params]
    flat = torch.zeros(sum(math.prod(s) for s in wholes))
    views, at = [], 0
    for shape in wholes:
        views.append(flat[at:at + math.prod(shape)].view(shape))
        at += math.prod(shape)
    for p, view in zip(params, views, strict=True):
        dim, grad = prepared.tp_dims.get(id(p)), p.grad
        if grad is not None and (dim is not None or place == 0):
            (view if dim is None else view.chunk(t, dim)[place]).copy_(grad.detach().cpu())
    if t > 1:
        transport.all_reduce(flat, mine)  # the group's whole gradients
    if place == 0 and len(leads) > 1:
        transport.all_reduce(flat, leads)
    if t > 1:
        if place:
            flat.zero_()
        transport.all_reduce(flat, mine)  # the sum, from the group's first rank
    for p, view in zip(params, views, strict=True):
        dim = prepared.tp_dims.get(id(p))
        p.grad = (view if dim is None else view.chunk(t, dim)[place]).to(p.device, copy=True)


def _whole_shape(p: torch.Tensor, dim: int | None, t: int) -> tuple[int, ...]:
    shape = list(p.shape)
    if dim is not None:
        shape[dim] *= t
    return tuple(shape)


def surround(runner, prepared) -> None:
    """A tensor-parallel worker's stages run their steps inside `running` (`StageRunner.around`)."""
    role = prepared.role
    if len(role.members(role.stage, role.replica)) > 1:
        vocab = any(getattr(m, "vocab_parallel", False) for ms in prepared.traces.by_rows.values() for m in ms)
        for stage_runner in runner.runners.values():
            stage_runner.around = functools.partial(running, prepared.device.type, vocab)
