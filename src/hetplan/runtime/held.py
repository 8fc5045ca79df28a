"""A worker's training state under the whole model's names: the checkpoint entries it writes
(`checkpoint.Entry`) and how it takes its own part of a checkpoint written by any plan.

What a worker holds of each tensor: a stage's replicas hold the same weights, buffers and optimizer
state, so the first replica writes them (and of a tensor-parallel replica, each worker its shards,
the first worker what the group holds whole); where the replicas shard their state
(`runtime.sharding`, `runtime.zero`) each writes its share of the weights and of the state, as
elements of each parameter flattened. Loading is the converse: every parameter and buffer whole from
the checkpoint, cut to the worker's shard where tensor-parallel, and the optimizer's state of each
tensor it steps (a share of several parameters laid end to end, for a sharded stage).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from hetplan.runtime.checkpoint import Entry, Reader, Region, cut

WHOLE: Region = ("whole",)


def names_of(model: nn.Module) -> dict[int, str]:
    """Each parameter's and buffer's name in the whole model, by id (a tied weight: its first name)."""
    return {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}


def slots(prepared) -> list[tuple[nn.Parameter, list[nn.Parameter], int, int]]:
    """The shares the worker's optimizer steps in its parameters' stead: (the share, the parameters
    laid end to end, the share's [lo, hi) in them)."""
    out = [(g.shard, g.params, *g.bounds[g.me]) for g in prepared.shards]
    out += [(u.shard, u.params, *u.bounds[units.me]) for units in prepared.units for u in units.units]
    return out


def _tp_region(prepared, tensor: torch.Tensor) -> tuple[Region, tuple[int, ...]]:
    """A tensor-parallel shard's region in the whole tensor and the whole's shape (shards are equal
    parts, `tensor_stage.local_shards`); any other tensor: whole."""
    dim = prepared.tp_dims.get(id(tensor))
    if dim is None:
        return WHOLE, tuple(tensor.shape)
    role = prepared.role
    degree, size = len(role.members(role.stage, role.replica)), tensor.shape[dim]
    shape = list(tensor.shape)
    shape[dim] = size * degree
    return ("dim", dim, role.position * size, (role.position + 1) * size), tuple(shape)


def entries(prepared, opt, names: Mapping[int, str]) -> list[Entry]:
    """What the worker writes to a checkpoint (see the module)."""
    role = prepared.role
    out: list[Entry] = []
    shared = set()
    for share, params, lo, hi in slots(prepared):
        out += _share_entries(share, params, lo, hi, _state(opt, share), names)
        shared.update(id(p) for p in params)
    if role.replica:
        return out
    mods = prepared.modules
    tensors = {id(t): (t, "param") for m in mods for t in m.parameters()}
    tensors.update({id(t): (t, "buffer") for m in mods for t in m.buffers() if id(t) in names})
    for key, (t, what) in tensors.items():
        region, shape = _tp_region(prepared, t)
        if key in shared or (role.position and region == WHOLE):
            continue
        out.append(Entry(names[key], what, region, shape, _copy(t)))
        for k, v in (_state(opt, t) if what == "param" else {}).items():
            out.append(Entry(names[key], k, region if v.dim() else WHOLE, shape if v.dim() else (), _copy(v)))
    return out


def _share_entries(share, params, lo: int, hi: int, state: Mapping[str, torch.Tensor],
                   names: Mapping[int, str]) -> list[Entry]:
    """A replica's share of parameters laid end to end, as parts of each parameter it covers."""
    out, at = [], 0
    for p in params:
        a, b = max(lo, at), min(hi, at + p.numel())
        if a < b:
            region, name = ("flat", a - at, b - at), names[id(p)]
            out.append(Entry(name, "param", region, tuple(p.shape), _copy(share.detach()[a - lo:b - lo])))
            for k, v in state.items():
                out.append(Entry(name, k, region, tuple(p.shape), _copy(v[a - lo:b - lo])) if v.dim() else
                           Entry(name, k, WHOLE, (), _copy(v)))
        at += p.numel()
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A tensor of its own on the host (torch.save writes a view's whole storage)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _state(opt, param) -> dict[str, torch.Tensor]:
    if opt is None:
        return {}
    return {k: v for k, v in opt.state_of(param).items() if isinstance(v, torch.Tensor)}


def load(reader: Reader, prepared, opt, names: Mapping[int, str]) -> None:
    """The worker's weights, buffers and optimizer state from a checkpoint of any plan (its
    sharded stages' parameters whole meanwhile: the caller's `ShardedUnits.whole(loaded=True)`)."""
    mods = prepared.modules
    with torch.no_grad():
        for t in {id(t): t for m in mods for t in (*m.parameters(), *m.buffers()) if id(t) in names}.values():
            what = "buffer" if not isinstance(t, nn.Parameter) else "param"
            t.copy_(cut(reader.whole(names[id(t)], what), _tp_region(prepared, t)[0]))
    if opt is None:
        return
    shared = set()
    for share, params, lo, hi in slots(prepared):
        keys = reader.state_keys(names[id(params[0])])
        state = {k: torch.cat([reader.whole(names[id(p)], k).reshape(-1) for p in params])[lo:hi]
                 for k in keys if k != "step"}
        if "step" in keys:
            state["step"] = reader.whole(names[id(params[0])], "step")
        opt.set_state(share, state)
        shared.update(id(p) for p in params)
    for p in prepared.parameters():
        if id(p) not in shared:
            region = _tp_region(prepared, p)[0]
            opt.set_state(p, {k: _cut_state(reader.whole(names[id(p)], k), region)
                              for k in reader.state_keys(names[id(p)])})


def _cut_state(full: torch.Tensor, region: Region) -> torch.Tensor:
    return full if full.dim() == 0 else cut(full, region).clone()
