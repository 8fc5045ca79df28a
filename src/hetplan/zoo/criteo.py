"""Synthetic click logs in the Criteo format, and the parser that turns them into tensors.

A click-through-rate (CTR) workload is the case HeterPS was built for (Liu et al., "HeterPS:
Distributed Deep Learning With Reinforcement Learning Based Scheduling in Heterogeneous
Environments", 2021/FGCS 2023): its layers differ in kind, not only in size. Reading raw log
lines and looking up huge, sparsely touched embedding tables are data- and memory-bound work
that suits CPUs; the dense tower that follows suits accelerators. To make that visible to the
profiler and the planners, the parsing of the raw lines is part of the model (`CriteoParser`),
not of a data loader that nobody times.

The lines follow Criteo's Display Advertising Challenge format (Criteo Labs, 2014, the Kaggle
data set DLRM and most CTR papers train on): one sample per line, 40 tab-separated fields:
the label (1 clicked, 0 not), 13 integer features I1-I13 (counts; a field may be empty when the
value is missing) and 26 categorical features C1-C26, each a 32-bit hash written as 8
lowercase hexadecimal digits. The real data cannot be downloaded here, so `write_click_log`
writes lines with the same shape: ids drawn from a Zipf law (a few ids are hot, as in real
logs, which is what makes sparse updates and caching matter) and labels drawn from a hidden
logistic model of the features, so that a model trained on them learns something real.

The parser is a torch custom op (`hetplan::parse_criteo`) called from a leaf module: the
profiler traces models with `torch.export`, which records the op as one call inside that
module, so the parser becomes a node of its own at `--granularity layer` and `block` alike
(plain Python parsing in `forward` cannot be traced: export needs tensors all the way).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import nn

from hetplan.errors import HetplanError, InputError, shown

DENSE_FIELDS = 13
CAT_FIELDS = 26
FIELDS = 1 + DENSE_FIELDS + CAT_FIELDS

# Room for any Criteo line whose integer features are below 10^10: 1 label + 13 x 10 digits +
# 26 x 8 hex digits + 39 tabs = 378 bytes. The generator keeps its values far below that.
LINE_BYTES = 384

# The 26 tables of the Kaggle data set (the number of distinct ids of C1-C26, as DLRM lists
# them for kaggleAdDisplayChallenge_processed.npz: 33.8M rows in all).
KAGGLE_ROWS = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
# Hashed into at most a million rows each, as DLRM's `--max-ind-range` does: five tables of 1M
# rows and 21 small ones, 5.57M rows, 356 MB at fp32 with 16 dimensions. Big enough that where
# the tables live matters to a plan, small enough to fit one worker's memory.
TABLE_CAP_ROWS = 1_000_000
DEFAULT_TABLES = tuple(min(rows, TABLE_CAP_ROWS) for rows in KAGGLE_ROWS)

# A fixed log size rather than one per batch size: every batch size, stage and worker reads the
# same cached file, and 65,536 samples are 256 distinct steps at the default batch of 256 (enough
# for the learning curves a test or a demo run looks at) while the file stays near 20 MB.
LOG_ROWS = 65_536
_FORMAT = 1  # part of the cache file's name: bump it when the generator changes what it writes

ZIPF_EXPONENT = 1.1  # p(rank r) ~ r^-1.1: the hottest id of a 1M-row table is ~12% of all samples
_BUCKETS = 4096  # the hidden model has one weight per (field, row mod _BUCKETS)
_HEX = np.array([f"{i:02x}".encode() for i in range(256)], dtype="S2").view(np.uint8).reshape(256, 2)
_HEX.setflags(write=False)  # a constant: byte -> its two hex digits


def _check_tables(tables: Sequence[int]) -> tuple[int, ...]:
    tables = tuple(int(t) for t in tables)
    if len(tables) != CAT_FIELDS or min(tables) < 1 or max(tables) > 2**32:
        raise HetplanError(f"tables {shown(tables)}: give {CAT_FIELDS} table sizes (rows) from 1 to 2^32, "
                           "one per categorical field of the Criteo format")
    return tables


@dataclass(frozen=True)
class _HiddenModel:
    """What decides the clicks: the ids' hash constants and the logistic model's weights."""

    mult: np.ndarray  # [26] odd uint64: id rank -> 32-bit hash, a bijection (`_hashes`)
    add: np.ndarray  # [26] uint64
    cat_w: np.ndarray  # [26, _BUCKETS]
    dense_w: np.ndarray  # [13]
    dense_mu: np.ndarray  # [13] log-normal parameters of the integer features
    dense_sigma: np.ndarray  # [13]
    missing: np.ndarray  # [13] the probability that an integer feature is empty


def _hidden_model(rng: np.random.Generator) -> _HiddenModel:
    return _HiddenModel(
        mult=rng.integers(0, 2**31, CAT_FIELDS, dtype=np.uint64) * 2 + 1,
        add=rng.integers(0, 2**32, CAT_FIELDS, dtype=np.uint64),
        cat_w=rng.normal(0.0, 1.0, (CAT_FIELDS, _BUCKETS)),
        dense_w=rng.normal(0.0, 0.5, DENSE_FIELDS),
        dense_mu=rng.uniform(0.0, 4.0, DENSE_FIELDS),
        dense_sigma=rng.uniform(0.5, 1.5, DENSE_FIELDS),
        missing=rng.uniform(0.0, 0.4, DENSE_FIELDS),
    )


def _zipf_ranks(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """n draws of a rank in [0, rows) with p(r) ~ (r+1)^-s: the Zipf law bounded to the table
    (numpy's `zipf` is unbounded, and folding its tail back would distort the head)."""
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF_EXPONENT)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
    return np.minimum(ranks, rows - 1)


