"""The label program of `hetplan.planners.dp`: Pareto fronts of labels per (cut state, position
in a device order), built from the end of the pipeline backwards, over the table of stage
options (`hetplan.cost.stage_table`). The recurrence, its model of a step and its assumptions
are in `hetplan.planners.dp`'s docstring (after PipeDream's optimizer, Narayanan et al., SOSP
2019, and Ju et al.'s antichain dynamic program); this module is the kernel, dp.py the driver
(device orders, bounds, pool, re-ranking).

The kernel is array code, as Alpa's stage program is a kernel over a cost tensor (Zheng et al.,
OSDI 2022): for one device order, every stage option's figures (its time, per-micro-batch part,
memory against its devices, gradient sum and optimizer step) are read from the table for every
pair of states at once, per group of devices (a span of the order, as data-parallel replicas or,
on devices of one host and type, as tensor-parallel groups) and per choice (recomputing or not).
Fronts are arrays (position, state, slot); the front of state i at position d is made from every
option that starts there at once: the labels of the fronts after each option, extended by it,
the best by rank that no better one covers (within EPSILON) kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hetplan.plan import Plan, Stage
from hetplan.planners.kit import microbatch_choices
from hetplan.planners.objectives import objective
from hetplan.planners.options import PlanOptions
from hetplan.planners.scoring import Scorer
from hetplan.planners.states import StateSums
from hetplan.schedule import get_schedule

MAX_LABELS = 6
EPSILON = 0.002  # labels closer than this in sum, max and all-reduce are as good as each other
SMALL_CLUSTER = 8  # up to this many devices a stage may take any number of them as replicas
BIG_CLUSTER_REPLICAS = 4  # on bigger clusters, at most this many
USUAL_MICROBATCHES = 32  # see `usual_microbatches`
PRESELECT = 48  # of a front's candidates, the best this many by rank are compared pairwise
# the fields of a label, each an array over (position, state, slot) in the fronts
FIELDS = ("sum_s", "max_s", "ar_s", "after", "m_req", "usd_per_hour", "k_first", "lat_s", "rank", "k_max", "thr_s",
          "c_first", "fix_sum_s", "fix_max_s", "option", "next_state", "next_slot")


class Label(NamedTuple):
    """A way to run the nodes after a state on the devices after a position of the order: the
    label at the front of the empty state, with its stages."""

    sum_s: float  # sum over its stages of t_k + 2 c_k
    max_s: float  # P: the slowest stage, link or (1F1B) round trip
    ar_s: float  # the largest all-reduce + optimizer step of a stage
    m_req: int  # the fewest micro-batches memory allows
    usd_per_hour: float  # of every device it uses
    k_max: int  # its largest replica group: micro-batches need at least that many rows
    thr_s: float  # objective throughput: its slowest stage or cut in PipeDream's steady state
    lat_s: float  # latencies along its cuts
    fix_sum_s: float  # sum over its stages of what a micro-batch pays whatever its rows
    fix_max_s: float  # the largest of those
    stages: tuple[tuple[int, int, int, int, int, str, int], ...]  # (i, j, position d, devices, tp, recompute, shard)


def rows_for_replicas(batch_size: int, m: int, k_max: int, choices: tuple[int, ...]) -> bool:
    """Whether every micro-batch has a row for each of k_max replicas. The runtime (and the
    simulator) split micro-batches in whole rows (`hetplan.rows`): with fewer rows than replicas
    some replica idles in every micro-batch, which the program's model (replicas share each
    micro-batch's time) does not see; such m are left out unless no allowed m has the rows."""
    return batch_size // m >= k_max or not any(batch_size // c >= k_max for c in choices)


def usual_microbatches(choices: tuple[int, ...]) -> tuple[int, ...]:
    """The micro-batch counts the program tries for every label: up to USUAL_MICROBATCHES (its
    model has no fixed part per micro-batch, so it would always prefer the most); more only where
    memory needs them (`useful_microbatches`)."""
    return tuple(m for m in choices if m <= USUAL_MICROBATCHES) or choices[:1]


