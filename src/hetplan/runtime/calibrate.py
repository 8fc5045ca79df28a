"""Measuring the runtime's own cost per pipeline action on a cluster's workers.

Besides the model's operators, every forward or backward action of a pipeline costs the runtime
something (the schedule's bookkeeping in Python, a gloo send and receive, waking up the next
worker). The profiler cannot see it. `calibrate_action_overhead` runs one probe model as a
two-stage pipeline on two of the cluster's workers with few and with many micro-batches, and
divides the extra time the simulator did not predict by the extra actions on the critical path:

    overhead = (excess(m_hi) - excess(m_lo)) / (actions(m_hi) - actions(m_lo)),
    excess = measured - predicted, actions = 2 (m + stages - 1)

The difference cancels what does not grow with the micro-batches; what is left of the excess
with few micro-batches, less their actions' share, is the runtime's cost per step (barriers,
starting the schedule, gathering the loss). The probe is a small
perceptron of its own (12 layers of width 256, `probe_model`), not one of the models of the
benchmark of predicted against measured (gpt2-tiny, the zoo's mlp, inception-tiny), so that the
benchmark checks the calibration rather than repeats it.
"""

from __future__ import annotations

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


def calibrate_action_overhead(cluster: Cluster, steps: int = 10, m_lo: int = 2, m_hi: int = 8,
                              say=lambda msg: None) -> tuple[float, float, dict]:
    """Seconds per action, seconds per step (what is left of the excess with few micro-batches),
    and the measurements they come from."""
    from hetplan.plan import Plan, Stage
    from hetplan.profile import profile_step
    from hetplan.runtime.launch import launch, run_spec
    from hetplan.sim import simulate
    from hetplan.zoo import load_model

    workers = [d for d in cluster.devices if (d.binding or "").startswith("cpu")]
    if len(workers) < 2:
        raise HetplanError(f"cluster {cluster.name!r} needs two CPU workers (binding: cpu) to calibrate on")
    a, b = workers[0], workers[1]
    if a.type != b.type:
        raise HetplanError(f"calibrating needs two workers of one type; {a.id} is {a.type}, {b.id} is {b.type}")
    threads = a.threads or 1
    say(f"profiling the probe ({PROBE}) on cpu:{threads}, the workers' type")
    zoo_model = load_model(PROBE, batch_size=PROBE_BATCH, seq_len=PROBE_SEQ)
    graph = profile_step(zoo_model.step, zoo_model.batch, name=PROBE, devices=[f"cpu:{threads}"],
                         repeats=10).graph
    if graph.profiled_on != a.type:
        raise HetplanError(f"the workers are {a.type} but the probe was profiled as {graph.profiled_on}")
    order = graph.topo_order
    half = len(order) // 2
    bare = replace(cluster, devices=tuple(replace(d, action_overhead_s=0.0, step_overhead_s=0.0)
                                          for d in cluster.devices))
    points = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in (m_lo, m_hi):
            plan = Plan((Stage(order[:half], (a.id,)), Stage(order[half:], (b.id,))), m, "1f1b", "calibrate")
            say(f"running the probe as 2 stages with {m} micro-batches")
            spec = run_spec(plan, bare, PROBE, batch_size=PROBE_BATCH, seq_len=PROBE_SEQ, granularity="layer",
                            steps=steps, warmup=3, out_dir=Path(tmp) / f"m{m}")
            measured = launch(spec).measured_step_s
            predicted = simulate(graph, bare, plan, timeline=False).estimate.step_s
            points[m] = {"measured_step_s": measured, "predicted_step_s": predicted, "actions": 2 * (m + 1)}
    lo, hi = points[m_lo], points[m_hi]
    slope = ((hi["measured_step_s"] - hi["predicted_step_s"]) - (lo["measured_step_s"] - lo["predicted_step_s"])) / (
        hi["actions"] - lo["actions"])
    slope = max(0.0, slope)
    per_step = max(0.0, lo["measured_step_s"] - lo["predicted_step_s"] - slope * lo["actions"])
    return slope, per_step, points
