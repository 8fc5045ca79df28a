"""Calibrating a cluster on the machine its workers run on (`hetplan calibrate`).

The simulator charges more than the model's operators; each of these is measured here, in
fresh processes like the workers (`hetplan.runtime.probes`), and written into the cluster:

1. the link between local workers: gloo point to point, bandwidth and latency (`intra_host`);
2. gloo all-reduces among 2 .. n local processes, by bytes (`Calibration.allreduce`);
3. the optimizer step on each worker's threads or GPU, by weight bytes (`Device.optimizer_points`);
4. how much CPU workers side by side slow each other down (`Calibration.corun_slowdown`);
5. last, with all of the above charged, the runtime's own cost per pipeline action and per step
   (the executor's bookkeeping in Python, waking up the next worker), which nothing else sees.
   `calibrate_action_overhead` runs a probe model as a pipeline over all of the cluster's
   workers (one stage each) with 2, 3, 4, 6 and 8 micro-batches, and fits a line through the
   extra time the simulator did not predict against the actions on the critical path:

       excess = measured - predicted = overhead * actions + per_step, actions = 2 (m + stages - 1)

   Its slope is the cost per action, its intercept the cost per step (`fit_overheads`): Theil and
   Sen's line (the median of the slopes between every two runs, `scipy.stats.theilslopes`), so
   that one run slowed by something else on the machine does not move it (with three runs and
   least squares, one such run moved the slope tenfold).
   The probe is a perceptron of its own (12 layers of width 256, `probe_model`), not one of the
   models of the benchmark of predicted against measured, so that the benchmark checks the
   calibration rather than repeats it.

Where workers sit on GPUs, what their messages cross is measured too, on the backend the run
will use (`runtime.backend`): each GPU's copies to and from the host, which a message between a
GPU worker and a CPU one (or any, over gloo) takes besides gloo's link, and where NCCL carries
what passes between GPUs, NCCL point to point between two of them and its all-reduces where every
worker is on a GPU; written as links between those pairs of devices (`cost.network.gpu_links`). NCCL between
two GPUs has not run on the machines lent to this project (one GPU each).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from hetplan.cluster import AllreduceCurve, Calibration, Cluster, Device, Link, LinkOverride
from hetplan.cost.network import gpu_links
from hetplan.errors import HetplanError
from hetplan.runtime.settings import RunSettings

PROBE, PROBE_BATCH, PROBE_SEQ = "hetplan.runtime.calibrate:probe_model", 32, None


def probe_model(batch_size: int = PROBE_BATCH, seq_len: int | None = None):
    """The calibration probe: 12 linear layers of width 256 with ReLUs, random data."""
    import torch

    from hetplan.zoo import ZooModel
    from hetplan.zoo.models import MLP, TrainStep, _classifier_loss

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(batch_size, 256, generator=gen), "labels": torch.randint(0, 10, (batch_size,),
                                                                                          generator=gen)}
    return ZooModel("probe", TrainStep(MLP((256,) * 12 + (10,)), _classifier_loss), batch, ("Linear",))


def _profile_spec(device) -> str:
    """How the profiler names the device a worker runs on: `cpu:THREADS` or its CUDA binding."""
    binding = device.binding or "cpu"
    return binding if binding.startswith("cuda") else f"cpu:{device.threads or 1}"


MICROBATCHES = (2, 3, 4, 6, 8)  # the probe's runs, for the line of the excess against the actions
PHASES = 5 + len(MICROBATCHES)  # what `calibrate_cluster` says it is doing, one `say` each


def calibrate_action_overhead(cluster: Cluster, steps: int = 15, microbatches: Sequence[int] = MICROBATCHES,
                              say=lambda msg: None) -> tuple[float, float, dict]:
    """Seconds per action and per step (`fit_overheads`) and the measurements they come from.
    The probe runs as a pipeline over every bound worker of the cluster (one stage each, in
    cluster order), CPU or CUDA, of any thread counts: it is profiled on each of their types
    first, so that the prediction it is compared with knows each worker's speed."""
    from hetplan.plan import Plan, Stage
    from hetplan.profile import profile_step
    from hetplan.runtime.launch import launch, run_spec
    from hetplan.sim import simulate
    from hetplan.zoo import load_model

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise HetplanError(f"--steps {steps}: the probe pipeline runs at least 1 step (a median needs one); give "
                           "--steps 1 or more (default 15)")
    workers = [d for d in cluster.devices if d.binding is not None]
    if not workers:
        raise HetplanError(f"cluster {cluster.name!r} has no worker to calibrate: give its devices a binding "
                           "(binding: cpu, with threads, or cuda:K)")
    specs = list(dict.fromkeys(_profile_spec(d) for d in workers))
    say(f"profiling the probe ({PROBE}) on {', '.join(specs)}, the workers' types")
    zoo_model = load_model(PROBE, batch_size=PROBE_BATCH, seq_len=PROBE_SEQ)
    graph = profile_step(zoo_model.step, zoo_model.batch, name=PROBE, devices=specs, repeats=10).graph
    order = graph.topo_order
    n = min(len(workers), len(order))
    workers = workers[:n]
    cuts = [len(order) * k // n for k in range(n + 1)]
    bare = replace(cluster, devices=tuple(replace(d, action_overhead_s=0.0, step_overhead_s=0.0)
                                          for d in cluster.devices))
    points = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in microbatches:
            plan = Plan(tuple(Stage(tuple(order[cuts[k]:cuts[k + 1]]), (workers[k].id,)) for k in range(n)), m,
                        "1f1b", "calibrate")
            say(f"running the probe as {n} stage{'s' if n > 1 else ''} with {m} micro-batches")
            spec = run_spec(plan, bare, PROBE, RunSettings(batch_size=PROBE_BATCH, seq_len=PROBE_SEQ,
                            granularity="layer", steps=steps, warmup=3, out_dir=Path(tmp) / f"m{m}"), graph=graph)
            measured = launch(spec).measured_step_s
            predicted = simulate(graph, bare, plan, timeline=False).estimate.step_s
            points[m] = {"measured_step_s": measured, "predicted_step_s": predicted, "actions": 2 * (m + n - 1)}
    return (*fit_overheads(list(points.values())), points)


def fit_overheads(points: Sequence[dict]) -> tuple[float, float]:
    """Seconds per action and per step from runs of one pipeline with different numbers of
    micro-batches, each {measured_step_s, predicted_step_s, actions}: Theil and Sen's line of the
    excess over the prediction against the actions (the median of the pairwise slopes; through
    both points for two), its slope per action and the median of what is left per step. Neither
    is negative: with a falling excess, nothing per action and the median excess per step."""
    from scipy.stats import theilslopes

    actions = np.array([x["actions"] for x in points], dtype=float)
    excess = np.array([x["measured_step_s"] - x["predicted_step_s"] for x in points])
    slope = float(theilslopes(excess, actions).slope) if len(set(actions)) > 1 else 0.0
    slope = max(0.0, slope)
    return slope, max(0.0, float(np.median(excess - slope * actions)))


def calibrate_link(repeats: int = 10, gpus: Sequence[str] = ()) -> tuple[Link, dict]:
    """Point-to-point bandwidth and latency between two local worker processes: a line through
    the one-way time of two message sizes (ping-pong, `probes.p2p`). Of gloo on the host by
    default: what a pipeline's activations and gradients cost between local workers (loopback
    TCP and buffer copies), which the cluster presets can only guess; with two `gpus`, of NCCL
    between them."""
    from hetplan.runtime.probes import P2P_BYTES, spawn_probe

    params = {"sizes": P2P_BYTES, "repeats": repeats, **({"backend": "nccl", "devices": list(gpus)} if gpus else {})}
    seconds = {int(k): v for k, v in spawn_probe("p2p", 2, params)[0].items()}
    return line_through(seconds), {"p2p_s_by_bytes": seconds}


def line_through(seconds: dict[int, float]) -> Link:
    """The link whose transfers take the two measured (bytes: seconds): its latency and bandwidth."""
    (n1, t1), (n2, t2) = sorted(seconds.items())
    per_byte = max((t2 - t1) / (n2 - n1), 1e-15)
    return Link(1.0 / per_byte, max(0.0, t1 - per_byte * n1))


def calibrate_allreduce(workers: int, repeats: int = 10, gpus: Sequence[str] = ()) -> tuple[AllreduceCurve, ...]:
    """All-reduce times among 2 .. `workers` local processes (at least 2), at six sizes: gloo on
    the host, or with `gpus` (one per worker) NCCL on them, as the run's sums will go."""
    from hetplan.runtime.probes import ALLREDUCE_BYTES, spawn_probe

    curves = []
    for r in range(2, max(2, workers) + 1):
        params = {"sizes": ALLREDUCE_BYTES, "repeats": repeats,
                  **({"backend": "nccl", "devices": list(gpus[:r])} if gpus else {})}
        seconds = spawn_probe("allreduce", r, params)[0]
        curves.append(AllreduceCurve(r, monotone(tuple((float(k), v) for k, v in seconds.items()))))
    return tuple(curves)


def calibrate_copies(gpus: Sequence[str], repeats: int = 10) -> dict[str, Link]:
    """Each GPU's copies between the host and it, as a link (a line through two sizes, the
    slower of the two ways: a link is used both ways)."""
    from hetplan.runtime.probes import P2P_BYTES, spawn_probe

    out = {}
    for gpu in dict.fromkeys(gpus):
        got = spawn_probe("copies", 1, {"device": gpu, "sizes": P2P_BYTES, "repeats": repeats})[0]
        ways = [line_through({int(k): v for k, v in got[way].items()}) for way in ("h2d", "d2h")]
        out[gpu] = Link(min(w.bandwidth_Bps for w in ways), max(w.latency_s for w in ways))
    return out


def monotone(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Measured (bytes, seconds) with no size slower than a larger one: a smaller all-reduce does
    not take longer, so a point that did was slowed by something else (a worker descheduled on a
    busy machine: 3.9 ms for 4 kB against 0.9 ms for 1 MB, once here) and takes the larger's time."""
    out, fastest = [], math.inf
    for x, s in sorted(points, reverse=True):
        fastest = min(fastest, s)
        out.append((x, fastest))
    return tuple(reversed(out))


def _optimizer_key(device: Device) -> tuple[str, int]:
    """Workers with the same key measure the same optimizer step: a GPU, or a thread count."""
    binding = device.binding or "cpu"
    return (binding, 0) if binding.startswith("cuda") else (binding, device.threads or 1)


def calibrate_optimizer(workers: Sequence[Device], repeats: int = 5) -> dict[str, tuple[tuple[float, float], ...]]:
    """Adam's step time by weight bytes on each worker (once per thread count or GPU), in a
    process of the worker's thread count pinned to as many cores (`probes.optimizer`)."""
    from hetplan.runtime.launch import pin_cores
    from hetplan.runtime.probes import OPTIMIZER_PARAMS, spawn_probe

    measured: dict[tuple[str, int], tuple] = {}
    for dev in workers:
        key = _optimizer_key(dev)
        if key not in measured:
            cuda = key[0].startswith("cuda")
            cores = pin_cores([key[1]])[0] if not cuda else []
            out = spawn_probe("optimizer", 1, {"sizes": OPTIMIZER_PARAMS, "repeats": repeats,
                                               "device": key[0] if cuda else "cpu"},
                              threads=[max(1, key[1])], cores=[cores])[0]
            measured[key] = tuple((float(k), v) for k, v in out.items())
    return {dev.id: measured[_optimizer_key(dev)] for dev in workers}


def calibrate_corun(cpu_workers: Sequence[Device], repeats: int = 20, rounds: int = 2
                    ) -> tuple[tuple[int, float], ...]:
    """How much longer CPU workers' compute takes side by side: a compute-heavy step timed on
    each worker alone, then on the first k workers at once (k = 2 .. all), each on the cores the
    launcher would give it; the factor for k is the mean over them of time together / alone,
    averaged over `rounds` (on a shared machine one round moves by 20%)."""
    from hetplan.runtime.launch import pin_cores
    from hetplan.runtime.probes import spawn_probe

    threads = [d.threads or 1 for d in cpu_workers]
    cores = pin_cores(threads)
    factors: dict[int, list[float]] = {k: [] for k in range(2, len(cpu_workers) + 1)}
    for _ in range(rounds):
        alone = [spawn_probe("busy_step", 1, {"repeats": repeats}, threads=[t], cores=[c])[0]
                 for t, c in zip(threads, cores, strict=True)]
        for k in factors:
            together = spawn_probe("busy_step", k, {"repeats": repeats}, threads=threads[:k], cores=cores[:k])
            factors[k].append(statistics.mean(t / a for t, a in zip(together, alone, strict=False)))
    return ((1, 1.0), *((k, statistics.mean(f)) for k, f in factors.items()))


def _measured_machine() -> str:
    import datetime
    import platform

    import torch

    return (f"hetplan calibrate on {platform.node() or 'this machine'} ({os.cpu_count()} cores, torch "
            f"{torch.__version__}), {datetime.date.today().isoformat()}")


def _check_runs_here(workers: Sequence[Device]) -> None:
    """Every worker's threads and GPU exist on this machine: said before minutes of probes."""
    from hetplan.profile.devices import cores_short_of, parse_device

    for d in workers:
        cores = cores_short_of(d.threads or 1) if d.binding == "cpu" else None
        if cores is not None:
            raise HetplanError(f"worker {d.id} has {d.threads} threads, but this process may use {cores} cores: "
                               f"calibrate on the machine the cluster file describes, or give it at most {cores}")
        if d.binding.startswith("cuda"):
            parse_device(d.binding)


def _gpu_links(workers: Sequence[Device], link: Link, report: dict, say) -> tuple[tuple[LinkOverride, ...], bool]:
    """The links of the GPU workers (`cost.network.gpu_links`: copies to and from each GPU measured, NCCL
    between two GPUs where the run talks over it), into `report`; and whether it does."""
    from hetplan.runtime.backend import MIXED, backend_of

    gpus = list(dict.fromkeys(d.binding for d in workers if d.binding.startswith("cuda")))
    if not gpus:
        return (), False
    nccl = backend_of("auto", [d.binding for d in workers]) == MIXED
    say(f"timing copies between the host and {len(gpus)} GPU{'s' if len(gpus) > 1 else ''}"
        + (", and NCCL between two" if nccl and len(gpus) > 1 else ""))
    copies = calibrate_copies(gpus)
    nccl_link = calibrate_link(gpus=gpus[:2])[0] if nccl and len(gpus) > 1 else None
    report.update(copies={g: (c.bandwidth_Bps, c.latency_s) for g, c in copies.items()},
                  nccl_link=(nccl_link.bandwidth_Bps, nccl_link.latency_s) if nccl_link else None)
    return gpu_links(workers, link, copies, nccl_link), nccl


def calibrate_cluster(cluster: Cluster, steps: int = 15, say=lambda msg: None) -> tuple[Cluster, dict]:
    """The cluster with what this machine measured, in the order each needs the ones before: the
    link between local workers and all-reduces by group size (gloo), each worker's optimizer
    step, the co-running slowdown of its CPU workers, and then the runtime's cost per action
    and per step on top of all that (`calibrate_action_overhead`). Returns it and the figures."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise HetplanError(f"--steps {steps}: the probe pipeline runs at least 1 step (a median needs one); give "
                           "--steps 1 or more (default 15)")
    workers = [d for d in cluster.devices if d.binding is not None]
    if not workers:
        raise HetplanError(f"cluster {cluster.name!r} has no worker to calibrate: give its devices a binding "
                           "(binding: cpu, with threads, or cuda:K)")
    if len({d.host for d in workers}) > 1:
        raise HetplanError(f"cluster {cluster.name!r} has workers on several hosts; hetplan calibrate measures "
                           "the workers of one machine: calibrate each host's part as its own cluster file")
    _check_runs_here(workers)
    say("timing gloo point to point between two local processes")
    link, report = calibrate_link()
    links, nccl = _gpu_links(workers, link, report, say)
    gpus = [d.binding for d in workers] if nccl and all(d.binding.startswith("cuda") for d in workers) else []
    say(f"timing {'NCCL' if gpus else 'gloo'} all-reduces among 2 to {max(2, len(workers))} local processes")
    curves = calibrate_allreduce(len(workers), gpus=gpus)
    say("timing the optimizer step on each worker's threads or GPU")
    optimizer = calibrate_optimizer(workers)
    cpu = [d for d in workers if d.binding == "cpu"]
    say(f"timing {len(cpu)} CPU worker{'s' if len(cpu) != 1 else ''} alone and side by side")
    corun = calibrate_corun(cpu) if len(cpu) > 1 else ((1, 1.0),)
    pairs = {frozenset(o.between) for o in links}
    measured = replace(cluster, intra_host=link, calibration=Calibration(_measured_machine(), curves, corun),
                       links=tuple(o for o in cluster.links if frozenset(o.between) not in pairs) + links,
                       devices=tuple(replace(d, optimizer_points=optimizer.get(d.id, d.optimizer_points))
                                     for d in cluster.devices))
    overhead, per_step, points = calibrate_action_overhead(measured, steps=steps, say=say)
    report.update(link_bandwidth_Bps=link.bandwidth_Bps, link_latency_s=link.latency_s,
                  allreduce={c.replicas: dict(c.points) for c in curves}, optimizer_points=optimizer,
                  corun_slowdown=dict(corun), action_overhead_s=overhead, step_overhead_s=per_step, runs=points)
    calibrated = replace(measured, name=f"{cluster.name}-calibrated", devices=tuple(
        replace(d, action_overhead_s=overhead, step_overhead_s=per_step) if d.binding is not None
        else d for d in measured.devices))
    return calibrated, report
