"""Training through devices that come and go: a trace of how many devices of each type are
available over time, replayed against three policies (after Sailor's availability traces, Strati
et al., "Sailor: Automating Distributed Training over Dynamic, Heterogeneous, and Geo-distributed
Clusters", SOSP 2025; Varuna, Athlur et al., EuroSys 2022, on spot VMs):

- `static`: the plan made for the first point, run while its devices are there, stopped otherwise;
- `every-change`: a new plan (dp's for the devices there) at every change;
- `when-worth-it`: a new plan when the running one lost devices, else only when its predicted gain
  over the expected time to the next change (the mean interval so far) outweighs the samples lost
  while restarting (`decide`, which the elastic launcher, `runtime.elastic`, takes its decisions from).

Accounting, over an interval of L seconds between two points with plan P running: samples +=
P's predicted samples per second x (L less the time lost in it); price += P's devices' price for
L (held while restarting too). A change that takes devices from under the running plan stops it
between two checkpoints: the work since the last one is lost (half the checkpoint interval, on
average) and the restart takes `restart_s`; a change made by choice is made at a checkpoint and
costs the restart only. Devices are counted by type: a plan runs on any devices of its types
(the first of each type in the cluster's order are the ones there), the links between them
taken as the cluster's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hetplan.cluster import Cluster
from hetplan.cost import usd_per_step
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.io import serde
from hetplan.plan import Plan

POLICIES = ("static", "every-change", "when-worth-it")


@dataclass(frozen=True)
class Availability:
    """Per point of time (`times_s`, from 0, increasing), the devices of each type there (`counts`);
    the trace ends at `horizon_s`."""

    times_s: tuple[float, ...]
    counts: tuple[Mapping[str, int], ...]
    horizon_s: float

    def __post_init__(self) -> None:
        if not self.times_s or self.times_s[0] != 0 or len(self.times_s) != len(self.counts):
            raise HetplanError("an availability trace starts at t_s 0 and gives counts at every point")
        if any(b <= a for a, b in itertools.pairwise(self.times_s)) or self.horizon_s <= self.times_s[-1]:
            raise HetplanError("an availability trace's points go forward in time and end before its horizon_s")
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for c in self.counts for n in c.values()):
            raise HetplanError("an availability trace counts devices in whole numbers, 0 or more")


def load_availability(path: str) -> Availability:
    """`{"horizon_s": 86400, "points": [{"t_s": 0, "counts": {"a100-40gb": 16, ...}}, ...]}`."""
    data = serde.read_json(path)
    try:
        points = data["points"]
        return Availability(tuple(float(p["t_s"]) for p in points), tuple(dict(p["counts"]) for p in points),
                            float(data["horizon_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise HetplanError(f"{path}: not an availability trace ({type(exc).__name__}: {exc}); write "
                           '{"horizon_s": S, "points": [{"t_s": 0, "counts": {"TYPE": N, ...}}, ...]}') from None
    except HetplanError as exc:
        raise HetplanError(f"{path}: {exc}") from None


def available(cluster: Cluster, counts: Mapping[str, int]) -> Cluster | None:
    """The cluster's first `counts[type]` devices of each type (None where there are none)."""
    by_type: dict[str, list[str]] = {}
    for d in cluster.ids:
        by_type.setdefault(cluster.device_type(d).name, []).append(d)
    for t, n in counts.items():
        if n > len(by_type.get(t, [])):
            raise HetplanError(f"the trace has {n} devices of type {t!r} but cluster {cluster.name} only "
                               f"{len(by_type.get(t, []))}; give a cluster with all the devices the trace names")
    ids = [d for t, n in counts.items() for d in by_type[t][:n]]
    return cluster.subset(ids, f"{cluster.name} ({', '.join(f'{n} {t}' for t, n in counts.items() if n)})") \
        if ids else None


@dataclass(frozen=True)
class Choice:
    """A plan with what the replay reads of it: the devices of each type it holds, its predicted
    samples per second and its price per second."""

    plan: Plan
    uses: Mapping[str, int]
    samples_per_s: float
    usd_per_s: float

    def fits(self, counts: Mapping[str, int]) -> bool:
        return all(counts.get(t, 0) >= n for t, n in self.uses.items())


