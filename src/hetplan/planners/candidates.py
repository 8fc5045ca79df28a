"""dp's candidates from every source, ranked, scored, and why the winner won.

dp gathers plans from several programs: its label program on the cluster and on the cluster's
first hosts, the per-type program of big clusters, the baselines, and under a throughput floor
the fastest plans. Each candidate keeps its source and its program's own step (`model_s`). The
fast path ranks all of them by the objective (`Scorer.fast_keys`); the event simulator scores
the SIMULATED best of those that fit in memory by the cost model and every one within NEAR of
the best by the fast path (the fast path folds replicated stages, so its order among close
candidates is not the simulator's), past the best two within a budget of the simulator's events
(a deep pipeline of many micro-batches takes a second to simulate); the objective picks among
those simulated.

`explanation` says where the winner came from and why each of the best few others lost: its
time (or the objective's value) against the winner's, its memory (the device it overflows), or
a limit of the runtime (`hetplan.runtime.support`): what `hetplan plan --explain` prints.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from hetplan.plan import Plan
from hetplan.planners.scoring import Scorer
from hetplan.runtime.support import runtime_refusal
from hetplan.units import fmt_bytes

SIMULATED = 6  # candidates the event simulator scores (those that fit, best by the fast path),
NEAR = 0.05  # and every one within this of the best by the fast path,
MOST_SIMULATED = 24  # at most this many,
EVENTS = 200_000  # and past the best two, no more than this many events in all (`Scorer.events`)
RUNNERS_UP = 5  # the others the explanation lists


@dataclass
class Candidates:
    """Plans gathered for one problem, each with its source, in the order they came."""

    scorer: Scorer
    plans: list[Plan] = field(default_factory=list)
    sources: dict[tuple, str] = field(default_factory=dict)
    fast: dict[tuple, float] = field(default_factory=dict)
    _chosen: tuple[int, list[Plan]] = (-1, [])

    def add(self, plans: list[Plan], source: str) -> None:
        for plan in plans:
            key = Scorer.key(plan)
            if key not in self.sources:
                self.sources[key] = source
                self.plans.append(plan)

    def source(self, plan: Plan) -> str:
        return self.sources.get(Scorer.key(plan), "polish")

    def simulated(self) -> list[Plan]:
        """The candidates the event simulator scores (the module's docstring); kept until more
        candidates come."""
        if self._chosen[0] != len(self.plans):
            self._chosen = (len(self.plans), self._choose())
        return self._chosen[1]

    def _choose(self) -> list[Plan]:
        fast, order = self.scorer.fast_keys(self.plans)
        for plan, t in zip(self.plans, fast, strict=True):
            self.fast[Scorer.key(plan)] = float(t)
        ranked = [self.plans[int(i)] for i in order]
        fitting = [p for p in ranked if self.scorer.fits(p)]
        if not fitting:
            return ranked[:MOST_SIMULATED]
        best_fast = min(self.fast[Scorer.key(p)] for p in fitting)
        chosen = fitting[:SIMULATED] + [p for p in fitting[SIMULATED:]
                                        if self.fast[Scorer.key(p)] <= best_fast * (1 + NEAR)]
        chosen = chosen[:MOST_SIMULATED]
        spent = itertools.accumulate(Scorer.events(p) for p in chosen[2:])  # the best two whatever they take
        return chosen[:2] + [p for p, used in zip(chosen[2:], spent, strict=True) if used <= EVENTS]

    def best(self, planner: str) -> Plan:
        """The simulated candidate with the best objective; the scorer's error when none fits
        (naming the closest of all candidates)."""
        chosen = self.simulated()
        if not any(math.isfinite(self.scorer.value(p)) for p in chosen):
            chosen = self.plans
        return self.scorer.best(chosen, planner)

    def explanation(self, winner: Plan, picked: Plan) -> dict:
        """Where `winner` came from (`picked`, the candidate it was polished from, when they
        differ) and the best RUNNERS_UP other simulated candidates of distinct layouts, each with
        its figures and why it lost."""
        simulated = [p for p in self.plans if self.scorer.scored(p)]
        simulated.sort(key=lambda p: (self.scorer.value(p), self.scorer.estimate(p).step_s))
        # one of each layout: alike devices in another order make the same plan
        seen = {self._layout(winner)}
        simulated = [p for p in simulated if not (self._layout(p) in seen or seen.add(self._layout(p)))]
        source = self.source(picked) + ("" if Scorer.key(picked) == Scorer.key(winner) else ", then polished")
        return {"winner": {**self.figures(winner), "source": source},
                "runners_up": [{**self.figures(p), "lost": self.why_lost(p, winner)} for p in simulated[:RUNNERS_UP]],
                "candidates": len(self.plans), "simulated": self.scorer.simulations}

    def _layout(self, plan: Plan) -> tuple:
        """What tells two plans apart in the explanation: their shape, micro-batches and each
        stage's nodes."""
        return shape(plan, self.scorer), plan.microbatches, tuple(st.nodes for st in plan.stages)

    def figures(self, plan: Plan) -> dict:
        est = self.scorer.estimate(plan)
        model = plan.meta.get("model_s")
        return {"source": self.source(plan), "shape": shape(plan, self.scorer), "microbatches": plan.microbatches,
                "model_s": model, "fast_s": self.fast.get(Scorer.key(plan)), "sim_s": est.step_s,
                "feasible": est.feasible}

    def why_lost(self, plan: Plan, winner: Plan) -> str:
        """Memory (the worst device's peak against its memory), a runtime limit, the throughput
        floor, or the objective's value against the winner's."""
        est, cluster = self.scorer.estimate(plan), self.scorer.cluster
        if not est.feasible and est.peak_mem_bytes:
            dev = max(est.peak_mem_bytes, key=lambda d: est.peak_mem_bytes[d] / cluster.device(d).mem_bytes)
            return (f"memory: needs {fmt_bytes(est.peak_mem_bytes[dev])} on {dev}, which has "
                    f"{fmt_bytes(cluster.device(dev).mem_bytes)}")
        refusal = runtime_refusal(plan, cluster)
        if refusal and not runtime_refusal(winner, cluster):
            return f"runtime: {refusal}"
        value, best = self.scorer.value(plan), self.scorer.value(winner)
        if not math.isfinite(value):
            return "below the throughput floor" if est.feasible else "infeasible"
        return f"{self.scorer.options.objective}: +{(value / best - 1) * 100 if best > 0 else 0.0:.1f}%"


def shape(plan: Plan, scorer: Scorer) -> str:
    """A plan's stages in a few words: per stage its replicas per device type (tensor-parallel
    degree, recomputation, sharding), runs of alike stages counted."""
    parts: list[list] = []
    for st in plan.stages:
        types = Counter(scorer.cluster.device(d).type for d in st.devices)
        what = " + ".join(f"{t} x{n}" for t, n in sorted(types.items(), key=lambda x: (-x[1], x[0])))
        what += (f" tp{st.tp}{' sp' if st.sequence_parallel else ''}" if st.tp > 1 else "") \
            + (f" rc-{st.recompute}" if st.recomputes else "") + (f" zero{st.shard}" if st.shard else "")
        if parts and parts[-1][0] == what:
            parts[-1][1] += 1
        else:
            parts.append([what, 1])
    return ", ".join(f"{n} x [{w}]" if n > 1 else w for w, n in parts)
