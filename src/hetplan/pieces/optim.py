"""A stage's optimizer, for dense and sparse gradients alike.

Embedding tables built with `sparse=True` (`nn.EmbeddingBag`, as in click-through-rate models:
HeterPS's workload) produce sparse gradients: only the rows a batch looked up. torch's Adam
refuses them; `torch.optim.SparseAdam` takes only them. So a stage trained with Adam gets Adam
over its parameters with dense gradients and SparseAdam over those with sparse ones (the lazy
variant of Adam that updates the moments of the rows looked up, as large-scale CTR training
does). Which parameters are which is known from the model when it says (`sparse_ids`: the runtime
passes its tables built with `sparse=True`, so a table no replica looked up at the first step is
still a table); else it shows once a backward pass has made their gradients, and the two are
made at the first step (a resumed run's from its state dict, which records the split, or where
a checkpoint sets a parameter's state). SGD accepts both kinds and is one optimizer.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn


class StageOptimizer:
    """`step`, `state_dict` and `load_state_dict` over a stage's parameters, whatever the kind of
    their gradients (see the module's docstring); `kind` is "adam" or "sgd"."""

    def __init__(self, params: Iterable[nn.Parameter], kind: str, lr: float,
                 sparse_ids: Collection[int] | None = None) -> None:
        self.params, self.kind, self.lr = list(params), kind, lr
        self.sparse: list[bool] | None = None  # per parameter, once known
        self.optimizers: list[torch.optim.Optimizer] = []
        if kind == "sgd":
            self._make([False] * len(self.params))
        elif sparse_ids is not None:  # known from the model (`gradients.sparse_parameter_ids`)
            self._make([id(p) in sparse_ids for p in self.params])

    def _make(self, sparse: list[bool]) -> None:
        self.sparse = sparse
        if self.kind == "sgd":
            self.optimizers = [torch.optim.SGD(self.params, lr=self.lr)]
            return
        dense = [p for p, s in zip(self.params, sparse, strict=True) if not s]
        rows = [p for p, s in zip(self.params, sparse, strict=True) if s]
        self.optimizers = ([torch.optim.Adam(dense, lr=self.lr)] if dense else []) + (
            [torch.optim.SparseAdam(rows, lr=self.lr)] if rows else [])

    def step(self) -> None:
        if self.sparse is None:
            self._make([p.grad is not None and p.grad.is_sparse for p in self.params])
        for opt in self.optimizers:
            opt.step()

    def state_bytes(self) -> int:
        """The bytes of the optimizer's state tensors (Adam's moments; nothing before a step)."""
        return sum(t.numel() * t.element_size() for opt in self.optimizers for st in opt.state.values()
                   for t in st.values() if isinstance(t, torch.Tensor))

    def state_of(self, param: torch.Tensor) -> dict:
        """The optimizer's state of one of its parameters (empty before its first step, and for SGD)."""
        return next((dict(opt.state[param]) for opt in self.optimizers if param in opt.state), {})

    def set_state(self, param: torch.Tensor, state: dict) -> None:
        """Set one parameter's state (a checkpoint's, `runtime.held`), each tensor on the parameter's
        device and in its dtype, Adam's step count where torch keeps it (on the host, fp32)."""
        if not state:
            return
        if self.sparse is None:  # made at the first step otherwise: the state says there was one
            self._make([False] * len(self.params))
        opt = next(o for o in self.optimizers if any(param is q for g in o.param_groups for q in g["params"]))
        opt.state[param] = {k: v.to(torch.float32) if k == "step" else v.to(param.device, param.dtype)
                            for k, v in state.items()}

    def state_dict(self) -> dict:
        return {"kind": self.kind, "sparse": self.sparse, "optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("sparse") is None:  # saved before any step: nothing to restore
            return
        self._make(list(state["sparse"]))
        for opt, saved in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