def choice(cluster: Cluster, plan: Plan) -> Choice:
    uses: dict[str, int] = {}
    for d in plan.devices:
        t = cluster.device_type(d).name
        uses[t] = uses.get(t, 0) + 1
    assert plan.predicted is not None
    return Choice(plan, uses, plan.predicted.samples_per_s, usd_per_step(cluster, plan.devices, 1.0))


def decide(policy: str, running: Choice | None, fits: bool, new: Choice | None, restart_s: float,
           horizon_s: float) -> bool:
    """Whether to change from `running` (which still `fits` the devices there, or not) to `new`."""
    if policy == "static" or new is None or (running is not None and new.plan == running.plan):
        return False
    if running is None or not fits or policy == "every-change":
        return True
    return (new.samples_per_s - running.samples_per_s) * horizon_s > new.samples_per_s * restart_s


@dataclass(frozen=True)
class PolicyRun:
    """What a policy trained over the trace."""

    policy: str
    samples: float
    usd: float
    lost_s: float  # restarts, and work redone since a checkpoint
    stopped_s: float  # no plan running (none fits, or the static plan's devices are not there)
    restarts: int  # plans started after the first start (a new one, or one again after a stop)

    @property
    def usd_per_million_samples(self) -> float:
        return self.usd / self.samples * 1e6 if self.samples > 0 else math.inf


@dataclass(frozen=True)
class Costs:
    restart_s: float = 120.0  # from a stop to training again: start, load, first step
    checkpoint_every_s: float = 600.0


def replay(trace: Availability, plan_for: Callable[[Mapping[str, int]], Choice | None], costs: Costs,
           policies: tuple[str, ...] = POLICIES) -> list[PolicyRun]:
    """Each policy's run over the trace; `plan_for(counts)`: the plan for the devices there (None
    where no plan fits them), asked once per distinct counts by the caller's cache."""
    return [_replay(policy, trace, plan_for, costs) for policy in policies]


def _replay(policy: str, trace: Availability, plan_for, costs: Costs) -> PolicyRun:
    first = plan_for(trace.counts[0])
    running: Choice | None = None
    samples = usd = lost = stopped = 0.0
    restarts = 0
    ends = (*trace.times_s[1:], trace.horizon_s)
    for i, (t, end) in enumerate(zip(trace.times_s, ends, strict=True)):
        length, counts = end - t, trace.counts[i]
        target = _target(policy, i, t, counts, running, first, plan_for, costs)
        if running is not None and not running.fits(counts):  # stopped between checkpoints: that work again
            samples -= running.samples_per_s * costs.checkpoint_every_s / 2
            lost += costs.checkpoint_every_s / 2
        restart = bool(i) and target is not None and target is not running
        spent = min(costs.restart_s, length) if restart else 0.0
        restarts += restart
        if target is None:
            stopped += length
        else:
            samples += target.samples_per_s * (length - spent)
            usd += target.usd_per_s * length
            lost += spent
        running = target
    return PolicyRun(policy, max(samples, 0.0), usd, lost, stopped, restarts)


def _target(policy: str, i: int, t: float, counts, running: Choice | None, first: Choice | None, plan_for,
            costs: Costs) -> Choice | None:
    """The plan a policy runs from point i on."""
    if i == 0:
        return first
    if policy == "static":
        return first if first is not None and first.fits(counts) else None
    fits = running is not None and running.fits(counts)
    new = plan_for(counts)
    if decide(policy, running, fits, new, costs.restart_s, t / i):
        return new
    return running if fits else None


def plan_cache(cluster: Cluster, make: Callable[[Cluster], Plan]) -> Callable[[Mapping[str, int]], Choice | None]:
    """`plan_for` over `make(cluster of the devices there)`, once per distinct counts; None where
    nothing fits (an infeasible or empty cluster)."""
    made: dict[tuple, Choice | None] = {}

    def plan_for(counts: Mapping[str, int]) -> Choice | None:
        key = tuple(sorted((t, n) for t, n in counts.items() if n))
        if key not in made:
            there = available(cluster, counts)
            try:
                made[key] = choice(there, make(there)) if there is not None else None
            except InfeasibleError:
                made[key] = None
        return made[key]

    return plan_for
