"""A layer graph's elements (`hetplan.graph`): nodes with their profiled costs, edges with the
bytes they carry, and parameters several nodes share; each checks its fields as it is made, so a
graph file with a bad number is refused naming the node or edge that holds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetplan._frozen import FILE_SCHEMA, FrozenMap
from hetplan.errors import GraphError, shown


def _check_number(value: float, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GraphError(f"{what} must be a number, got {shown(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond the largest float: every sum and rate of it would fail
        raise GraphError(f"{what} is {shown(value)}, too large; it must be finite and >= 0") from None
    if not finite or value < 0:
        raise GraphError(f"{what} is {value!r}; it must be finite and >= 0")


@dataclass(frozen=True)
class Node:
    """One unit of the model (a layer, a block, or a folded group of ops).

    `fwd_s` / `bwd_s` map a device type name (`v100-16gb`, `cpu-4t`) to the time of the node's
    forward / backward pass on the whole batch. `flops` is the forward FLOP count for the batch.
    `out_bytes` is the size of the node's output for the batch, `act_bytes` what the node keeps
    for its backward pass. `module` holds the qualified module names the node covers, so that a
    plan can be turned back into stage modules. An input node (`is_input`) stands for loading
    the batch: PipeDream profiles put data-loading time on it. `fwd_fixed_s` / `bwd_fixed_s`, when
    the profiler measured them, are the part of a pass that does not shrink with the batch (the
    cost of calling the node's operators): a micro-batch of b samples takes
    `fixed + (time - fixed) * b / batch_size`; missing types mean 0.

    `runs_on_host`: the node's work is Python on the host CPU whatever device its stage is on
    (parsing input records): its time does not change with the device type (`hetplan.cost`).
    `updated_bytes`: the parameter bytes its optimizer step updates per batch, where that is less
    than `param_bytes` (an embedding table with sparse gradients: only the rows the batch looked
    up); None means all of them (`optimizer_bytes`). `sparse_rows`: how many rows of such tables
    the batch looked up (distinct, summed over the node's tables): the indices replicas exchange
    with the rows (`hetplan.runtime.gradients`). `opt_s`: per device type where the profiler
    measured it, the time of the optimizer step (Adam, SparseAdam on sparse gradients) over the
    node's parameters.

    `cast_bytes`: in 16-bit mixed precision (`Graph.precision`), the bytes of the 16-bit copies
    autocast makes of the node's weights for its products, which a worker keeps for the whole step
    (made once per step, whatever the micro-batches); 0 in fp32. `param_bytes` are the fp32
    parameters' in every precision.

    `tp_units`: the most ways the node splits tensor-parallel (`hetplan.tp`): every degree that
    divides it splits the node's heads, MLP units and vocabulary evenly; 0: nothing in it splits
    (a norm, an embedding: whole on every device of a group); None: not known (a graph made by
    an importer or an older profiler). `act_split_share`: of `act_bytes`, the share a
    tensor-parallel group splits among its devices (each holds 1/t of it), the rest held whole
    on each (Korthikanti et al. 2022: 24 of a transformer layer's 34 s b h bytes without
    sequence parallelism); 0, the default, counts them whole on every device (an upper bound).
    `act_sequence_share`: of `act_bytes`, the share a group splits too when it is
    sequence-parallel (`Stage.sequence_parallel`: norms' inputs and dropout's masks, Korthikanti
    et al.'s 6 of 34; the runtime keeps the all-gathered inputs of the column-split products, 4 of
    the 34, whole for their weights' gradients, where Megatron-LM gathers them again). The
    profiler measures both on each node that holds a pair of split projections
    (`hetplan.pieces.split_acts`); the counted chains count them (`hetplan.zoo.llm`).

    `tp_s`: per device type and degree t, the node's forward and backward for the batch on a
    tensor-parallel group of t devices of that type on one host, and the fixed part of each, as
    the profiler measured them (`hetplan profile --tp-degrees`, `hetplan.profile.tensor_times`);
    the cost model takes them over its projection (`hetplan.cost.tensor`).

    `selective_keep_bytes`, `selective_rebuilt_bytes`: under selective recomputation
    (`hetplan.pieces.selective`: a checkpoint that keeps the outputs of the node's products and
    rebuilds the rest), what the node keeps per batch besides its inputs and what its backward
    builds again per batch (its activations less those kept); None where not measured (the cost
    model then counts it as keeping all its activations). `rerun_forwards`: per recomputation
    unit checkpointed per node ("block", "selective"), the time recomputing the node that way
    adds to a step, in forwards of the node, as the profiler measured it on its device (the
    forward run again, or the part selective recomputation runs, and the checkpoint's own cost);
    a unit missing counts one forward.
    """

    __pydantic_config__ = FILE_SCHEMA

    id: str
    op: str
    fwd_s: Mapping[str, float]
    bwd_s: Mapping[str, float]
    flops: float = 0.0
    param_bytes: int = 0
    out_bytes: int = 0
    act_bytes: int = 0
    module: tuple[str, ...] = ()
    is_input: bool = False
    fwd_fixed_s: Mapping[str, float] = field(default_factory=FrozenMap)
    bwd_fixed_s: Mapping[str, float] = field(default_factory=FrozenMap)
    runs_on_host: bool = False
    updated_bytes: int | None = None
    opt_s: Mapping[str, float] = field(default_factory=FrozenMap)
    sparse_rows: int = 0
    cast_bytes: int = 0
    tp_units: int | None = None
    act_split_share: float = 0.0
    act_sequence_share: float = 0.0
    selective_keep_bytes: int | None = None
    selective_rebuilt_bytes: int | None = None
    rerun_forwards: Mapping[str, float] = field(default_factory=FrozenMap)
    tp_s: Mapping[str, Mapping[int, tuple[float, float, float, float]]] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise GraphError(f"node id must be a non-empty string, got {self.id!r}")
        who = f"node {self.id!r}"
        for name in ("fwd_s", "bwd_s", "opt_s"):
            times = getattr(self, name)
            if not isinstance(times, Mapping):
                raise GraphError(f"{who}: {name} must map device types to seconds, got {times!r}")
            for dtype, t in times.items():
                _check_number(t, f"{who}: {name}[{dtype!r}]")
            object.__setattr__(self, name, FrozenMap({k: float(v) for k, v in times.items()}))
        if set(self.fwd_s) != set(self.bwd_s):
            raise GraphError(
                f"{who}: fwd_s has device types {sorted(self.fwd_s)} but bwd_s has "
                f"{sorted(self.bwd_s)}; both need the same types"
            )
        for name in ("flops", "param_bytes", "out_bytes", "act_bytes", "cast_bytes"):
            _check_number(getattr(self, name), f"{who}: {name}")
        object.__setattr__(self, "module", tuple(self.module))
        _check_number(self.act_split_share, f"{who}: act_split_share")
        _check_number(self.act_sequence_share, f"{who}: act_sequence_share")
        if self.act_split_share + self.act_sequence_share > 1 + 1e-12:
            raise GraphError(f"{who}: act_split_share and act_sequence_share add up to "
                             f"{self.act_split_share + self.act_sequence_share}; they are shares of act_bytes, "
                             "0 to 1 together")
        self._check_updated(who)
        self._check_selective(who)
        self._check_tp(who)
        for name, whole in (("fwd_fixed_s", self.fwd_s), ("bwd_fixed_s", self.bwd_s)):
            fixed = getattr(self, name)
            for dtype, t in fixed.items():
                _check_number(t, f"{who}: {name}[{dtype!r}]")
                if dtype not in whole or t > whole[dtype] * (1 + 1e-9) + 1e-12:
                    raise GraphError(f"{who}: {name}[{dtype!r}] is {t}, more than the whole pass "
                                     f"({whole.get(dtype)}); the fixed part is a part of it")
            object.__setattr__(self, name, FrozenMap({k: float(v) for k, v in fixed.items()}))

    def _check_selective(self, who: str) -> None:
        for name in ("selective_keep_bytes", "selective_rebuilt_bytes"):
            if getattr(self, name) is not None:
                _check_number(getattr(self, name), f"{who}: {name}")
        if not isinstance(self.rerun_forwards, Mapping):
            raise GraphError(f"{who}: rerun_forwards must map recomputation units to forwards, got "
                             f"{shown(self.rerun_forwards)}")
        for unit, forwards in self.rerun_forwards.items():
            if unit not in ("block", "selective"):
                raise GraphError(f"{who}: rerun_forwards has unit {unit!r}; the units measured per node are block "
                                 "and selective")
            _check_number(forwards, f"{who}: rerun_forwards[{unit!r}]")
        object.__setattr__(self, "rerun_forwards", FrozenMap({k: float(v) for k, v in self.rerun_forwards.items()}))

    def _check_tp(self, who: str) -> None:
        if not isinstance(self.tp_s, Mapping):
            raise GraphError(f"{who}: tp_s must map device types to degrees to times, got {shown(self.tp_s)}")
        out = {}
        for dtype, per in self.tp_s.items():
            out[dtype] = {}
            for degree, times in (per.items() if isinstance(per, Mapping) else [(None, per)]):
                if not isinstance(degree, int) or degree < 2 or not isinstance(times, Sequence) or len(times) != 4:
                    raise GraphError(f"{who}: tp_s[{dtype!r}] must map degrees of 2 or more to [forward, backward, "
                                     f"forward's fixed part, backward's fixed part] seconds, got {shown(per)}")
                for t in times:
                    _check_number(t, f"{who}: tp_s[{dtype!r}][{degree}]")
                fwd, bwd, fwd_fixed, bwd_fixed = map(float, times)
                if fwd_fixed > fwd * (1 + 1e-9) + 1e-12 or bwd_fixed > bwd * (1 + 1e-9) + 1e-12:
                    raise GraphError(f"{who}: tp_s[{dtype!r}][{degree}] has a fixed part more than its pass; the "
                                     "fixed part is a part of it")
                out[dtype][degree] = (fwd, bwd, fwd_fixed, bwd_fixed)
        object.__setattr__(self, "tp_s", FrozenMap({k: FrozenMap(v) for k, v in out.items()}))

    def selective_bytes(self) -> tuple[float, float]:
        """What selective recomputation keeps of the node per batch besides its inputs, and what
        it builds again (where not measured: all its activations kept, nothing built)."""
        if self.selective_keep_bytes is None or self.selective_rebuilt_bytes is None:
            return float(self.act_bytes), 0.0
        return float(self.selective_keep_bytes), float(self.selective_rebuilt_bytes)

    def rerun(self, unit: str) -> float:
        """The time recomputing at `unit` (`Stage.recompute`) adds, in forwards of the node: none
        for "none", one for "stage", as measured for the units checkpointed per node
        (`rerun_forwards`; one where not measured)."""
        if unit == "none":
            return 0.0
        return 1.0 if unit == "stage" else self.rerun_forwards.get(unit, 1.0)

    def _check_updated(self, who: str) -> None:
        _check_number(self.sparse_rows, f"{who}: sparse_rows")
        if self.sparse_rows and self.updated_bytes is None:
            raise GraphError(f"{who}: sparse_rows is {self.sparse_rows} but updated_bytes is not set; rows of a "
                             "table with sparse gradients are part of the bytes its optimizer updates")
        if self.updated_bytes is not None:
            _check_number(self.updated_bytes, f"{who}: updated_bytes")
            if self.updated_bytes > self.param_bytes:
                raise GraphError(f"{who}: updated_bytes ({self.updated_bytes}) is more than param_bytes "
                                 f"({self.param_bytes}); the optimizer updates a part of the parameters")

    @property
    def optimizer_bytes(self) -> int:
        """The parameter bytes the optimizer step reads and writes per batch."""
        return self.param_bytes if self.updated_bytes is None else self.updated_bytes

    def time_s(self, device_type: str) -> float:
        """Forward plus backward time on `device_type` (measured; KeyError if not profiled)."""
        return self.fwd_s[device_type] + self.bwd_s[device_type]


@dataclass(frozen=True)
class Edge:
    """The output of `src` is an input of `dst`; `bytes` is its size for the whole batch."""

    __pydantic_config__ = FILE_SCHEMA

    src: str
    dst: str
    bytes: int = 0

    def __post_init__(self) -> None:
        _check_number(self.bytes, f"edge {self.src} -> {self.dst}: bytes")


@dataclass(frozen=True)
class Tied:
    """A parameter several nodes use, counted in the `param_bytes` of each of them (GPT-2's
    token embedding, which is also its output layer). Stages that hold some of `nodes` each
    keep a copy and sum its gradient after the step (`hetplan.sync`)."""

    __pydantic_config__ = FILE_SCHEMA

    nodes: tuple[str, ...]
    bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        _check_number(self.bytes, f"tied parameter of {', '.join(self.nodes)}: bytes")