def _hashes(ranks: np.ndarray, hidden: _HiddenModel, field: int) -> np.ndarray:
    """The 32-bit id of each rank: an odd multiplier is a bijection modulo 2^32, so distinct ids
    stay distinct, and hot ids land anywhere in the table once taken modulo its rows, as real
    hashed ids do (the model's hashing trick may still make two ids share a row)."""
    return (ranks.astype(np.uint64) * hidden.mult[field] + hidden.add[field]) % np.uint64(2**32)


def _samples(rows: int, seed: int, tables: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels [n], dense [n, 13] with -1 for missing, ids [n, 26] uint64), all from `seed`."""
    model_rng, data_rng = np.random.default_rng(seed).spawn(2)
    hidden = _hidden_model(model_rng)
    dense = np.floor(data_rng.lognormal(hidden.dense_mu, hidden.dense_sigma, (rows, DENSE_FIELDS)))
    dense = np.minimum(dense, 10**9 - 1).astype(np.int64)
    dense[data_rng.random((rows, DENSE_FIELDS)) < hidden.missing] = -1
    ids = np.stack([_hashes(_zipf_ranks(data_rng, t, rows), hidden, f) for f, t in enumerate(tables)], axis=1)
    # The model sees row = id mod rows; the hidden weights depend on that row only, so they are learnable.
    buckets = (ids % np.array(tables, dtype=np.uint64)) % np.uint64(_BUCKETS)
    cat_score = hidden.cat_w[np.arange(CAT_FIELDS), buckets.astype(np.int64)].sum(axis=1) / np.sqrt(CAT_FIELDS)
    dense_score = (np.log1p(np.maximum(dense, 0)) - hidden.dense_mu) @ hidden.dense_w / np.sqrt(DENSE_FIELDS)
    # a bias of -1.6 gives click rates of 15-33% by seed (Criteo's Kaggle data: 26%)
    logits = -1.6 + 1.5 * cat_score + dense_score
    labels = (data_rng.random(rows) < 1.0 / (1.0 + np.exp(-logits))).astype(np.int64)
    return labels, dense, ids


def _format_lines(labels: np.ndarray, dense: np.ndarray, ids: np.ndarray) -> list[bytes]:
    hexes = _HEX[ids.astype(">u4").view(np.uint8)].reshape(len(ids), CAT_FIELDS, 8)
    lines = []
    for label, ints, hx in zip(labels.tolist(), dense.tolist(), hexes, strict=True):
        fields = [str(label).encode(), *(b"" if v < 0 else str(v).encode() for v in ints),
                  *(bytes(h) for h in hx)]
        lines.append(b"\t".join(fields))
    return lines


def write_click_log(path: str | os.PathLike, rows: int, seed: int, tables: Sequence[int]) -> Path:
    """Write `rows` synthetic samples in the Criteo text format to `path`; same arguments, same bytes.

    Written to a temporary file beside `path` and renamed, so a reader never sees half a log
    (two workers may create the same cached log at once)."""
    if rows < 1:
        raise HetplanError(f"rows {rows}: a click log needs at least one line")
    lines = _format_lines(*_samples(rows, seed, _check_tables(tables)))
    path = Path(path)
    _write_atomic(path, lambda out: out.write(b"\n".join(lines) + b"\n"))
    return path


def _write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write` into a temporary file beside `path`, then rename it to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a cache is for every process that reads it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _ints(values: list[bytes], base: int, field: str) -> np.ndarray:
    """The integers of one column (empty is 0); a bad value names its line (from 1) and field."""
    try:
        return np.array([int(v, base) if v else 0 for v in values], dtype=np.int64)
    except ValueError:
        i = next(i for i, v in enumerate(values) if v and not _is_int(v, base))
        kind = "a hexadecimal id" if base == 16 else "an integer"
        raise HetplanError(f"Criteo line {i + 1}, field {field}: {shown(values[i])} is not {kind}; "
                           "fix or drop that line") from None


def _is_int(value: bytes, base: int) -> bool:
    try:
        int(value, base)
    except ValueError:
        return False
    return True


def _as_bytes(lines: Sequence[bytes | str]) -> list[bytes]:
    return [(ln.encode("ascii", "replace") if isinstance(ln, str) else bytes(ln)).rstrip(b"\r\n") for ln in lines]


def parse_lines(lines: Sequence[bytes | str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference parser: (labels float32 [B], log(1 + I) float32 [B, 13], ids int64 [B, 26]).

    Empty integer features are 0, and so are negative ones (Criteo's I2 holds a few -1), as in
    DLRM's preprocessing; log(1 + x) tames the heavy tail of the counts. Ids are the 32-bit
    values of the hex fields; the model takes them modulo its tables' rows."""
    raw = _as_bytes(lines)
    for i, line in enumerate(raw):
        tabs = line.count(b"\t")
        if tabs != FIELDS - 1:
            raise HetplanError(f"Criteo line {i + 1}: {tabs + 1} tab-separated fields, the format has "
                               f"{FIELDS} (label, {DENSE_FIELDS} integer, {CAT_FIELDS} categorical)")
    fields = b"\t".join(raw).split(b"\t") if raw else []
    columns = [fields[c::FIELDS] for c in range(FIELDS)]
    bad = next((i for i, v in enumerate(columns[0]) if v not in (b"0", b"1")), None)
    if bad is not None:
        raise HetplanError(f"Criteo line {bad + 1}: label {shown(columns[0][bad])}, must be 0 or 1")
    labels = np.array([v == b"1" for v in columns[0]], dtype=np.float32)
    dense = np.stack([_ints(columns[1 + j], 10, f"I{j + 1}") for j in range(DENSE_FIELDS)], axis=1)
    cats = np.stack([_ints(columns[1 + DENSE_FIELDS + j], 16, f"C{j + 1}") for j in range(CAT_FIELDS)], axis=1)
    n = len(raw)
    return (labels, np.log1p(np.maximum(dense, 0)).astype(np.float32).reshape(n, DENSE_FIELDS),
            cats.reshape(n, CAT_FIELDS))