def useful_microbatches(lab: Label, choices: tuple[int, ...], batch_size: int, many: bool) -> list[int]:
    """The counts a label is tried with: the usual ones that memory and the rows allow or, in the
    pass for labels that memory gives more (`many`), the two fewest that it allows."""
    fit = [m for m in choices if m >= lab.m_req and rows_for_replicas(batch_size, m, lab.k_max, choices)]
    return fit[:2] if many else [m for m in fit if m <= USUAL_MICROBATCHES]


def model_step_s(lab, m):
    """T(m) of dp's docstring: the program's step time of a label with m micro-batches, with what
    every micro-batch pays whatever its rows (numbers or arrays alike)."""
    return (lab.sum_s + (m - 1) * lab.max_s) / m + lab.fix_sum_s + (m - 1) * lab.fix_max_s + 2 * lab.lat_s + lab.ar_s


@dataclass(frozen=True)
class _Option:
    """A stage option along an order: the `span` devices from position `d` as replicas of `tp`
    devices each, recomputing at a unit or not (`Stage.recompute`), its replicas sharding at
    ZeRO's `shard` level where they shard (`Stage.shard`: deeper than 1 under `--shard where-needed`)."""

    d: int
    span: int
    tp: int
    recompute: str
    shard: int = 1

    @property
    def replicas(self) -> int:
        return self.span // self.tp


