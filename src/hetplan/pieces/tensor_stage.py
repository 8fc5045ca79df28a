"""A stage's pieces run tensor-parallel by a group of workers, on torch's DTensor (Megatron-LM's
split: `hetplan.pieces.tensor_split`); the runtime's stages and the profiler's timed groups
(`hetplan.profile.tensor_times`) both run them so.

Each worker of a group keeps its shard of every split parameter as a plain `Parameter` (and the
whole of the others), so that its optimizer, its gradient sums and its checkpoints see ordinary
tensors. In the forward, `TensorParallelStage` views them as DTensors on the group's mesh, the
stage's inputs as replicated DTensors, and runs the stage's pieces unchanged: a piece keeps the
global shapes `torch.export` recorded, and DTensor's sharding propagation turns each operator
into its local part and the collectives it needs. Autograd runs the mirror image in the
backward; the gradient of a replicated input or parameter comes out whole on every worker. The
outputs leave whole, so that the group's first worker sends them on as a stage without tensor
parallelism would.

Three things of the pieces' code change on a tensor-parallel stage (`parallelize`):
- the input of a column-split product and the output of a row-split one are made whole
  (`megatron_boundaries`): Megatron-LM's two all-reduces per block and pass, where DTensor left
  to itself keeps partial sums partial and gathers weights instead;
- `reshape` of a sharded, non-contiguous value (attention's output, transposed back) is made a
  `reshape` of a contiguous copy (DTensor's view of it would fail);
- on a CPU, attention runs torch's math kernel (`running`): the CPU's flash kernel has no
  sharding rule for its backward.
And where the stage ends in the loss of a head split by words (`tensor_split.class_split_loss`),
the loss is computed vocabulary-parallel (`running`); elsewhere (GPT-2's head, tied to its
embedding, is whole on every device) DTensor computes it as it would whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

import torch
from torch import fx, nn

from hetplan.pieces.tensor_split import (
    COLUMN_KIND,
    PRODUCTS,
    ROW_KIND,
    Split,
    class_split_loss,
    hidden_size,
    products_weights,
    tensor_splits,
)

_RESHAPE = torch.ops.aten.reshape.default
_EMBEDDING = torch.ops.aten.embedding.default


def local_shards(named: Mapping[str, nn.Parameter], splits: Mapping[str, Split], degree: int,
                 index: int) -> dict[int, nn.Parameter]:
    """Worker `index`'s shard of each split parameter, by the id of the whole one."""
    out = {}
    for name, prm in named.items():
        split = splits.get(name)
        if split is not None and split.dim is not None:
            part = prm.detach().chunk(degree, split.dim)[index].clone()
            out[id(prm)] = nn.Parameter(part, requires_grad=prm.requires_grad)
    return out


def swap_parameters(modules: Iterable[nn.Module], new: Mapping[int, nn.Parameter]) -> None:
    """Put `new[id(p)]` in place of every parameter p it names, in all `modules` and their children."""
    for root in modules:
        for module in root.modules():
            for key, prm in list(module._parameters.items()):
                if prm is not None and id(prm) in new:
                    module._parameters[key] = new[id(prm)]


def contiguous_reshapes(module: nn.Module) -> None:
    """Every `reshape` in `module`'s graphs reads a contiguous copy of its input (in place)."""
    for gm in module.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is _RESHAPE:
                with gm.graph.inserting_before(node):
                    copy = gm.graph.call_function(torch.ops.aten.clone.default, (node.args[0],),
                                                  {"memory_format": torch.contiguous_format})
                node.replace_input_with(node.args[0], copy)
        gm.recompile()


def parallelize(traced: list[nn.Module], model: nn.Module, degree: int, index: int,
                sequence_parallel: bool = False) -> tuple[list[TensorParallelStage], dict[int, int]]:
    """Worker `index` of a group of `degree`: one stage's modules (one per trace, sharing the
    model's parameters) made tensor-parallel, with `sequence_parallel` the values between
    projection pairs split along their tokens; the model and the traces then hold its shards.
    Returns them, and the dimension each shard splits by the shard's id."""
    names = {id(p): n for n, p in model.named_parameters()}
    held = {names[id(p)]: p for mod in traced for p in mod.parameters() if id(p) in names}
    splits = tensor_splits(model, degree, set(held))
    by_id = {id(p): splits[name] for name, p in held.items()}
    vocab = [class_split_loss(mod, {pid: split.kind for pid, split in by_id.items()}) for mod in traced]
    for mod in traced:
        megatron_boundaries(mod, by_id, sequence_parallel)
        contiguous_reshapes(mod)
    shards = local_shards(held, splits, degree, index)
    per_module = [{name: by_id[id(p)].dim if id(p) in by_id else None for name, p in mod.named_parameters()}
                  for mod in traced]
    swap_parameters([model, *traced], shards)
    dims = {id(shards[pid]): split.dim for pid, split in by_id.items() if pid in shards}
    stream = hidden_size(model) if sequence_parallel else 0
    return [TensorParallelStage(mod, placements, stream, v) for mod, placements, v in zip(traced, per_module, vocab,
                                                                                           strict=True)], dims


def replicated(x):
    """Megatron-LM's f and g operators in one: `x` whole on every device (summing partial sums:
    an all-reduce), and its gradient whole too (summing the partial gradients of the devices'
    column shards: an all-reduce in the backward)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(x, DTensor):
        return x
    whole = x.redistribute(x.device_mesh, [Replicate()]) if x.placements != (Replicate(),) else x
    return DTensor.from_local(whole.to_local(grad_placements=[Replicate()]), x.device_mesh, [Replicate()],
                              run_check=False)


def gathered(x):
    """Sequence parallelism's entry to a column-split product (Korthikanti et al. 2022): a value
    split along its tokens made whole on every device (an all-gather), the partial sums of its
    gradient reduce-scattered back to the split; a whole value as `replicated` makes it."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(x, DTensor) and any(p.is_shard() for p in x.placements):
        return x.redistribute(x.device_mesh, [Replicate()])
    return replicated(x)


