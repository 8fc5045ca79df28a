"""Tracing a training step for `hetplan.pieces.split`: torch.export first, torch.fx with the
blocks as opaque leaves second, and when both fail one line that says where and what to do.

torch.export (non-strict) records every ATen op with the stack of modules that called it; torch.fx
with blocks as leaves only needs the code between blocks to be traceable. A model that does not
run on its batch at all is said to be that, not untraceable.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.fx.config
from torch import fx, nn

from hetplan.errors import HetplanError, first_line
from hetplan.pieces.random_settings import CHOOSES_PATH, random_settings


def trace_step(step: nn.Module, batch: Mapping[str, torch.Tensor], granularity: str, block_classes: Iterable[str],
               strip_prefix: str, export: fx.GraphModule | HetplanError | None = None
               ) -> tuple[fx.GraphModule, nn.Module, str]:
    """The traced step, the module its names refer to, and the prefix to strip from them;
    `export`: what `export_step` gave for this batch before (the module, or the error it raised),
    which does not depend on the granularity."""
    if export is None:
        try:
            export = export_step(step, batch)
        except DoesNotRun:
            raise
        except HetplanError as exc:
            export = exc
    if not isinstance(export, HetplanError):
        return export, step, strip_prefix
    if granularity != "block":
        raise HetplanError(f"{export}; or profile at --granularity block, where blocks are run, not traced "
                           "(--block-class NAME makes that module a block)") from None
    # Blocks as opaque leaves: torch.fx does not look inside them, so whatever they do is fine.
    root = _keyword_step(step, tuple(batch))
    return _fx_trace(root, set(block_classes), export), root, "inner." + strip_prefix


def _keyword_step(step: nn.Module, keys: tuple[str, ...]) -> nn.Module:
    """`step(**batch)` as a module whose forward names the batch's keys, which torch.fx can
    trace (it reads argument names from the code of the class's forward)."""
    if not all(k.isidentifier() for k in keys):
        raise HetplanError(f"batch keys must be Python names to trace the model, got {list(keys)}")
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {', '.join(keys)}):\n    return self.inner({', '.join(f'{k}={k}' for k in keys)})",
         namespace)
    cls = type("KeywordStep", (nn.Module,), {"forward": namespace["forward"]})
    wrapper = cls()
    wrapper.inner = step
    return wrapper


def _fx_trace(root: nn.Module, opaque: set[str], export_error: HetplanError) -> fx.GraphModule:
    class Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return type(m).__name__ in opaque or super().is_leaf_module(m, qualname)

    try:
        with _quiet_torch_logs():
            graph = Tracer().trace(root)
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes a message
        where = _failing_module(exc, root)
        hint = f"; make it a block with --block-class {where.split('(')[-1].rstrip(')')}" if where else ""
        raise HetplanError(
            f"{export_error}; with blocks ({', '.join(sorted(opaque)) or 'none found'}) as opaque units, "
            f"torch.fx fails too{where}: {type(exc).__name__}: {first_line(exc)}{hint}"
        ) from None
    return fx.GraphModule(root, graph)


def export_step(step: nn.Module, batch: Mapping[str, torch.Tensor]) -> fx.GraphModule:
    """`torch.export` the step in training mode; a failure names the module where it happened.
    A model that chooses in Python at random what runs is refused first: a trace would keep the
    one choice made while tracing (numpy's SpecAugment masks become constants, silently)."""
    if step.training and random_settings(step, CHOOSES_PATH):
        raise HetplanError(f"cannot trace the model: {_what_to_do(step)}")
    try:
        with _quiet_torch_logs(), _without_stack_traces():
            ep = torch.export.export(step, (), dict(batch), strict=False)
    except Exception as exc:  # noqa: BLE001 - any tracing failure becomes a message
        where = _failing_module(exc, step)
        _runs_as_it_is(step, batch)
        raise HetplanError(
            f"cannot trace the model{where}: {type(exc).__name__}: {first_line(exc)}; {_what_to_do(step)}"
        ) from None
    return ep.module()


def _what_to_do(step: nn.Module) -> str:
    chooses = random_settings(step, CHOOSES_PATH)
    if chooses:  # the usual cause where they are set: a random choice in Python of what runs
        said = ", ".join(f"{k}={v:g}" for k, v in chooses.items())
        return (f"the model chooses at random in Python which layers run or which frames it masks ({said}), which "
                "no trace can follow: build it with those at 0 (hetplan run --no-dropout sets them to 0)")
    return "make that module traceable by torch.export"


class DoesNotRun(HetplanError):
    """The model fails on its example batch untraced: no tracer or granularity can help."""


def _runs_as_it_is(step: nn.Module, batch: Mapping[str, torch.Tensor]) -> None:
    """When tracing fails, whether the model runs at all on its batch, untraced: if not, that is
    what to say (the batch's shapes do not fit the model), not how to make it traceable."""
    twin = copy.deepcopy(step)
    try:
        with torch.no_grad(), _quiet_torch_logs():
            twin(**batch)
    except Exception as exc:  # noqa: BLE001 - the user's model, failing as it is
        where = _failing_module(exc, twin)
        raise DoesNotRun(f"the model does not run on its example batch{where}: {type(exc).__name__}: "
                           f"{first_line(exc)}; check the batch the factory returns against the model") from None


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """torch.fx records the Python stack of every node it traces (`node.meta["stack_trace"]`),
    for torch's own debugging: 15-25 % of an export's time here, and nothing hetplan reads. Where
    torch has no switch for it (it came after 2.11), tracing records them as it always did."""
    config = torch.fx.config
    saved = getattr(config, "do_not_emit_stack_traces", None)
    if saved is None:
        yield
        return
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = saved


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """When export fails, torch logs warnings and writes the half-traced graph to stderr; the
    error we raise says what matters in one line, so both are held back while tracing."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def _failing_module(exc: BaseException, step: nn.Module) -> str:
    names = {id(m): n for n, m in step.named_modules()}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names and names[id(owner)]:
            qualname = names[id(owner)].removeprefix("inner.").removeprefix("model.")
            found = f" in module '{qualname}' ({type(owner).__name__})"
        tb = tb.tb_next
    return found