class _Order:
    """What the program needs about one device order: per group of devices (a span of the order,
    with a tensor-parallel degree), the figures of every stage between two states (the table's),
    the cuts' times per byte, prices and the least time the work of each state can take on the
    first d devices."""

    def __init__(self, prob: StateSums, scorer: Scorer, order: tuple[str, ...], options: PlanOptions,
                 degrees: dict[str, tuple[int, ...]], cache: dict | None = None) -> None:
        table, cluster = prob.table, scorer.cluster
        self.cache = {} if cache is None else cache
        self.order, self.D = order, len(order)
        self.dev = [cluster.device(x) for x in order]
        self.choices = options.recompute_units(scorer.graph)
        self.shard = options.shard != "never"  # stages of several replicas shard their optimizer state
        # and where they do not fit so, their gradients, or their weights too (`refine.with_shard`)
        self.deep = options.shard == "where-needed" and not get_schedule(options.schedule).split_backward
        self.sp = options.sp  # tensor-parallel groups are sequence-parallel too
        self.bounded = get_schedule(options.schedule).bounded  # in flight bounded by the stages after
        self.track_price = objective(options).track == "price"
        self.track_thr = objective(options).track == "steady"
        # the user's --max-replicas raises the cap of big clusters too (slower: more widths to try)
        self.max_span = min(options.max_replicas or (self.D if self.D <= SMALL_CLUSTER else BIG_CLUSTER_REPLICAS),
                            self.D)
        n = len(prob.ideals)
        self.valid = prob.inside  # (i, j): state i is a proper subset of state j
        self.options: list[_Option] = []
        self.fig: dict[str, list[np.ndarray]] = {}
        pairs = (np.arange(n)[:, None], np.arange(n)[None, :])  # every pair of states (i, j)
        for d in range(self.D):
            for span in range(1, min(self.max_span, self.D - d) + 1):
                for tp in self._degrees(d, span, degrees):
                    for level in (1, 2, 3) if self.deep and tp == 1 and span > 1 else (1,):
                        plain_fits = False  # recomputing only adds time where every stage fits as it is
                        for rc in self.choices if tp == 1 else ("none",):
                            if plain_fits:
                                continue
                            self.options.append(_Option(d, span, tp, rc, level))
                            self._figures(table, d, span, tp, rc, pairs, level)
                            plain_fits = rc == "none" and self._fits_whole_batch()
                        if self._all_fit():  # sharding deeper only adds time where every stage fits
                            break
        self.option_d = np.array([o.d for o in self.options])
        self.option_e = np.array([o.d + o.span for o in self.options])
        self.option_span = np.array([o.span for o in self.options])
        self.option_replicas = np.array([o.replicas for o in self.options])
        self.usd_prefix = np.concatenate([[0.0], np.cumsum([d.usd_per_hour for d in self.dev])])
        self.rest = self._rest(prob)
        self._cuts(table, scorer)
        every = microbatch_choices(scorer.graph, options)
        choices = usual_microbatches(every)
        self.rank_m = np.array([max([m for m in choices if rows_for_replicas(scorer.graph.batch_size, m, k, choices)],
                                    default=max(choices)) for k in range(self.D + 1)])
        # the most micro-batches a label whose widest stage has k replicas can use (a row each)
        self.most_m = np.array([max([m for m in every if rows_for_replicas(scorer.graph.batch_size, m, k, every)],
                                    default=max(every)) for k in range(self.D + 1)])
        fits_anywhere = (table.memory_bytes(prob.kind_of_type(self.dev[0].type), 0, n - 1, 1.0) <= min(
            d.mem_bytes for d in self.dev))
        self.track_r = self.bounded and not bool(fits_anywhere)

    def _fits_whole_batch(self) -> bool:
        """Whether every stage of the last option added (one that does not recompute) fits, or does
        not fit at all, with the whole batch's activations held."""
        fits, ratio = self.fig["fits"][-1], self.fig["ratio"][-1]
        return bool(np.all(~(fits & self.valid) | (ratio <= 1.0)))

    def _all_fit(self) -> bool:
        """Whether every stage of the last option added fits its devices' memory."""
        return bool(np.all(self.fig["fits"][-1][self.valid]))

    def _degrees(self, d: int, span: int, degrees: dict[str, tuple[int, ...]]) -> list[int]:
        """1, and the tensor-parallel degrees a span of devices of one host and type can take."""
        devs = self.dev[d:d + span]
        if len({(x.type, x.host) for x in devs}) > 1:
            return [1]
        return [1, *(t for t in degrees.get(devs[0].type, ()) if t > 1 and span % t == 0)]

    def _figures(self, table, d: int, span: int, tp: int, rc: str, pairs: tuple[np.ndarray, np.ndarray],
                 level: int = 1) -> None:
        """The figures of every stage i -> j on the devices d .. d+span-1 as replicas of tp devices
        (kept in `cache` for the other orders: devices alike in type, host, memory and price cost
        alike)."""
        ids = self.order[d:d + span]
        key = (tuple((x.type, x.host, x.mem_bytes, x.usd_per_hour) for x in self.dev[d:d + span]), tp, rc, level)
        if key not in self.cache:
            self.cache[key] = self._group_figures(table, ids, tp, rc, pairs, level)
        for name, value in self.cache[key].items():
            self.fig.setdefault(name, []).append(value)

    def _group_figures(self, table, ids: tuple[str, ...], tp: int, rc: str,
                       pairs: tuple[np.ndarray, np.ndarray], level: int = 1) -> dict[str, np.ndarray]:
        i, j = pairs
        span = len(ids)
        groups = [ids[x:x + tp] for x in range(0, span, tp)]
        kinds: dict[tuple, tuple] = {}
        for grp in groups:  # one kind per type (and memory, runtime costs) among the replicas
            kind = table.kind(grp, self.sp)
            key = (kind.type, kind.mem_bytes, kind.action_overhead_s, kind.corun)
            kinds[key] = (kind, kinds.get(key, (kind, 0))[1] + 1)
        kind_list, counts = [k for k, _ in kinds.values()], [c for _, c in kinds.values()]
        replicas = len(groups)
        valid = table.tp_valid(tp, i, j)
        shards = np.where(table.dense(i, j), replicas, 1) if self.shard and tp == 1 and replicas > 1 else 1
        if level >= 2:  # only dense gradients shard; each pass runs its rings (`CostModel.shard_passes_s`)
            valid = valid & table.dense(i, j)
        entries = tuple(grp[0] for grp in groups)
        rings = table.shard_passes_s(entries, i, j, level)
        share = table.shares(kind_list, counts, i, j)
        scaled, fixed, ratio, rebuilt, fits = [], [], [], [], valid.copy()
        for kind, sh in zip(kind_list, share, strict=True):
            s, f = table.compute_s(kind, i, j, rc)
            scaled.append(sh * s)
            fixed.append(f + rings)
            room, per_batch, again = table.memory_terms(kind, i, j, rc, shards, level)
            fits &= room > 0
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio.append(np.where(room > 0, per_batch * sh / np.maximum(room, 1.0), np.inf))
                rebuilt.append(np.where(room > 0, again * sh / np.maximum(room, 1.0), np.inf))
        together = np.max(scaled, axis=0)
        figures = {"t": together, "fixed": np.max(fixed, axis=0), "ratio": np.max(ratio, axis=0),
                   "rebuilt": np.max(rebuilt, axis=0), "fits": fits,
                   "ar": table.tail_s(entries, i, j, shards, degree=tp, level=level),
                   "steady": table.steady_s(together, entries, i, j) if self.track_thr else together}
        shape = np.broadcast(i, j).shape
        return {name: np.broadcast_to(value, shape).astype(bool if name == "fits" else np.float32)
                for name, value in figures.items()}

    def stack(self) -> None:
        """The figures as arrays (option, i, j)."""
        self.fig = {name: np.stack(values) for name, values in self.fig.items()}

    def _cuts(self, table, scorer: Scorer) -> None:
        """Per (d, e, span after): a cut's seconds per byte from devices d .. e-1 to the next span
        (routed as the runtime routes rows, `StageTable.cut_per_byte_s`; replicas weighted by
        their type's speed on the whole model), its steady-state bandwidth (throughput), and the
        latency of the link at e."""
        speed = {t: 1.0 / max(float(table.whole_s(table.type_kind(t), 0, table.last)), 1e-30) for t in table.types}
        weight = [speed[d.type] for d in self.dev]
        K = self.max_span  # noqa: N806
        self.cut_pb = np.zeros((self.D + 1, self.D + 1, K + 1))
        self.cut_Bps = np.full((self.D + 1, self.D + 1, K + 1), np.inf)
        for d in range(self.D):
            for e in range(d + 1, min(d + K, self.D) + 1):
                for k in range(1, min(K, self.D - e) + 1):
                    nxt = self.order[e:e + k]
                    self.cut_pb[d, e, k] = table.cut_per_byte_s(self.order[d:e], nxt, weight[d:e], weight[e:e + k])
                    if self.track_thr:
                        self.cut_Bps[d, e, k] = table.cut_Bps(self.order[d:e], nxt)
        self.latency = np.array([scorer.cluster.link(self.order[p], self.order[p + 1]).latency_s
                                 if p + 1 < self.D else 0.0 for p in range(self.D)])

    def _rest(self, prob: StateSums) -> np.ndarray:
        """rest[i, d]: the least time the nodes of state i can take on devices 0 .. d-1 together."""
        table = prob.table
        types = list(table.types)
        whole = np.array([table.whole_s(prob.kind_of_type(t), 0, np.arange(len(prob.ideals))) for t in types])
        count = np.zeros((self.D + 1, len(types)))
        for x, dev in enumerate(self.dev):
            count[x + 1] = count[x]
            count[x + 1][types.index(dev.type)] += 1
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(whole > 0, 1.0 / whole, 0.0)  # (types, states)
            total_speed = count @ inv  # (D + 1, states)
            return np.where(total_speed > 0, 1.0 / total_speed, 0.0).T


