"""Pieces that run on any device: what tracing on one machine bakes into a graph, taken out.

`torch.export` records the step as it ran on the tracing device, and three things in such a
graph hold only there (all three broke GPU stages traced on a CPU, evidence box-2026-11):

- device constants: `arange(..., device=cpu)`, `to(..., device=cpu)`, `zeros(..., device=cpu)`
  build tensors on the tracing device. `place` rewrites every device argument to the device the
  piece runs on.
- metadata assertions: `aten._assert_tensor_metadata(x, dtype=..., device=cpu)` checks that a
  value is where it was during tracing; it checks nothing else, so `portable` drops it.
- memory layouts: the model's `reshape` (and `flatten`) are recorded as `view` when the tracing
  device's strides allowed a view; another device's kernels (CUDA's attention) may return other
  strides, where `view` fails. `portable` records them as `reshape` again, which is a view
  whenever `view` would work, and a copy otherwise.

Both passes walk nested graphs too (higher-order ops such as `wrap_with_set_grad_enabled` carry
their body as a sub-module).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn

_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default}
_VIEWS = {torch.ops.aten.view.default: torch.ops.aten.reshape.default}


def _graph_modules(module: nn.Module) -> Iterator[fx.GraphModule]:
    for sub in module.modules():
        if isinstance(sub, fx.GraphModule):
            yield sub


def portable(module: nn.Module) -> nn.Module:
    """Drop metadata assertions and turn views into reshapes in every graph of `module` (in place)."""
    for gm in _graph_modules(module):
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in _ASSERTS and not node.users:
                gm.graph.erase_node(node)
                changed = True
            elif node.target in _VIEWS:
                node.target = _VIEWS[node.target]
                changed = True
        if changed:
            gm.recompile()
    return module


def _retarget(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.device):
        return device
    if isinstance(value, tuple | list):
        return type(value)(_retarget(v, device) for v in value)
    return value


def place(module: nn.Module, device: str | torch.device) -> nn.Module:
    """Make every device argument in `module`'s graphs `device`, then move it there (in place)."""
    device = torch.device(device)
    for gm in _graph_modules(module):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                node.args = _retarget(node.args, device)
                node.kwargs = {k: _retarget(v, device) for k, v in node.kwargs.items()}
        gm.recompile()
    return module.to(device)


def baked_devices(module: nn.Module) -> set[str]:
    """The devices named by arguments in `module`'s graphs (a test: none but the one it is placed on)."""
    found: set[str] = set()

    def visit(value: Any) -> None:
        if isinstance(value, torch.device):
            found.add(str(value))
        elif isinstance(value, tuple | list):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    for gm in _graph_modules(module):
        for node in gm.graph.nodes:
            visit(node.args)
            visit(node.kwargs)
    return found