def encode_lines(lines: Sequence[bytes | str], width: int = LINE_BYTES) -> torch.Tensor:
    """Lines as a uint8 tensor [B, width], each zero-padded: the form in which lines travel
    between pipeline stages (a tensor of fixed shape, unlike a list of strings)."""
    raw = _as_bytes(lines)
    out = np.zeros((len(raw), width), dtype=np.uint8)
    for i, line in enumerate(raw):
        if len(line) > width:
            raise HetplanError(f"Criteo line {i + 1} is {len(line)} bytes, longer than the {width} bytes a line may "
                               f"take; pass a larger width to encode_lines")
        out[i, :len(line)] = np.frombuffer(line, dtype=np.uint8)
    return torch.from_numpy(out)


def decode_lines(encoded: torch.Tensor) -> list[bytes]:
    """The lines of `encode_lines`' tensor (the zero padding removed)."""
    if encoded.dtype != torch.uint8 or encoded.dim() != 2:
        raise HetplanError(f"Criteo lines must be a uint8 tensor [batch, width], got {encoded.dtype} "
                           f"{list(encoded.shape)}; make it with hetplan.zoo.criteo.encode_lines")
    return [row.tobytes().rstrip(b"\0") for row in encoded.detach().cpu().numpy()]


def _parse_criteo(lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Parsing is Python on the host: a GPU stage's lines come back to the CPU and go out again.
    labels, dense, cats = parse_lines(decode_lines(lines))
    return tuple(torch.from_numpy(a).to(lines.device) for a in (labels, dense, cats))


def _parse_criteo_fake(lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The shapes only, for tracing: export runs the model on fake tensors, which hold no bytes.
    batch = lines.shape[0]
    return (lines.new_empty((batch,), dtype=torch.float32), lines.new_empty((batch, DENSE_FIELDS), dtype=torch.float32),
            lines.new_empty((batch, CAT_FIELDS), dtype=torch.int64))


def _register_op() -> torch._ops.OpOverload:
    """Register `hetplan::parse_criteo` once per process. A re-import of this module (a reload,
    or a test that drops it from sys.modules) finds it registered and keeps it: registering again
    would replace the op with a new one, without its fake kernel until that is registered too,
    under the graphs already traced with the old one."""
    if not hasattr(torch.ops.hetplan, "parse_criteo"):
        op = torch.library.custom_op("hetplan::parse_criteo", _parse_criteo, mutates_args=())
        op.register_fake(_parse_criteo_fake)
    return torch.ops.hetplan.parse_criteo.default


PARSE_CRITEO = _register_op()


class CriteoParser(nn.Module):
    """Raw lines (uint8 [B, width]) -> (labels [B], dense [B, 13], ids [B, 26]): a leaf module
    around the custom op, so that parsing is a node of the profiled graph.

    With `columns`, the ids come as 26 tensors [B], one per field: the ops that cut them apart
    run in this leaf, so each table's node reads only its own column and the profiled graph's
    edges carry B x 8 bytes per table, not the whole [B, 26] block to every table."""

    runs_on_host = True  # Python on the CPU whatever the stage's device (`Node.runs_on_host`)

    def __init__(self, columns: bool = False):
        super().__init__()
        self.columns = columns

    def forward(self, lines: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(labels, dense, ids): ids one tensor [B, 26], or with `columns` a tuple of 26 [B]."""
        labels, dense, ids = torch.ops.hetplan.parse_criteo(lines)
        if self.columns:
            return labels, dense, ids.t().contiguous().unbind(0)  # contiguous columns: each sends alone
        return labels, dense, ids


def _cache_dir() -> Path:
    return Path(os.environ.get("HETPLAN_CACHE") or Path.home() / ".cache" / "hetplan")


@dataclass(frozen=True)
class ClickLog:
    """A cached click log: the text file, and its lines encoded once (`encode_lines`) in a
    `.npy` beside it, which `batch` maps into memory to read only the lines of one step."""

    text: Path
    encoded: Path

    def batch(self, batch_size: int, step: int) -> dict[str, torch.Tensor]:
        """The lines of training step `step`: the log in order, wrapping around at its end."""
        if batch_size < 1 or step < 0:
            raise HetplanError(f"batch size {batch_size}, step {step}: need a batch size >= 1 and a step >= 0")
        lines = np.load(self.encoded, mmap_mode="r")
        rows = np.arange(step * batch_size, (step + 1) * batch_size) % len(lines)
        return {"lines": torch.from_numpy(np.ascontiguousarray(lines[rows]))}


def click_log(seed: int, tables: Sequence[int] = DEFAULT_TABLES, rows: int = LOG_ROWS,
              cache: str | os.PathLike | None = None) -> ClickLog:
    """The cached log of `rows` samples for (seed, tables), written on first use under `cache`
    ($HETPLAN_CACHE, else ~/.cache/hetplan) and named by what it holds."""
    tables = _check_tables(tables)
    digest = hashlib.sha256(repr(tables).encode()).hexdigest()[:12]
    base = Path(cache) if cache is not None else _cache_dir()
    text = base / f"criteo-v{_FORMAT}-{rows}r-seed{seed}-t{digest}.tsv"
    encoded = text.with_suffix(".u8.npy")
    try:
        if not encoded.exists():
            if not text.exists():
                write_click_log(text, rows, seed, tables)
            lines = encode_lines(text.read_bytes().splitlines()).numpy()
            _write_atomic(encoded, lambda out: np.save(out, lines))
    except OSError as exc:
        raise InputError(f"cannot write the click log cache in {base}: {exc.strerror}; "
                         "set HETPLAN_CACHE to a writable folder") from None
    return ClickLog(text, encoded)


def click_batch(batch_size: int, step: int, seed: int,
                tables: Sequence[int] = DEFAULT_TABLES) -> dict[str, torch.Tensor]:
    """`{"lines": uint8 [batch_size, LINE_BYTES]}`: the raw lines of training step `step` of the
    cached log for (seed, tables). Callers that step often may keep `click_log(...)` and call
    its `batch`; this opens the log each time."""
    return click_log(seed, tables).batch(batch_size, step)