class _Fronts:
    """Pareto fronts of labels as one array (field, position, state, slot); rank inf: no label."""

    def __init__(self, positions: int, states: int, slots: int) -> None:
        self.a = np.zeros((len(FIELDS), positions, states, slots))
        self.a[F["rank"]] = np.inf

    def __getitem__(self, name: str) -> np.ndarray:
        return self.a[F[name]]


F = {name: k for k, name in enumerate(FIELDS)}


def _recompute_microbatches(after, rt, rebuilt, bounded: bool):
    """The fewest micro-batches m with which a recomputing stage fits (arrays): rt of its room
    per batch kept for each micro-batch in flight (all m under GPipe, min(m, after + 1) under
    1F1B) plus `rebuilt` for one micro-batch's activations, over m (conservative by one where
    exact)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        few = np.where(rt + rebuilt <= 1.0, 1.0,
                       np.where(rt < 1.0, np.floor(rebuilt / np.maximum(1.0 - rt, 1e-300)) + 1, np.inf))
    if not bounded:
        return few
    deep = np.maximum(after + 2, np.floor(rt * (after + 1) + rebuilt) + 1)
    return np.where(few <= after + 1, few, deep)


class _Program:
    """One order's program: fronts filled from the last state backwards (`run`)."""

    def __init__(self, prob: StateSums, setup: _Order, m_max: int, bounds: tuple[float, float, float],
                 max_labels: int) -> None:
        self.prob, self.setup, self.m_max, self.bounds, self.L = prob, setup, m_max, bounds, max_labels
        n = len(prob.ideals)
        self.fronts = _Fronts(setup.D + 1, n, max_labels)
        self.above = [np.nonzero(prob.inside[i])[0] for i in range(n)]
        self.extended = 0
        self.short_of_microbatches = False  # a label was cut because memory needed more than m_max
        f = self.fronts
        for e in range(1, setup.D + 1):  # the empty pipeline after the last state, devices e.. unused
            f["rank"][e, n - 1, 0] = 0.0
            f["m_req"][e, n - 1, 0] = 1
            f["usd_per_hour"][e, n - 1, 0] = setup.usd_prefix[e]
            f["option"][e, n - 1, 0] = -1
        self.rc = np.array([o.recompute != "none" for o in setup.options])

    def run(self) -> list[Label]:
        for i in range(len(self.prob.ideals) - 2, -1, -1):
            if len(self.above[i]):
                self._state(i)
        return self._labels(0, 0)

    def _state(self, i: int) -> None:
        """The fronts of state i at every position, from every option starting there (options
        come in the order of their positions, so each position's candidates are one run)."""
        setup = self.setup
        opts = np.nonzero((setup.option_d == 0) if i == 0 else (setup.option_d > 0))[0]
        js = self.above[i]
        # the (option, state) pairs whose front after the option has a label (slot 0: the best)
        has = np.isfinite(self.fronts["rank"][setup.option_e[opts][:, None], js[None, :], 0])
        o_idx, j_idx = np.nonzero(has)
        if not len(o_idx):
            return
        cand = self._extend(i, opts[o_idx], js[j_idx])
        if cand is None:
            return
        ds = setup.option_d[opts[o_idx]]
        cuts = np.flatnonzero(np.diff(ds)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(ds)], strict=True):
            self._select(i, int(ds[lo]), cand[:, lo:hi])

    def _extend(self, i: int, o: np.ndarray, j: np.ndarray) -> np.ndarray | None:
        """The labels of the fronts after options o[p] at states j[p], each extended by its option
        (a stage from state i): an array (field, pair, slot), rank inf where cut."""
        setup, fig, n = self.setup, self.setup.fig, len(self.prob.ideals)
        bound_s, bound_usd, bound_thr = self.bounds
        d, e = setup.option_d[o], setup.option_e[o]
        lab = self.fronts.a[:, e, j, :]
        st = {name: fig[name][o, i, j][:, None] for name in ("t", "fixed", "ratio", "rebuilt", "fits", "ar", "steady")}
        r_i = setup.rest[i, d][:, None]
        ok = np.isfinite(lab[F["rank"]]) & st["fits"] & (st["t"] <= bound_s) & (r_i <= bound_s)
        if not setup.bounded:
            ok &= st["ratio"] <= 1.0
        # the cut after the option's stage, to the first stage of the label (none after the last state)
        cut = (self.prob.cut[j] * (j != n - 1))[:, None]
        k_next = lab[F["k_first"]].astype(int)
        c_s = cut * setup.cut_pb[d[:, None], e[:, None], k_next]
        lt = np.where(cut > 0, setup.latency[np.maximum(e - 1, 0)][:, None], 0.0)
        steady = st["steady"]
        if setup.track_thr:
            steady = np.maximum(steady, self.prob.table.steady_lanes_s(cut, setup.cut_Bps[d[:, None], e[:, None],
                                                                                         k_next]))
        thr = np.maximum(lab[F["thr_s"]], steady)
        ok &= thr <= bound_thr
        after, m_req, ratio = lab[F["after"]], lab[F["m_req"]], st["ratio"]
        needed = np.where(self.rc[o][:, None], _recompute_microbatches(after, ratio, st["rebuilt"], setup.bounded),
                          np.where(ratio > 1.0, np.floor((after + 1) * ratio) + 1, 1.0))
        mr = np.maximum(m_req, needed)
        k_max = np.maximum(lab[F["k_max"]], setup.option_replicas[o][:, None])
        over = (mr > self.m_max) | (mr > setup.most_m[np.minimum(k_max, setup.D).astype(int)])
        self.short_of_microbatches |= bool((ok & over).any())
        ok &= ~over
        s2 = lab[F["sum_s"]] + st["t"] + 2 * c_s
        mx2 = np.maximum(np.maximum(lab[F["max_s"]], st["t"]), c_s + lab[F["c_first"]])
        if setup.bounded:
            mx2 = np.maximum(mx2, s2 / (after + 1))
        low = (s2 + r_i + (self.m_max - 1) * np.maximum(mx2, r_i)) / self.m_max
        ok &= low <= bound_s
        if setup.track_price:
            ok &= self.prob.table.usd_per_step(lab[F["usd_per_hour"]], low) <= bound_usd
        count = int(ok.sum())
        self.extended += count
        if not count:
            return None
        out = np.empty_like(lab)
        for name, value in (("sum_s", s2), ("max_s", mx2), ("ar_s", np.maximum(lab[F["ar_s"]], st["ar"])),
                            ("after", after + 1), ("m_req", mr), ("usd_per_hour", lab[F["usd_per_hour"]]),
                            ("k_first", setup.option_span[o][:, None]), ("lat_s", lab[F["lat_s"]] + lt),
                            ("k_max", k_max),
                            ("thr_s", thr), ("c_first", c_s), ("fix_sum_s", lab[F["fix_sum_s"]] + st["fixed"]),
                            ("fix_max_s", np.maximum(lab[F["fix_max_s"]], st["fixed"])), ("option", o[:, None]),
                            ("next_state", j[:, None]), ("next_slot", np.arange(self.L)[None, :])):
            out[F[name]] = value
        out[F["rank"]] = np.where(ok, self._rank(out), np.inf)
        return out

    def _rank(self, lab: np.ndarray) -> np.ndarray:
        """What a full front drops first: the step at the most micro-batches a label can use (the
        most whose micro-batches have a row for each replica of its widest stage), times the
        price for cost; the steady state for throughput."""
        setup = self.setup
        if setup.track_thr:
            return lab[F["thr_s"]]
        k_max = np.minimum(lab[F["k_max"]], setup.D).astype(int)
        m = np.minimum(self.m_max, np.maximum(lab[F["m_req"]], setup.rank_m[k_max]))
        step = model_step_s(_View(lab), m)
        return step * lab[F["usd_per_hour"]] if setup.track_price else step

    def _select(self, i: int, d: int, cand: np.ndarray) -> None:
        """The front of (i, d) from its candidates (field, pair, slot): in rank order, those that
        no better one covers within EPSILON (compared PRESELECT at a time, until there are L of
        them and one of each first stage's width), at most L, the best of each width first (the
        model can misjudge one width for all its labels: resnet50 on 4 V100 at 1 GB/s,
        bench/dp_no_miss.py)."""
        flat = cand.reshape(len(FIELDS), -1)
        rank = flat[F["rank"]]
        finite = np.flatnonzero(np.isfinite(rank))
        if not len(finite):
            return
        ordered = flat[:, finite[np.argsort(rank[finite], kind="stable")]]
        if ordered.shape[1] <= 1:
            self.fronts.a[:, d, i, :1] = ordered
            return
        every_width = set(np.unique(ordered[F["k_first"]]).tolist())
        kept = ordered[:, :0]
        for start in range(0, ordered.shape[1], PRESELECT):
            both = np.concatenate([kept, ordered[:, start:start + PRESELECT]], axis=1)
            kept = both[:, ~self._covered(both)]
            if kept.shape[1] >= self.L and set(kept[F["k_first"]].tolist()) >= every_width:
                break
        widths = kept[F["k_first"]]
        firsts = sorted(int(np.flatnonzero(widths == w)[0]) for w in np.unique(widths))
        chosen = sorted(list(dict.fromkeys([*firsts[:self.L], *range(kept.shape[1])]))[:self.L])
        self.fronts.a[:, d, i, :len(chosen)] = kept[:, chosen]

    def _covered(self, lab: np.ndarray) -> np.ndarray:
        """Per candidate (sorted by rank), whether an earlier one is at least as good in every
        tracked dimension (times within EPSILON)."""
        setup, slack = self.setup, 1.0 + EPSILON
        n = lab.shape[1]
        cov = np.ones((n, n), dtype=bool)  # cov[a, b]: a covers b
        for name in ("sum_s", "max_s", "ar_s"):
            cov &= lab[F[name]][:, None] <= lab[F[name]][None, :] * slack
        for name in ("m_req", "k_max"):
            cov &= lab[F[name]][:, None] <= lab[F[name]][None, :]
        if setup.track_r:
            cov &= lab[F["after"]][:, None] <= lab[F["after"]][None, :]
        if setup.track_price:
            cov &= lab[F["usd_per_hour"]][:, None] <= lab[F["usd_per_hour"]][None, :]
        if setup.track_thr:
            cov &= lab[F["thr_s"]][:, None] <= lab[F["thr_s"]][None, :] * slack
        return np.triu(cov, 1).any(axis=0)

    def _labels(self, i: int, d: int) -> list[Label]:
        """The labels of front (i, d) with their stages."""
        f, out = self.fronts, []
        for slot in range(self.L):
            if not math.isfinite(f["rank"][d, i, slot]):
                continue
            stages, (si, sd, ss) = [], (i, d, slot)
            while f["option"][sd, si, ss] >= 0:
                o = self.setup.options[int(f["option"][sd, si, ss])]
                j = int(f["next_state"][sd, si, ss])
                stages.append((si, j, sd, o.span, o.tp, o.recompute, o.shard))
                si, sd, ss = j, sd + o.span, int(f["next_slot"][sd, si, ss])
            v = {name: float(f[name][d, i, slot]) for name in FIELDS}
            out.append(Label(v["sum_s"], v["max_s"], v["ar_s"], int(v["m_req"]), v["usd_per_hour"], int(v["k_max"]),
                             v["thr_s"], v["lat_s"], v["fix_sum_s"], v["fix_max_s"], tuple(stages)))
        return out


