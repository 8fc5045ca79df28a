"""One table of stage options: every figure a planner needs about a stage, so that no planner
works out a stage's time or memory by a rule of its own.

A *stage* is the nodes between two cut states i < j (down-sets of the graph, `hetplan.planners.states`;
for a chain, prefixes of one order). The table holds, per state, the sums of its nodes' figures
(times per device type and tensor-parallel degree, parameters, activations, bytes across its
cut), so a stage's figures are the difference of two rows, for arrays of (i, j) at once: Alpa's
stage program reads a precomputed cost tensor the same way (Zheng et al., "Alpa: Automating
Inter- and Intra-Operator Parallelism for Distributed Deep Learning", OSDI 2022). On these sums
it applies `hetplan.cost.formulas` as the event simulator's table (`hetplan.cost.table`) applies
them to one plan:

- a *kind* of replica (`Kind`): a device type, a tensor-parallel degree (`hetplan.cost.tensor`),
  the runtime's cost per action and per step, the co-running slowdown of CPU workers beside the
  cluster's other CPU devices of its host (an upper bound: the plan may use fewer), its memory;
- `passes_s`: one replica's forward and backward, the part that scales with its rows (for the
  whole batch) and the part each micro-batch pays whatever its rows; a stage that recomputes
  runs its forward again in its backward;
- `shares`: the replicas of a stage split each micro-batch in proportion to their speed
  (`CostModel._group_weights`, the rule of `hetplan.rows`);
- `memory_terms` and `memory_bytes`: what a replica holds for its weights (gradients, Adam's
  state, its share where replicas shard it or a tensor-parallel group splits it, 16-bit copies)
  and per share of the batch in flight (`held_bytes`: its activations, or where it recomputes
  what it keeps, plus one micro-batch's activations rebuilt: the whole stage's, or per block
  the largest node's);
- `tail_s`: after its last action, the replicas' gradient sum, the slowest replica's optimizer
  step (an r-th where they shard it) and the runtime's cost per step; `steady_s`, PipeDream's
  steady state of a stage for the `throughput` objective;
- `cut_s`: the bytes across a cut, routed between two stages' devices as the runtime routes rows.

A planner's own model of a step (1F1B's T(m) in dp, the per-type program's sum under a bound,
PipeDream's steady state in milp) combines these entries; `tests/test_cost_formulas.py` fails
when a planner imports a formula or a per-piece method of `CostModel` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetplan.cost import CostModel, formulas, in_flight_share
from hetplan.cost.tensor import node_tp_act_bytes, node_tp_times_s, split_nodes

__all__ = ["Kind", "StageTable", "prefix_states", "state_cut_bytes"]


@dataclass(frozen=True)
class Kind:
    """A kind of stage replica: devices of one type, `degree` of them as a tensor-parallel group
    (`devices`, one such group; 1 for a replica of one device), with the runtime's costs of its
    device, the co-running factor of its compute and the memory of each device."""

    type: str
    devices: tuple[str, ...]
    mem_bytes: int
    action_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    corun: float = 1.0
    sequence_parallel: bool = False  # a group's values split along their tokens too (`Stage.sequence_parallel`)

    @property
    def degree(self) -> int:
        return len(self.devices)


def prefix_states(order_len: int) -> np.ndarray:
    """The membership matrix of the prefixes of an order of `order_len` nodes: state s holds the
    first s nodes ((order_len + 1, order_len) booleans)."""
    return np.tri(order_len + 1, order_len, -1, dtype=bool)


def state_cut_bytes(graph, states: np.ndarray, order: Sequence[str]) -> np.ndarray:
    """Per state ((S, nodes) membership `states` over `order`), the bytes crossing its cut: per
    source node, its crossing edges' bytes, at most its output (`Graph.crossing_bytes`, for all
    states at once)."""
    if not graph.edges:
        return np.zeros(len(states))
    index = {v: k for k, v in enumerate(order)}
    src = np.array([index[e.src] for e in graph.edges], dtype=int)
    dst = np.array([index[e.dst] for e in graph.edges], dtype=int)
    nbytes = np.array([float(e.bytes) for e in graph.edges])
    crossing = (states[:, src] > 0) & (states[:, dst] == 0)  # (states, edges)
    sources = np.unique(src)
    per_source = np.stack([crossing[:, src == v] @ nbytes[src == v] for v in sources], axis=1)
    cap = np.array([graph.sent_cap_bytes[order[v]] for v in sources])
    return np.minimum(per_source, cap).sum(axis=1)


def _diff(prefix: np.ndarray, i, j) -> np.ndarray:
    return prefix[j] - prefix[i]


def _largest_between(states: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(S, S): for states i and j ((S, nodes) membership), the largest value of a node that j
    holds and i does not (0 where none). Prefixes of one order take a running maximum per i;
    other down-sets a pass over the nodes from the largest value down."""
    n_states, n = states.shape
    out = np.zeros((n_states, n_states))
    if n_states == n + 1 and np.array_equal(states, prefix_states(n)):
        for i in range(n):
            out[i, i + 1:] = np.maximum.accumulate(values[i:])
        return out
    done = np.zeros((n_states, n_states), dtype=bool)
    for v in np.argsort(-values, kind="stable"):
        fresh = ~states[:, v][:, None] & states[:, v][None, :] & ~done
        out[fresh] = values[v]
        done |= fresh
    return out


