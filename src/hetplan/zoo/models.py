"""The zoo's models and their builders (imported only when a model is built: it needs torch).

The language and vision models are `transformers` model classes built from a configuration
with random weights (`HF_HUB_OFFLINE=1` is set before transformers is imported); `InceptionTiny`
and `MLP` are written here.
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from hetplan.errors import HetplanError
from hetplan.zoo.losses import traceable_loss
from hetplan.zoo.model import ZooModel


class TrainStep(nn.Module):
    """Wraps a model and its loss into one module whose forward returns the loss.

    The wrapped model is `self.model`, so module names inside are `model.<name>`; the profiler
    strips that prefix when it records which modules a node covers."""

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]):
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return self._loss(self.model, batch)


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def transformers_machinery() -> None:
    """Import what every transformers model's module imports first (most of the time it takes)."""
    _transformers()
    import transformers.modeling_utils  # noqa: F401


def _lm_batch(batch_size: int, seq_len: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _image_batch(batch_size: int, size: int, classes: int, seed: int, key: str = "pixel_values"):
    gen = torch.Generator().manual_seed(seed)
    return {key: torch.randn(batch_size, 3, size, size, generator=gen),
            "labels": torch.randint(0, classes, (batch_size,), generator=gen)}


def gpt2(batch_size: int, seq_len: int, seed: int, *, layers: int, embd: int, heads: int, vocab: int,
         positions: int) -> ZooModel:
    tf = _transformers()
    _check_seq(seq_len, positions)
    cfg = tf.GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, vocab_size=vocab, n_positions=positions,
                        use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = tf.GPT2LMHeadModel(cfg)
    return ZooModel("", TrainStep(model, _hf_loss), _lm_batch(batch_size, seq_len, vocab, seed), ("GPT2Block",))


def bert(batch_size: int, seq_len: int, seed: int, *, layers: int = 12) -> ZooModel:
    tf = _transformers()
    _check_seq(seq_len, 512)
    cfg = tf.BertConfig(num_hidden_layers=layers, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = tf.BertForMaskedLM(cfg)
    return ZooModel("", TrainStep(model, _hf_loss), _lm_batch(batch_size, seq_len, cfg.vocab_size, seed),
                    ("BertLayer",))


def llama_tiny(batch_size: int, seq_len: int, seed: int) -> ZooModel:
    tf = _transformers()
    _check_seq(seq_len, 512)
    cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg)
    return ZooModel("", TrainStep(model, _hf_loss), _lm_batch(batch_size, seq_len, 256, seed),
                    ("LlamaDecoderLayer",))


def resnet50(batch_size: int, seq_len: int, seed: int, *, depths: tuple[int, ...] = (3, 4, 6, 3)) -> ZooModel:
    tf = _transformers()
    cfg = tf.ResNetConfig(num_labels=1000, depths=list(depths))  # (3, 4, 6, 3): ResNet-50
    torch.manual_seed(seed)
    model = tf.ResNetForImageClassification(cfg)
    return ZooModel("", TrainStep(model, _hf_loss), _image_batch(batch_size, 224, 1000, seed),
                    ("ResNetBottleNeckLayer",))


def vit_base(batch_size: int, seq_len: int, seed: int, *, layers: int = 12) -> ZooModel:
    tf = _transformers()
    # the default configuration, at 12 layers: ViT-B/16 at 224x224
    cfg = tf.ViTConfig(num_labels=1000, num_hidden_layers=layers, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = tf.ViTForImageClassification(cfg)
    return ZooModel("", TrainStep(model, _hf_loss), _image_batch(batch_size, 224, 1000, seed), ("ViTLayer",))


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int, k: int):
        super().__init__(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class InceptionBranch(nn.Sequential):
    """One parallel branch of an Inception module."""


class InceptionModule(nn.Module):
    """Four parallel branches (1x1; 1x1-3x3; 1x1-3x3-3x3; pool-1x1) joined by concatenation,
    as in Szegedy et al., "Rethinking the Inception Architecture" (2016), at toy width."""

    def __init__(self, cin: int, width: int):
        super().__init__()
        self.branches = nn.ModuleList([
            InceptionBranch(ConvBNReLU(cin, width, 1)),
            InceptionBranch(ConvBNReLU(cin, width, 1), ConvBNReLU(width, width, 3)),
            InceptionBranch(ConvBNReLU(cin, width, 1), ConvBNReLU(width, width, 3), ConvBNReLU(width, width, 3)),
            InceptionBranch(nn.MaxPool2d(3, stride=1, padding=1), ConvBNReLU(cin, width, 1)),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


class InceptionTiny(nn.Module):
    def __init__(self, classes: int = 10, width: int = 16, modules: int = 3):
        super().__init__()
        self.stem = ConvBNReLU(3, 2 * width, 3)
        self.blocks = nn.Sequential(*[InceptionModule(2 * width if i == 0 else 4 * width, width)
                                      for i in range(modules)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def _classifier_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["labels"])


def inception_tiny(batch_size: int, seq_len: int, seed: int) -> ZooModel:
    torch.manual_seed(seed)
    return ZooModel("", TrainStep(InceptionTiny(), _classifier_loss), _image_batch(batch_size, 32, 10, seed, "x"),
                    ("InceptionBranch",))


class MLP(nn.Sequential):
    def __init__(self, dims: tuple[int, ...] = (784, 1024, 1024, 1024, 1024, 10)):
        layers: list[nn.Module] = []
        for i in range(len(dims) - 1):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < len(dims) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


def mlp(batch_size: int, seq_len: int, seed: int) -> ZooModel:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(batch_size, 784, generator=gen),
             "labels": torch.randint(0, 10, (batch_size,), generator=gen)}
    return ZooModel("", TrainStep(MLP(), _classifier_loss), batch, ("Linear",))


class EmbeddingShard(nn.Module):
    """Some of the embedding tables, looked up together: one block at `--granularity block`,
    so a plan can put the shards on different workers (as HeterPS spreads a CTR model's tables
    over CPU servers). Each table is a module of its own, named by its Criteo field (C1-C26),
    and is one node at `--granularity layer`."""

    def __init__(self, fields: tuple[int, ...], tables: tuple[int, ...], dim: int, sparse: bool):
        super().__init__()
        self.fields = fields
        self.tables = nn.ModuleDict({f"C{f + 1}": nn.EmbeddingBag(tables[f], dim, mode="sum", sparse=sparse)
                                     for f in fields})

    def forward(self, ids: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # ids: the 26 columns [B] of 32-bit hashes; the hashing trick folds them into each table's
        # rows, and a [B, 1] input makes every bag look up one id per sample.
        return torch.cat([bag((ids[f] % bag.num_embeddings).unsqueeze(1))
                          for f, bag in zip(self.fields, self.tables.values(), strict=True)], dim=1)


def _shards(tables: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The fields grouped into shards of at most the largest table's rows (first fit, biggest
    table first): with the default tables, each 1M-row table alone and the 21 small ones together,
    so the shards hold similar memory. Fields keep their order within a shard and shards are
    ordered by their first field."""
    cap = max(tables)
    shards: list[list[int]] = []
    for f in sorted(range(len(tables)), key=lambda f: (-tables[f], f)):
        room = next((s for s in shards if sum(tables[g] for g in s) + tables[f] <= cap), None)
        if room is None:
            shards.append([f])
        else:
            room.append(f)
    return sorted(tuple(sorted(s)) for s in shards)


class CTRDNN(nn.Module):
    """The CTR model of HeterPS's case: raw Criteo lines -> parser -> one embedding bag per
    categorical field -> concatenated with the 13 dense features -> MLP -> click logit."""

    def __init__(self, tables: tuple[int, ...], dim: int, hidden: tuple[int, ...], sparse: bool):
        super().__init__()
        from hetplan.zoo.criteo import DENSE_FIELDS, CriteoParser

        self.parser = CriteoParser(columns=True)
        self.shards = nn.ModuleList([EmbeddingShard(s, tables, dim, sparse) for s in _shards(tables)])
        self.mlp = MLP((DENSE_FIELDS + len(tables) * dim, *hidden, 1))

    def forward(self, lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels [B], logits [B])."""
        labels, dense, ids = self.parser(lines)
        x = torch.cat([dense, *(shard(ids) for shard in self.shards)], dim=1)
        return labels, self.mlp(x).squeeze(1)


def _click_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    labels, logits = model(batch["lines"])
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def ctr_dnn(batch_size: int, seq_len: int, seed: int, *, tables: tuple[int, ...] | None = None, dim: int = 16,
            hidden: tuple[int, ...] = (512, 256, 128), sparse: bool = True) -> ZooModel:
    """The CTR model on a synthetic Criteo log (`hetplan.zoo.criteo`); `tables` are the rows of
    the 26 embedding tables (default: the Kaggle data set's, capped at 1M rows). With `sparse`,
    the tables' gradients are sparse tensors: an optimizer must accept them (SGD, SparseAdam)."""
    from hetplan.zoo.criteo import DEFAULT_TABLES, click_batch

    tables = tuple(DEFAULT_TABLES if tables is None else tables)
    batch = click_batch(batch_size, 0, seed, tables)  # checks the tables
    torch.manual_seed(seed)
    model = CTRDNN(tables, dim, tuple(hidden), sparse)
    return ZooModel("", TrainStep(model, _click_loss), batch, ("EmbeddingShard",),
                    batches=functools.partial(_click_batches, batch_size, tables))


def _check_seq(seq_len: int, limit: int) -> None:
    if not 1 <= seq_len <= limit:
        raise HetplanError(f"--seq-len {seq_len}: this model takes 1 to {limit} positions")




def _click_batches(batch_size: int, tables, step: int, seed: int) -> dict:
    """ctr-dnn's data for `hetplan run`: the step's lines of the synthetic click log."""
    from hetplan.zoo.criteo import click_batch

    return click_batch(batch_size, step, seed, tables)


def user_model(ref: str, batch_size: int | None, seq_len: int | None) -> ZooModel:
    """`module.path:factory`: the factory returns a ZooModel or a (model, batch dict) pair."""
    from collections.abc import Mapping

    module_name, _, attr = ref.partition(":")
    module = _import_user_module(ref, module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise HetplanError(f"{ref}: module {module_name!r} has no callable {attr!r}")
    kwargs = {k: v for k, v in (("batch_size", batch_size), ("seq_len", seq_len)) if v}
    made = _call_factory(ref, factory, kwargs)
    if isinstance(made, ZooModel):
        return ZooModel(made.name or ref, made.step, made.batch, made.block_classes, made.batches)
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module) and isinstance(made[1], Mapping):
        model, batch = made
        return ZooModel(ref, TrainStep(model, traceable_loss(model, batch) or _output_loss), dict(batch), ())
    raise HetplanError(f"{ref}: the factory must return a hetplan.zoo.ZooModel or a (model, batch dict) pair")


def _call_factory(ref: str, factory, kwargs: dict) -> Any:
    """The user's factory called with the sizes given, or one line that says what went wrong: a
    size it takes no parameter for, or what it raised and where."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        missing = [k for k in kwargs if k not in params]
        if missing:
            flags = " and ".join(f"--{k.replace('_', '-')}" for k in missing)
            raise HetplanError(f"{ref}: the factory takes no {' or '.join(missing)}; give it that keyword "
                               f"parameter, or leave out {flags}")
    try:
        return factory(**kwargs)
    except HetplanError:
        raise
    except SystemExit as exc:
        raise HetplanError(f"{ref}: the factory called exit({exc.code!r}); return the model and its batch "
                           "instead") from None
    except Exception as exc:  # the user's code: say what and where, in one line
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise HetplanError(f"{ref}: the factory raised {type(exc).__name__}: {exc} "
                           f"(at {os.path.basename(frame.filename)}:{frame.lineno})") from None


def _import_user_module(ref: str, module_name: str):
    """Import a user's module the way `python -m` finds it: the current folder first, then the
    Python path (the `hetplan` command, unlike `python -m`, does not put the current folder there)."""
    import importlib
    import sys

    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise HetplanError(f"{ref}: no module {module_name!r} in the current folder ({here}) or on the Python "
                               "path; run hetplan from the folder that holds it, or add that folder to PYTHONPATH"
                               ) from None
        raise HetplanError(f"{ref}: importing {module_name!r} failed: {exc}") from None
    except ImportError as exc:
        raise HetplanError(f"{ref}: importing {module_name!r} failed: {exc}") from None
    except SyntaxError as exc:  # the module's text is not Python: where, in one line
        raise HetplanError(f"{ref}: {module_name!r} is not valid Python: {exc.msg} "
                           f"(at {os.path.basename(exc.filename or '?')}:{exc.lineno}); fix the file") from None
    except Exception as exc:  # noqa: BLE001 - the module's own code failed while it was imported
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise HetplanError(f"{ref}: importing {module_name!r} raised {type(exc).__name__}: {exc} "
                           f"(at {os.path.basename(frame.filename)}:{frame.lineno})") from None


def output_loss(out: Any) -> torch.Tensor:
    """The loss in a model's output: its `.loss` (a transformers ModelOutput), or the mean of
    the output tensor. While torch.fx traces the model `out` may be a Proxy (which has every
    attribute) of a module it does not look into: then the test is left to run time."""
    if isinstance(out, fx.Proxy):  # an opaque module's output: its type is known only when it runs
        return out.tracer.create_proxy("call_function", output_loss, (out,), {})
    if not isinstance(out, torch.Tensor) and hasattr(type(out), "loss"):
        out = out.loss
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    if not isinstance(out, torch.Tensor | fx.Proxy):
        raise HetplanError("the model's output is not a tensor: pass loss_fn to turn it into the loss")
    return out.float().mean()


def _output_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return output_loss(model(**batch))