def to_tokens(x):
    """A whole value split along its tokens (the dimension before the features), each device
    taking its share (no communication; the gradient all-gathered): where sequence parallelism's
    residual stream starts."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(x, DTensor) and x.dim() >= 2 and x.placements == (Replicate(),):
        return x.redistribute(x.device_mesh, [Shard(x.dim() - 2)])
    return x


def scattered(x):
    """Sequence parallelism's exit from a row-split product: its partial sums summed into each
    device's share of the tokens (a reduce-scatter; the dimension before the features), the
    gradient made whole (an all-gather)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(x, DTensor) or x.dim() < 2:
        return replicated(x)
    return x.redistribute(x.device_mesh, [Shard(x.dim() - 2)])


def megatron_boundaries(module: nn.Module, splits: Mapping[int, Split], sequence_parallel: bool = False) -> None:
    """In every graph of `module`: the input of a product with a column-split weight, and the
    output of one with a row-split weight, made `replicated` (in place; `splits` by parameter id);
    with `sequence_parallel`, `gathered` and `scattered` instead, and each embedding's output split
    along its tokens (`to_tokens`: the residual stream, which a residual's sum would otherwise
    make whole again)."""
    enter, leave = (gathered, scattered) if sequence_parallel else (replicated, replicated)
    for gm in module.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        made: dict[fx.Node, fx.Node] = {}  # one entry per value, shared by the products that read it (q, k, v)
        for node in list(gm.graph.nodes):
            if sequence_parallel and node.op == "call_function" and node.target is _EMBEDDING:
                _after(gm, node, to_tokens)
            if node.op != "call_function" or node.target not in PRODUCTS:
                continue
            kinds = {splits[id(p)].kind for p in products_weights(gm, node) if id(p) in splits} - {""}
            if COLUMN_KIND in kinds:
                for arg in [a for a in node.args if isinstance(a, fx.Node) and a.op != "get_attr"]:
                    if arg not in made:  # before its first product, which comes before the others
                        with gm.graph.inserting_before(node):
                            made[arg] = gm.graph.call_function(enter, (arg,))
                    node.replace_input_with(arg, made[arg])
            if ROW_KIND in kinds:
                _after(gm, node, leave)
        gm.recompile()


def _after(gm: fx.GraphModule, node: fx.Node, fn) -> None:
    """Every use of `node`'s value in `gm` made a use of `fn(value)`."""
    with gm.graph.inserting_after(node):
        out = gm.graph.call_function(fn, (node,))
    node.replace_all_uses_with(out, delete_user_cb=lambda user, out=out: user is not out)


class TensorParallelStage(nn.Module):
    """`inner` (a stage's module, holding this worker's shards) run on a group's mesh; the mesh is
    given once the group's processes are connected (`attach`). Its forward and backward run
    inside `running` (the executor's step does: `StageRunner.around`)."""

    def __init__(self, inner: nn.Module, placements: Mapping[str, int | None], stream: int = 0,
                 vocab_parallel: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.spec = getattr(inner, "spec", None)
        self.dims = dict(placements)  # by the inner module's parameter names: the dimension split, or None
        # sequence-parallel: the residual stream's width; a received value of that many features
        # enters split along its tokens (`to_tokens`), as the stage before held it
        self.stream = stream
        # its loss is computed on the logits split by words (`class_split_loss`): run inside
        # `running(..., vocab_parallel=True)`
        self.vocab_parallel = vocab_parallel
        self.mesh = None

    def attach(self, mesh) -> None:
        self.mesh = mesh

    @property
    def graph(self) -> fx.Graph:
        """The inner piece's graph (what reads a piece's code, `split.changed_in_place`, reads)."""
        return self.inner.graph

    def forward(self, *values: torch.Tensor):
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.func import functional_call

        if self.mesh is None:
            raise RuntimeError("a tensor-parallel stage runs once its group's mesh is attached")
        mesh = self.mesh

        def dist(x: torch.Tensor, dim: int | None = None) -> DTensor:
            return DTensor.from_local(x, mesh, [Replicate() if dim is None else Shard(dim)], run_check=False)

        params = {name: dist(prm, self.dims.get(name)) for name, prm in self.inner.named_parameters()}
        inputs = tuple(self._entered(dist(v)) if isinstance(v, torch.Tensor) else v for v in values)
        out = functional_call(self.inner, params, inputs)
        if isinstance(out, tuple):
            return tuple(_whole(v) for v in out)
        return _whole(out)

    def _entered(self, value):
        if self.stream and value.is_floating_point() and value.dim() == 3 and value.shape[-1] == self.stream:
            return to_tokens(value)
        return value


def _whole(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


@contextlib.contextmanager
def running(device_type: str, vocab_parallel: bool = False):
    """What a tensor-parallel stage's forward and backward run inside: tensors the pieces make
    (position ids, masks) and buffers count as replicated; a CPU's attention is torch's math kernel;
    with `vocab_parallel`, the cross-entropy of logits split by words computed on the split
    (torch's `loss_parallel`: log-softmax and the loss with all-reduces of one number per token,
    the logits' gradient made in place, never gathering the logits; Megatron-LM's vocabulary-parallel
    cross-entropy). Not to be nested: torch's `implicit_replication` switches itself off on leaving."""
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import loss_parallel

    with implicit_replication(), contextlib.ExitStack() as stack:
        if vocab_parallel:
            stack.enter_context(loss_parallel())
        if device_type == "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        yield