class StageTable:
    """The per-state sums of a graph's nodes on a cluster (`states`: (S, nodes) membership of each
    cut state over the nodes in `order`), and the figures of any stage between two of them."""

    def __init__(self, cost: CostModel, states: np.ndarray, order: Sequence[str]) -> None:
        self.cost, self.cluster, self.graph = cost, cost.cluster, cost.graph
        self.order = tuple(order)
        self._mat = np.asarray(states, dtype=float)
        by_id = self.graph.by_id
        self.types = tuple(sorted({d.type for d in self.cluster.devices}))
        self.params = self._sum([by_id[v].param_bytes for v in self.order])
        self.casts = self._sum([by_id[v].cast_bytes for v in self.order])  # 16-bit weight copies
        self.updated = self._sum([by_id[v].optimizer_bytes for v in self.order])  # what the optimizer updates
        self.indices = self._sum([cost._index_bytes([v]) for v in self.order])  # sparse rows' indices
        self.acts = self._sum([by_id[v].act_bytes for v in self.order])
        self.read = self._sum([self.graph.read_bytes[v] for v in self.order])  # kept by a per-block recompute
        # what a selective recompute keeps of each node besides its input, and what it rebuilds
        kept, self._selective_again = np.array([by_id[v].selective_bytes() for v in self.order], dtype=float).T
        self.selective_kept = self._sum(kept)
        self._tp_acts: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}
        self._largest: dict[tuple | str, np.ndarray] = {}  # the largest node's figures per range, asked once
        self._rings: dict[tuple[str, ...], np.ndarray] = {}  # per state, ZeRO's rings per node summed, by replicas
        self.cut = self._cut_bytes()
        # per tied parameter (`Graph.tied`), how many of its nodes each state holds, and its bytes
        index = {v: k for k, v in enumerate(self.order)}
        self._tied = [(self._sum(np.isin(np.arange(len(self.order)), [index[v] for v in t.nodes if v in index])),
                       t.bytes) for t in self.graph.tied]
        self._passes: dict[tuple[str, int, str], tuple[np.ndarray, ...]] = {}
        self._opt: dict[str, np.ndarray | None] = {}
        self._tp_held: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._tp_counts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._tails: dict[tuple[str, ...], tuple] = {}
        self._cut_per_byte: dict[tuple, float] = {}
        self._ids = self.cluster.ids

    @classmethod
    def of_chain(cls, cost: CostModel, order: Sequence[str] | None = None) -> StageTable:
        """The table of the stages of one order of the nodes (the graph's topological order by
        default): state s holds its first s nodes."""
        order = tuple(order or cost.graph.topo_order)
        return cls(cost, prefix_states(len(order)), order)

    def type_kind(self, type_name: str) -> Kind:
        """The kind of one device of a type (the cluster's first of it)."""
        return self.kind((next(d.id for d in self.cluster.devices if d.type == type_name),))

    def _sum(self, per_node) -> np.ndarray:
        return self._mat @ np.asarray(per_node, dtype=float) if len(self.order) else np.zeros(len(self._mat))

    def _cut_bytes(self) -> np.ndarray:
        return state_cut_bytes(self.graph, self._mat > 0, self.order)

    @property
    def states(self) -> int:
        return len(self._mat)

    @property
    def last(self) -> int:
        return self.states - 1

    # -- kinds -------------------------------------------------------------------------------
    def kind(self, devices: Sequence[str], sequence_parallel: bool = False) -> Kind:
        """The kind of a replica on `devices` (one device, or a tensor-parallel group of one type,
        sequence-parallel or not)."""
        dev = self.cluster.device(devices[0])
        slow = self.cost._corun_factor(dev.id, self._ids)
        return Kind(dev.type, tuple(devices), min(self.cluster.device(d).mem_bytes for d in devices),
                    dev.action_overhead_s, dev.step_overhead_s, slow, sequence_parallel and len(devices) > 1)

    # -- time --------------------------------------------------------------------------------
    def _type_sums(self, kind: Kind) -> tuple[np.ndarray, ...]:
        """Per state: forward, backward and their fixed parts on one replica of the kind, for the
        whole batch; and the backward of the nodes with weights (a zero-bubble schedule's split)."""
        key = (kind.type, kind.degree, self.cluster.device(kind.devices[0]).host)
        if key not in self._passes:
            if kind.degree == 1:
                times, fixed = self.cost._node_times_s(kind.type), self.cost._node_fixed_s(kind.type)
                per = [(*times[v], *fixed[v]) for v in self.order]
            else:
                per = [node_tp_times_s(self.cost, v, kind.type, kind.devices) for v in self.order]
            cols = np.array(per, dtype=float).reshape(len(self.order), 4)
            weighted = [row[1] if self.graph.by_id[v].param_bytes > 0 else 0.0 for v, row in zip(self.order, cols,
                                                                                              strict=True)]
            self._passes[key] = (*(self._sum(cols[:, c]) for c in range(4)), self._sum(weighted))
        return self._passes[key]

    def passes_s(self, kind: Kind, i, j, recompute: str = "none") -> tuple[np.ndarray, ...]:
        """One replica's passes of stages i -> j, as the runtime runs them (`formulas.replica_passes_s`):
        (forward scaled, backward scaled, forward fixed, backward fixed), the scaled parts for the
        whole batch, the fixed parts per micro-batch with the runtime's cost per action. A stage
        that recomputes runs its forward again in its backward (`formulas.recomputed_backward_s`)."""
        fwd, bwd, ffix, bfix, _ = (_diff(a, i, j) for a in self._type_sums(kind))
        f, b, f_fix, b_fix = formulas.replica_passes_s(fwd, bwd, ffix, bfix, kind.corun, kind.action_overhead_s)
        if recompute in ("block", "selective"):  # as measured per node (`CostModel.rebuilt_forward_s`)
            again, again_fix = (_diff(a, i, j) for a in self._rerun_sums(kind, recompute))
            rf, rf_fix = formulas.rerun_passes_s(again, again_fix, kind.corun, kind.action_overhead_s)
            b, b_fix = formulas.recomputed_backward_s(b, b_fix, rf, rf_fix, kind.action_overhead_s)
        elif recompute != "none":
            b, b_fix = formulas.recomputed_backward_s(b, b_fix, f, f_fix, kind.action_overhead_s)
        return f, b, f_fix, b_fix

    def _rerun_sums(self, kind: Kind, unit: str) -> tuple[np.ndarray, np.ndarray]:
        """Per state, what recomputing at `unit` (checkpointed per node) adds to a backward on one
        device of the kind's type, for the whole batch, and its fixed part."""
        key = (kind.type, unit)
        if key not in self._passes:
            per = [self.cost.rebuilt_forward_s((v,), kind.type, unit) for v in self.order]
            self._passes[key] = tuple(self._sum([p[c] for p in per]) for c in range(2))
        return self._passes[key]

    def compute_s(self, kind: Kind, i, j, recompute: str = "none") -> tuple[np.ndarray, np.ndarray]:
        """(the part of a replica's forward and backward that scales with its rows, for the whole
        batch; the part each micro-batch pays whatever its rows)."""
        f, b, f_fix, b_fix = self.passes_s(kind, i, j, recompute)
        return f + b, f_fix + b_fix

    def action_s(self, kind: Kind, i, j, share, recompute: str = "none") -> np.ndarray:
        """A replica's forward and backward of one micro-batch of `share` of the batch's rows."""
        scaled, fixed = self.compute_s(kind, i, j, recompute)
        return formulas.action_s(fixed, scaled, share)

    def weight_share(self, kind: Kind, i, j, first) -> np.ndarray:
        """`formulas.weight_share` of stages i -> j on a kind (a schedule that splits the backward)."""
        _, bwd, _, _, weighted = (_diff(a, i, j) for a in self._type_sums(kind))
        return formulas.weight_share(weighted, bwd, first)

    def raw_passes_s(self, kind: Kind, i, j) -> tuple[np.ndarray, ...]:
        """(forward, backward, forward fixed, backward fixed, backward of the nodes with weights)
        of stages i -> j on one replica of the kind, as measured or projected for the whole batch
        (no runtime costs)."""
        return tuple(_diff(a, i, j) for a in self._type_sums(kind))

    def together_s(self, devices: Sequence[str], i, j) -> np.ndarray:
        """Forward and backward of the whole batch on replicas `devices` together, each its share
        (`CostModel._stage_compute_s`: PipeDream's steady state reads it)."""
        speed = sum(1.0 / np.maximum(self.whole_s(self.kind((d,)), i, j), 1e-30) for d in devices)
        return 1.0 / speed

    def node_s(self, kind: Kind) -> np.ndarray:
        """Forward and backward of each node of the order on one replica of the kind, for the
        whole batch (a table `of_chain`: node k is the stage k -> k + 1)."""
        at = np.arange(len(self.order))
        return self.whole_s(kind, at, at + 1)

    @staticmethod
    def in_flight_share(schedule: str, stages: int, index: int, batch_size: int, microbatches: int) -> float:
        """The share of the batch a stage holds in flight at its peak (`hetplan.cost.in_flight_share`)."""
        return in_flight_share(schedule, stages, index, batch_size, microbatches)

    def whole_s(self, kind: Kind, i, j) -> np.ndarray:
        """Forward and backward of the whole batch on one replica, as measured or projected (no
        runtime costs): what replicas' shares of a micro-batch follow (`shares`)."""
        fwd, bwd, _, _, _ = (_diff(a, i, j) for a in self._type_sums(kind))
        return fwd + bwd

    def shares(self, kinds: Sequence[Kind], counts: Sequence[int], i, j) -> np.ndarray:
        """(kinds, ...) the share of each micro-batch one replica of each kind gets, in proportion
        to its speed on the stage (`CostModel._group_weights`; `hetplan.rows` splits rows so)."""
        whole = np.array([np.broadcast_to(self.whole_s(k, i, j), np.broadcast(i, j).shape) for k in kinds])
        with np.errstate(divide="ignore", invalid="ignore"):
            speed = np.where(whole > 0, 1.0 / np.maximum(whole, 1e-300), np.inf)
        c = np.asarray(counts, dtype=float).reshape((-1,) + (1,) * (whole.ndim - 1))
        total = (c * speed).sum(axis=0)
        with np.errstate(invalid="ignore"):
            share = np.where(np.isinf(total), np.where(np.isinf(speed), 1.0, 0.0) / np.maximum(
                (c * np.isinf(speed)).sum(axis=0), 1.0), speed / total)
        return np.where(np.isfinite(share), share, 1.0 / c.sum())

    # -- memory ------------------------------------------------------------------------------
    def _held(self, degree: int) -> tuple[np.ndarray, np.ndarray]:
        """Per state, the parameters and 16-bit copies each device of a group of `degree` holds."""
        if degree == 1:
            return self.params, self.casts
        if degree not in self._tp_held:
            split = split_nodes(self.graph, self.order)
            by_id = self.graph.by_id
            div = [degree if v in split else 1 for v in self.order]
            self._tp_held[degree] = (self._sum([by_id[v].param_bytes // d for v, d in zip(self.order, div,
                                                                                       strict=True)]),
                                     self._sum([by_id[v].cast_bytes // d for v, d in zip(self.order, div,
                                                                                      strict=True)]))
        return self._tp_held[degree]

    def tp_valid(self, degree: int, i, j) -> np.ndarray:
        """Whether stages i -> j can split `degree` ways (`hetplan.tp.splits_in`): some node splits
        and every node that splits divides into a multiple of `degree` parts (a node that does not
        say how it splits blocks it)."""
        if degree == 1:
            return np.ones(np.broadcast(i, j).shape, dtype=bool)
        if degree not in self._tp_counts:
            units = [self.graph.by_id[v].tp_units for v in self.order]
            self._tp_counts[degree] = (self._sum([1.0 if u else 0.0 for u in units]),
                                       self._sum([1.0 if u is None or (u and u % degree) else 0.0 for u in units]))
        splits, blocks = self._tp_counts[degree]
        return (_diff(splits, i, j) > 0.5) & (_diff(blocks, i, j) < 0.5)

    def tied_excess_bytes(self, i, j):
        """What summing stages i -> j's nodes' parameters counts twice or more: each tied parameter
        once per node of it among them, after the first (`Graph.tied_excess_bytes`)."""
        excess = 0.0
        for count, nbytes in self._tied:
            excess = excess + nbytes * np.maximum(_diff(count, i, j) - 1.0, 0.0)
        return excess

    def param_bytes(self, i, j):
        """The parameters of stages i -> j, a tied one once (`Graph.param_bytes_of`)."""
        return _diff(self.params, i, j) - self.tied_excess_bytes(i, j)

    def updated_bytes(self, i, j):
        """The bytes the optimizer step of stages i -> j updates (`CostModel._optimizer_bytes`:
        a table with sparse gradients, its looked-up rows; a tied parameter once)."""
        return np.maximum(0.0, _diff(self.updated, i, j) - self.tied_excess_bytes(i, j))

    def dense(self, i, j) -> np.ndarray:
        """Whether stages i -> j have dense gradients only (their replicas can shard their optimizer
        state; a table with sparse gradients updates fewer bytes than it holds)."""
        return _diff(self.updated, i, j) >= _diff(self.params, i, j) - 0.5

    def weights_bytes(self, kind: Kind, i, j, shards=1, level: int = 1) -> np.ndarray:
        """What each device of a replica holds for the stage's weights whatever the batch
        (`formulas.weight_bytes`): `shards` replicas shard what ZeRO's `level` says (1: none),
        its largest node whole meanwhile at levels 2 and 3 (`CostModel.shard_unit_bytes`)."""
        params, casts = (_diff(a, i, j) for a in self._held(kind.degree))
        unit = self.largest_params(i, j) if level >= 2 else 0.0
        return formulas.weight_bytes(params - self.tied_excess_bytes(i, j), casts, shards, None, level,
                                     np.where(np.asarray(shards) > 1, unit, 0.0))

    def largest_params(self, i, j) -> np.ndarray:
        """The parameters of the largest node of stages i -> j (0 where j does not hold i)."""
        if "params" not in self._largest:
            per = np.array([self.graph.by_id[v].param_bytes for v in self.order], dtype=float)
            self._largest["params"] = _largest_between(self._mat > 0, per)
        return self._largest["params"][i, j]

    def shard_passes_s(self, devices: Sequence[str], i, j, level: int) -> np.ndarray:
        """What a forward and a backward of a micro-batch add on replicas `devices` of stages i -> j
        sharding at ZeRO's `level` (`CostModel.shard_passes_s`): their rings, one per node."""
        if level < 2:
            return np.zeros(np.broadcast(i, j).shape)
        return sum(formulas.SHARD_RINGS[level][:2]) * self._rings_s(devices, i, j)

    def _rings_s(self, devices: Sequence[str], i, j) -> np.ndarray:
        """A ring all-reduce of each node's parameters of stages i -> j over replicas `devices`, summed."""
        key = tuple(devices)
        if key not in self._rings:
            per = [float(self.cost._gradient_sync_s(self.graph.by_id[v].param_bytes, 0, key)) for v in self.order]
            self._rings[key] = self._sum(per)
        return _diff(self._rings[key], i, j)

    def held_bytes(self, i, j, recompute: str = "none", degree: int = 1,
                   sequence_parallel: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """What a device of a replica of stages i -> j (a tensor-parallel group of `degree`,
        sequence-parallel or not) holds
        per batch between their passes, and what more their backward holds per batch while it
        runs, by the unit they recompute (`CostModel.held_bytes`): none, their activations; a
        stage, the cuts before and after it, then all its activations; a block, the cut before it
        and every node's output that is read, then its largest node's activations."""
        i, j = np.asarray(i), np.asarray(j)
        acts = _diff(self._acts(degree, sequence_parallel)[0], i, j)
        before = np.where(i > 0, self.cut[i], 0.0)
        if recompute == "block":
            return before + _diff(self.read, i, j), self.largest_acts(i, j, degree, sequence_parallel) + 0.0 * acts
        if recompute == "selective":
            return (before + _diff(self.read, i, j) + _diff(self.selective_kept, i, j),
                    self.largest_acts(i, j, degree, sequence_parallel, recompute) + 0.0 * acts)
        if recompute == "stage":
            return before + np.where(j < self.last, self.cut[j], 0.0), acts
        return acts, 0.0 * acts

    def _acts(self, degree: int, sequence_parallel: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Per node, what a device of a group of `degree` keeps of its activations
        (`cost.tensor.node_tp_act_bytes`), and their sums per state."""
        key = (degree, sequence_parallel)
        if key not in self._tp_acts:
            per = np.array([node_tp_act_bytes(self.graph, v, degree, sequence_parallel) for v in self.order],
                           dtype=float)
            self._tp_acts[key] = (self._sum(per), per)
        return self._tp_acts[key]

    def largest_acts(self, i, j, degree: int = 1, sequence_parallel: bool = False,
                     recompute: str = "block") -> np.ndarray:
        """The activations of the largest node of stages i -> j on a device of a group of `degree`
        (0 where j does not hold i); under "selective" recomputation, the largest a node rebuilds
        (all but what it keeps)."""
        key = (degree, sequence_parallel, "selective" if recompute == "selective" else "block")
        if key not in self._largest:
            per = self._selective_again if recompute == "selective" else self._acts(degree, sequence_parallel)[1]
            self._largest[key] = _largest_between(self._mat > 0, per)
        return self._largest[key][i, j]

    def memory_terms(self, kind: Kind, i, j, recompute: str = "none", shards=1,
                     level: int = 1) -> tuple[np.ndarray, ...]:
        """A replica's memory as three terms: (room: its device's memory less what it holds for the
        weights; per_batch: what it holds per share of the batch in flight; rebuilt: what it
        holds per share of one micro-batch while its backward runs). It fits when
        per_batch * in_flight_share + rebuilt * largest_share <= room."""
        room = kind.mem_bytes - self.weights_bytes(kind, i, j, shards, level)
        return (room, *self.held_bytes(i, j, recompute, kind.degree, kind.sequence_parallel))

    def memory_bytes(self, kind: Kind, i, j, in_flight_share, largest_share=0.0, recompute: str = "none",
                     shards=1) -> np.ndarray:
        """A replica's peak memory holding `in_flight_share` of the batch in flight (and, where it
        recomputes, one micro-batch of `largest_share` rebuilt)."""
        per_batch, again = self.held_bytes(i, j, recompute, kind.degree, kind.sequence_parallel)
        return self.weights_bytes(kind, i, j, shards) + np.ceil(per_batch * in_flight_share + again * largest_share)

    # -- after the last action ------------------------------------------------------------------
    def _measured_opt(self, type_name: str) -> np.ndarray | None:
        if type_name not in self._opt:
            measured = self.cost._measured_optimizer_s(type_name)
            self._opt[type_name] = None if measured is None else self._sum([measured[v] for v in self.order])
        return self._opt[type_name]

    def tail_s(self, devices: Sequence[str], i, j, shards=1, degree: int = 1, level: int = 1) -> np.ndarray:
        """After a stage's last action on its replicas `devices` (one entry per replica): their
        gradient sum (`CostModel._gradient_sync_s`), then the slowest replica's optimizer step
        (of an r-th of the bytes where they shard it, of its share of the weights in a
        tensor-parallel group of `degree`; slowed as its compute is, `formulas.replica_tail_s`)
        with the runtime's cost per step."""
        key = tuple(devices)
        if key not in self._tails:  # replicas alike in their optimizer's figures are asked once
            alike: dict[tuple, str] = {}
            for d in key:
                dev, kind = self.cluster.device(d), self.kind((d,))
                alike.setdefault((dev.type, dev.optimizer_points, kind.corun, dev.step_overhead_s), d)
            self._tails[key] = tuple(alike.items())
        upd, idx = self.updated_bytes(i, j), _diff(self.indices, i, j)
        part = 1.0 / np.asarray(shards, dtype=float)
        if degree > 1:  # each device of the group updates its share of the weights (`cost.tensor`)
            with np.errstate(divide="ignore", invalid="ignore"):
                whole = self.param_bytes(i, j)
                part = part * np.where(whole > 0, (_diff(self._held(degree)[0], i, j) - self.tied_excess_bytes(i, j))
                                       / np.maximum(whole, 1.0), 1.0)
        steps = []
        for (type_name, _, corun, per_step_s), d in self._tails[key]:
            measured = self._measured_opt(type_name)
            # an r-th of the step's time where r replicas shard it (`CostModel.replica_optimizer_s`)
            opt = part * self.cost._optimizer_step_s(upd, d, None if measured is None else _diff(measured, i, j))
            steps.append(formulas.replica_tail_s(opt, corun, per_step_s))
        after = formulas.SHARD_RINGS[level][2]  # ZeRO-2 gathers after the step, ZeRO-3 nothing (`cost.syncs`)
        return after * self.cost._gradient_sync_s(upd, idx, key) + np.max(steps, axis=0)

    def optimizer_s(self, device: str, i, j) -> np.ndarray:
        """One device's optimizer step over stages i -> j (`CostModel._optimizer_step_s`), a tied
        parameter updated once."""
        measured = self._measured_opt(self.cluster.device(device).type)
        return self.cost._optimizer_step_s(self.updated_bytes(i, j), device,
                                           None if measured is None else _diff(measured, i, j))

    def gradient_sum_s(self, nbytes, devices: Sequence[str]):
        """The sum of `nbytes` of dense gradients over replicas `devices` (`CostModel._gradient_sync_s`):
        a tied parameter's, which several stages share."""
        return self.cost._gradient_sync_s(nbytes, 0, tuple(devices))

    def steady_s(self, together_s, devices: Sequence[str], i, j) -> np.ndarray:
        """PipeDream's steady-state time per batch of a stage whose replicas `devices` compute the
        batch together in `together_s` (`formulas.steady_stage_s`; `CostModel._steady_sync_s`)."""
        sync = self.cost._steady_sync_s(self.updated_bytes(i, j), tuple(devices))
        return formulas.steady_stage_s(together_s, sync, len(devices))

    # -- cuts --------------------------------------------------------------------------------
    def cut_per_byte_s(self, senders: Sequence[str], receivers: Sequence[str],
                       sender_weights: Sequence[float] | None = None,
                       receiver_weights: Sequence[float] | None = None) -> float:
        """Seconds a byte of a micro-batch takes from one stage's devices to the next's, routed as
        the runtime routes rows (`CostModel._routed_cut_s`)."""
        key = (tuple(senders), tuple(receivers), None if sender_weights is None else tuple(sender_weights),
               None if receiver_weights is None else tuple(receiver_weights))
        if key not in self._cut_per_byte:
            self._cut_per_byte[key] = self.cost._routed_cut_s(senders, receivers, sender_weights, receiver_weights)
        return self._cut_per_byte[key]

    def slowest_Bps(self, senders: Sequence[str], receivers: Sequence[str]) -> float:
        """The slowest link from any of `senders` to any of `receivers` (`CostModel._slowest_Bps`)."""
        return self.cost._slowest_Bps(senders, receivers)

    def cut_Bps(self, senders: Sequence[str], receivers: Sequence[str]) -> float:
        """A cut's bandwidth in PipeDream's steady state (`CostModel._cut_Bps`)."""
        return self.cost._cut_Bps(senders, receivers)

    def nic_cap_Bps(self, senders: Sequence[str], receivers: Sequence[str]) -> float:
        """What the hosts' network interfaces carry at once between them (`CostModel._nic_cap_Bps`)."""
        return self.cost._nic_cap_Bps(senders, receivers)

    @staticmethod
    def steady_lanes_s(nbytes, bandwidth_Bps, lanes=1):
        """PipeDream's steady-state time of `nbytes` across a cut over `lanes` links of
        `bandwidth_Bps` (`formulas.steady_cut_s`)."""
        return formulas.steady_cut_s(nbytes, bandwidth_Bps, lanes)

    def steady_cut_s(self, state, senders: Sequence[str], receivers: Sequence[str]) -> np.ndarray:
        """PipeDream's steady-state time of the cut after `state` between two stages' devices
        (`formulas.steady_cut_s` at `CostModel._cut_Bps`)."""
        return formulas.steady_cut_s(self.cut[state], self.cost._cut_Bps(senders, receivers))

    @staticmethod
    def usd_per_step(usd_per_hour, step_s):
        """The price of a step of `step_s` on devices costing `usd_per_hour` in all (numbers or arrays)."""
        return formulas.usd_per_step(usd_per_hour, step_s)