class _View:
    """Attribute access to a label array's fields (for `model_step_s`)."""

    def __init__(self, lab: np.ndarray) -> None:
        for name in ("sum_s", "max_s", "fix_sum_s", "fix_max_s", "lat_s", "ar_s"):
            setattr(self, name, lab[F[name]])


def run_order(prob: StateSums, scorer: Scorer, order: tuple[str, ...], options: PlanOptions,
              m_max: int, bound_s: float, max_labels: int = MAX_LABELS, bound_usd: float = math.inf,
              bound_thr: float = math.inf, degrees: dict[str, tuple[int, ...]] | None = None,
              setup: _Order | None = None) -> tuple[list[Label], _Program]:
    """The Pareto front at ({}, device 0) for one device order, and the program that made it."""
    if setup is None:
        setup = order_setup(prob, scorer, order, options, degrees or {})
    program = _Program(prob, setup, m_max, (bound_s, bound_usd, bound_thr), max_labels)
    return program.run(), program


def order_setup(prob: StateSums, scorer: Scorer, order: tuple[str, ...], options: PlanOptions,
                degrees: dict[str, tuple[int, ...]], cache: dict | None = None) -> _Order:
    """The figures of one order's stage options (reused by the passes over it; `cache` keeps
    groups' figures for the orders after it)."""
    setup = _Order(prob, scorer, order, options, degrees, cache)
    setup.stack()
    return setup


def label_plan(prob: StateSums, order: tuple[str, ...], lab: Label, m: int, options: PlanOptions) -> Plan:
    stages = []
    for i, j, d, span, tp, recompute, level in lab.stages:
        devices = order[d:d + span]
        groups = tuple(devices[x:x + tp] for x in range(0, span, tp))
        dense = bool(prob.table.dense(i, j))
        shards = options.shard != "never" and tp == 1 and len(groups) > 1 and dense
        stages.append(Stage(prob.nodes(i, j), tuple(g[0] for g in groups), recompute, shard=level if shards else 0,
                            tp=tp, tp_devices=groups if tp > 1 else (), sequence_parallel=options.sp and tp > 1))
    return Plan(tuple(stages), m, options.schedule, "dp", options.objective)
