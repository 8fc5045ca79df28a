"""Measuring the runtime's own cost per pipeline action on a cluster's workers.

Besides the model's operators, every forward or backward action of a pipeline costs the runtime
something (the executor's bookkeeping in Python, a gloo send and receive, waking up the next
worker). The profiler cannot see it. `calibrate_action_overhead` runs one probe model as a
pipeline over all of the cluster's workers (one stage each, any mix of thread counts and GPUs)
with few and with many micro-batches, and divides the extra time the simulator did not predict
by the extra actions on the critical path:

    overhead = (excess(m_hi) - excess(m_lo)) / (actions(m_hi) - actions(m_lo)),
    excess = measured - predicted, actions = 2 (m + stages - 1)

The result is one cost per action and per step for every worker of the cluster.

The difference cancels what does not grow with the micro-batches; what is left of the excess
with few micro-batches, less their actions' share, is the runtime's cost per step (barriers,
starting the schedule, gathering the loss). The probe is a small
perceptron of its own (12 layers of width 256, `probe_model`), not one of the models of the
benchmark of predicted against measured (gpt2-tiny, the zoo's mlp, inception-tiny), so that the
benchmark checks the calibration rather than repeats it.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

from hetplan.cluster import Cluster
from hetplan.errors import HetplanError

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


def calibrate_action_overhead(cluster: Cluster, steps: int = 10, m_lo: int = 2, m_hi: int = 8,
                              say=lambda msg: None) -> tuple[float, float, dict]:
    """Seconds per action, seconds per step (what is left of the excess with few micro-batches),
    and the measurements they come from. The probe runs as a pipeline over every bound worker of
    the cluster (one stage each, in cluster order), CPU or CUDA, of any thread counts: it is
    profiled on each of their types first, so that the prediction it is compared with knows each
    worker's speed."""
    from hetplan.plan import Plan, Stage
    from hetplan.profile import profile_step
    from hetplan.runtime.launch import launch, run_spec
    from hetplan.sim import simulate
    from hetplan.zoo import load_model

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
        for m in (m_lo, m_hi):
            plan = Plan(tuple(Stage(tuple(order[cuts[k]:cuts[k + 1]]), (workers[k].id,)) for k in range(n)), m,
                        "1f1b", "calibrate")
            say(f"running the probe as {n} stage{'s' if n > 1 else ''} with {m} micro-batches")
            spec = run_spec(plan, bare, PROBE, batch_size=PROBE_BATCH, seq_len=PROBE_SEQ, granularity="layer",
                            steps=steps, warmup=3, out_dir=Path(tmp) / f"m{m}", graph=graph)
            measured = launch(spec).measured_step_s
            predicted = simulate(graph, bare, plan, timeline=False).estimate.step_s
            points[m] = {"measured_step_s": measured, "predicted_step_s": predicted, "actions": 2 * (m + n - 1)}
    lo, hi = points[m_lo], points[m_hi]
    slope = ((hi["measured_step_s"] - hi["predicted_step_s"]) - (lo["measured_step_s"] - lo["predicted_step_s"])) / (
        hi["actions"] - lo["actions"])
    slope = max(0.0, slope)
    per_step = max(0.0, lo["measured_step_s"] - lo["predicted_step_s"] - slope * lo["actions"])
    return slope, per_step, points


LINK_SIZES_BYTES = (1 << 20, 16 << 20)


def _link_probe(rank: int, world: int, sizes: tuple[int, ...], repeats: int, out: Path) -> None:
    """Run in each of two worker processes: time gloo all-reduces of float32 buffers of `sizes`
    bytes (after two untimed ones), median per size, written by rank 0."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    medians = {}
    for size in sizes:
        buf = torch.ones(size // 4)
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        medians[size] = statistics.median(times)
    dist.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps({str(k): v for k, v in medians.items()}))


def calibrate_link(repeats: int = 10) -> tuple[float, float, dict]:
    """Bandwidth (bytes/s) and latency (s) of gloo between two local worker processes, as the
    simulator's ring all-reduce charges them: for two replicas an all-reduce of n bytes takes
    2 latency + n / bandwidth, so a line through two sizes gives both. This is what gradients
    cost between replicas on this machine (loopback TCP, buffer copies, reductions), which the
    cluster presets can only guess."""
    import os
    import subprocess
    import sys

    from hetplan.runtime.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "link.json"
        port = free_port()
        code = ("import sys; from pathlib import Path; from hetplan.runtime.calibrate import _link_probe; "
                f"_link_probe(int(sys.argv[1]), 2, {LINK_SIZES_BYTES!r}, {repeats}, Path(sys.argv[2]))")
        procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(out)],
                                  env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "OMP_NUM_THREADS": "1"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for rank in range(2)]
        errors = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                err = "timed out after 120 s"
            if p.returncode:
                errors.append((err or "").strip().splitlines()[-1:] or ["no output"])
        if errors or not out.exists():
            raise HetplanError(f"measuring gloo between two local processes failed: {errors[0][0] if errors else '?'}")
        medians = {int(k): v for k, v in json.loads(out.read_text()).items()}
    (n1, t1), (n2, t2) = sorted(medians.items())
    per_byte = max((t2 - t1) / (n2 - n1), 1e-15)
    latency = max(0.0, (t1 - per_byte * n1) / 2)
    return 1.0 / per_byte, latency, {"allreduce_s_by_bytes": medians}


def calibrate_cluster(cluster: Cluster, steps: int = 10, say=lambda msg: None) -> tuple[Cluster, dict]:
    """The cluster with what this machine measured: the link between local workers (gloo), then
    each CPU worker's cost per action and per step on top of it. Returns it and the figures."""
    from hetplan.cluster import Link

    hosts = {d.host for d in cluster.devices if d.binding is not None}
    report: dict = {}
    if len(hosts) == 1:
        say("timing gloo all-reduces between two local processes")
        bandwidth, latency, points = calibrate_link()
        cluster = replace(cluster, intra_host=Link(bandwidth, latency))
        report.update(link_bandwidth_Bps=bandwidth, link_latency_s=latency, link_runs=points)
    overhead, per_step, points = calibrate_action_overhead(cluster, steps=steps, say=say)
    report.update(action_overhead_s=overhead, step_overhead_s=per_step, runs=points)
    calibrated = replace(cluster, name=f"{cluster.name}-calibrated", devices=tuple(
        replace(d, action_overhead_s=overhead, step_overhead_s=per_step) if d.binding is not None
        else d for d in cluster.devices))
    return calibrated, report
