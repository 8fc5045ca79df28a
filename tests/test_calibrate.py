"""Calibration: the runtime's cost per action, the probes of `hetplan calibrate`, and what a
calibrated cluster holds and how the simulators charge it."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetplan.cluster import AllreduceCurve, Calibration
from hetplan.cost import CostModel, formulas
from hetplan.errors import ClusterError, HetplanError
from hetplan.graph import Edge, Graph, Node
from hetplan.io import serde
from hetplan.io.clusters import cluster_from_spec, load_cluster
from hetplan.plan import Plan, Stage
from hetplan.runtime.calibrate import fit_overheads
from hetplan.sim import simulate
from hetplan.sim.chains import ChainScorer
from hetplan.sim.fast import fast_step_s
from strategies import V, chain, one_per_stage


def test_action_overhead_is_charged_per_action():
    spec = {"devices": [{"id": f"v{i}", "type": V, "action_overhead": "2ms", "step_overhead": "5ms"} for i in range(3)]}
    cluster = cluster_from_spec(spec, "slowrt")
    assert cluster.device("v0").action_overhead_s == pytest.approx(0.002)
    g = chain(3, fwd=0.03, bwd=0.05)
    plan = one_per_stage(3, 4, "gpipe")
    est = simulate(g, cluster, plan).estimate
    assert est.step_s == pytest.approx((4 + 3 - 1) * (0.08 / 4 + 2 * 0.002) + 0.005)
    assert fast_step_s(g, cluster, [plan])[0] == pytest.approx(est.step_s)
    with pytest.raises(HetplanError, match="action_overhead"):
        cluster_from_spec({"devices": [{"id": "x", "type": V, "action_overhead": "-1ms"}]}, "bad")


def test_the_probes_measure_gloo_the_optimizer_and_workers_side_by_side():
    """Each probe in fresh processes, few repeats: figures of the right kind and size."""
    from hetplan.runtime.calibrate import (
        calibrate_allreduce,
        calibrate_copies,
        calibrate_corun,
        calibrate_link,
        calibrate_optimizer,
    )
    from hetplan.runtime.probes import ALLREDUCE_BYTES, OPTIMIZER_PARAMS, P2P_BYTES

    link, points = calibrate_link(repeats=3)
    assert 1e7 < link.bandwidth_Bps < 1e12 and 0 <= link.latency_s < 0.1
    assert sorted(points["p2p_s_by_bytes"]) == sorted(P2P_BYTES)
    (curve,) = calibrate_allreduce(2, repeats=2)
    assert curve.replicas == 2 and [x for x, _ in curve.points] == sorted(ALLREDUCE_BYTES)
    workers = load_cluster("local").devices[:2]
    optimizer = calibrate_optimizer(workers, repeats=2)
    assert set(optimizer) == {d.id for d in workers} and optimizer[workers[0].id] == optimizer[workers[1].id]
    sizes, seconds = zip(*optimizer[workers[0].id], strict=True)
    assert sizes == tuple(4.0 * n for n in OPTIMIZER_PARAMS) and seconds[-1] > seconds[0] > 0
    corun = calibrate_corun(workers, repeats=3, rounds=1)
    assert [k for k, _ in corun] == [1, 2] and corun[0][1] == 1.0 and 0.5 < corun[1][1] < 10
    # a GPU's copies to and from the host, here the host's own copies (what the probe does on a GPU)
    (copy,) = calibrate_copies(["cpu"], repeats=3).values()
    assert 1e7 < copy.bandwidth_Bps < 1e12 and 0 <= copy.latency_s < 0.1


def test_the_links_of_gpu_workers_are_the_copies_gloo_or_nccl_a_message_takes():
    """Two CPU workers and two GPU workers: between a CPU and a GPU worker
    gloo after one copy; between GPU workers NCCL where the run talks over it, else gloo between
    two copies; nothing between CPU workers (the host's link stays theirs)."""
    from hetplan.cluster import Device, Link
    from hetplan.cost.network import gpu_links

    workers = [Device(d, "t", "h", 2**30, 0.0, binding=b) for d, b in (("c0", "cpu"), ("c1", "cpu"),
                                                                         ("g0", "cuda:0"), ("g1", "cuda:1"))]
    gloo, nccl = Link(1e9, 1e-4), Link(1e11, 1e-5)
    copies = {"cuda:0": Link(2e9, 1e-5), "cuda:1": Link(4e9, 2e-5)}

    def links(nccl_link):
        return {o.between: pytest.approx((o.bandwidth_Bps, o.latency_s))
                for o in gpu_links(workers, gloo, copies, nccl_link)}

    one, other, two = 1 / (1e-9 + 0.5e-9), 1 / (1e-9 + 0.25e-9), 1 / (1e-9 + 0.5e-9 + 0.25e-9)
    assert links(None) == {("c0", "g0"): (one, 1.1e-4), ("c0", "g1"): (other, 1.2e-4), ("c1", "g0"): (one, 1.1e-4),
                           ("c1", "g1"): (other, 1.2e-4), ("g0", "g1"): (two, 1.3e-4)}
    assert links(nccl)[("g0", "g1")] == (1e11, 1e-5) and links(nccl)[("c0", "g0")] == (one, 1.1e-4)
    assert formulas.in_series([(1e9, 1.0), (1e9, 2.0)]) == pytest.approx((5e8, 3.0))


# -- what a calibrated cluster holds and how the simulators charge it ----------------------------
C = "cpu-1t"


def test_measured_curve_interpolates_and_extends_the_measured_points():
    pts = ((1e6, 0.002), (3e6, 0.004), (5e6, 0.010))
    assert formulas.measured_s(2e6, pts) == pytest.approx(0.003)
    assert formulas.measured_s(7e6, pts) == pytest.approx(0.016)  # the last segment's 3 ms per MB goes on
    # below: the first segment's line (1 ms + 1 ms per MB) against the first point scaled (2 ms per MB)
    assert formulas.measured_s(0.5e6, pts) == pytest.approx(0.0015)
    assert formulas.measured_s(0.5e6, ((1e6, 0.004), (2e6, 0.010))) == pytest.approx(0.002)  # proportional
    assert formulas.measured_s(4e6, ((2e6, 0.010),)) == pytest.approx(0.020)
    assert formulas.measured_s(0, pts) == 0.0
    xs = np.array([0.0, 0.5e6, 2e6, 7e6])
    assert formulas.measured_s(xs, pts) == pytest.approx([formulas.measured_s(float(x), pts) for x in xs])


def test_corun_factor_and_ring_scale():
    assert formulas.corun_factor(1, ((2, 1.1), (4, 1.3))) == 1.0
    assert formulas.corun_factor(3, ((2, 1.1), (4, 1.3))) == pytest.approx(1.2)
    assert formulas.corun_factor(6, ((2, 1.1), (4, 1.3))) == pytest.approx(1.5)
    assert formulas.corun_factor(4, ()) == 1.0
    assert formulas.ring_scale(4, 2) == pytest.approx(1.5)  # 2 * 3/4 against 2 * 1/2 of the buffer per worker


def _cpu_cluster(calibration=None, optimizer_points=()):
    spec = {"devices": [{"id": f"c{i}", "type": "cpu", "threads": 1, "host": "h0", "binding": "cpu"}
                        for i in range(3)] + [{"id": "g0", "type": V, "host": "h0"}]}
    cluster = cluster_from_spec(spec, "cal")
    return replace(cluster, calibration=calibration,
                   devices=tuple(replace(d, optimizer_points=optimizer_points) if d.id.startswith("c") else d
                                 for d in cluster.devices))


CAL = Calibration("test", (AllreduceCurve(2, ((1e6, 0.001), (2e6, 0.002))),), ((2, 1.25), (3, 1.5)))


def test_a_calibrated_cluster_round_trips_through_json_and_refuses_bad_figures(tmp_path):
    cluster = _cpu_cluster(CAL, ((1e6, 0.01), (4e6, 0.05)))
    serde.dump(cluster, tmp_path / "c.json")
    assert serde.load(tmp_path / "c.json", expect="cluster") == cluster
    with pytest.raises(ClusterError, match="same size"):
        AllreduceCurve(2, ((1e6, 0.1), (1e6, 0.2)))
    with pytest.raises(ClusterError, match="2 or more"):
        AllreduceCurve(1, ((1e6, 0.1),))
    with pytest.raises(ClusterError, match="seconds >= 0"):
        replace(cluster.devices[0], optimizer_points=((1e6, -1.0),))


def test_the_cost_model_reads_the_calibrated_figures():
    g = Graph("one", (Node("n0", "Linear", {C: 0.01, V: 0.01}, {C: 0.02, V: 0.02}, param_bytes=4_000_000),), (),
              batch_size=8, profiled_on=C)
    plain, cal = CostModel(g, _cpu_cluster()), CostModel(g, _cpu_cluster(CAL, ((1e6, 0.01), (4e6, 0.05))))
    assert cal._optimizer_s(2e6, "c0") == pytest.approx(0.01 + 0.04 / 3)
    bandwidth = plain.cluster.device_type("c0").mem_bw_Bps
    assert plain._optimizer_s(2e6, "c0") == pytest.approx(formulas.optimizer_s(2e6, bandwidth))
    assert cal._allreduce_s(1.5e6, ("c0", "c1")) == pytest.approx(0.0015)
    assert cal._allreduce_s(1e6, ("c0", "c1", "c2")) == pytest.approx(0.001 * 4 / 3)  # nearest curve, 2 -> 3 ring
    assert cal._corun_factor("c0", ("c0",)) == 1.0
    assert cal._corun_factor("c0", ("c0", "c1", "g0")) == pytest.approx(1.25)  # the GPU is no CPU worker
    assert cal._corun_factor("c0", ("c0", "c1", "c2")) == pytest.approx(1.5)
    assert cal._corun_factor("g0", ("c0", "c1", "g0")) == 1.0
    assert plain._corun_factor("c0", ("c0", "c1", "c2")) == 1.0


def test_the_simulator_slows_cpu_workers_side_by_side_and_the_fast_path_agrees():
    nodes = tuple(Node(f"n{i}", "Linear", {C: 0.01}, {C: 0.02}, param_bytes=1_000_000) for i in range(3))
    g = Graph("chain", nodes, tuple(Edge(f"n{i}", f"n{i + 1}", 0) for i in range(2)), batch_size=8, profiled_on=C)
    cluster = _cpu_cluster(CAL, ((1e6, 0.004),))
    alone = Plan((Stage(("n0", "n1", "n2"), ("c0",)),), 1, "gpipe", "t")
    # one worker: its 3 x 30 ms and the measured optimizer step, no slowdown
    assert simulate(g, cluster, alone).estimate.step_s == pytest.approx(0.09 + 0.012)
    three = Plan(tuple(Stage((f"n{i}",), (f"c{i}",)) for i in range(3)), 1, "gpipe", "t")
    est = simulate(g, cluster, three).estimate.step_s
    assert est == pytest.approx(1.5 * (0.09 + 0.004))  # stages one after another, each 1.5x slower
    scorer = ChainScorer(g, cluster)
    fast = scorer.score(np.array([[1, 2]]), np.array([[0, 1, 2]]), 1, "gpipe").step_s[0]
    assert fast == pytest.approx(est)
    assert scorer.score(np.array([[1, 2]]), np.array([[0, 3, 0]]), 1, "gpipe").feasible.shape == (1,)


@given(st.lists(st.floats(0.001, 0.05), min_size=2, max_size=5), st.integers(1, 6), st.sampled_from(["gpipe", "1f1b"]),
       st.floats(1.0, 2.0))
def test_fast_path_equals_the_event_simulator_on_calibrated_chains(times, m, schedule, slow):
    n = len(times)
    nodes = tuple(Node(f"n{i}", "Linear", {C: t}, {C: 2 * t}, param_bytes=500_000 * (i + 1))
                  for i, t in enumerate(times))
    g = Graph("chain", nodes, tuple(Edge(f"n{i}", f"n{i + 1}", 10_000) for i in range(n - 1)), batch_size=12,
              profiled_on=C)
    spec = {"devices": [{"id": f"c{i}", "type": "cpu", "threads": 1, "host": "h0", "binding": "cpu"} for i in range(n)]}
    cal = Calibration("test", (), ((2, slow), (n + 1, slow * 1.1)))
    cluster = replace(cluster_from_spec(spec, "cal"), calibration=cal)
    cluster = replace(cluster, devices=tuple(replace(d, optimizer_points=((1e6, 0.003), (4e6, 0.02)))
                                             for d in cluster.devices))
    plan = Plan(tuple(Stage((f"n{i}",), (f"c{i}",)) for i in range(n)), m, schedule, "t")
    assert fast_step_s(g, cluster, [plan])[0] == pytest.approx(simulate(g, cluster, plan).estimate.step_s)


def test_fit_overheads_is_the_line_of_the_excess_against_the_actions():
    def run(actions, excess_s):
        return {"measured_step_s": 0.1 + excess_s, "predicted_step_s": 0.1, "actions": actions}

    # 2.5 ms per action and 5 ms per step, exactly
    assert fit_overheads([run(6, 0.020), run(10, 0.030), run(18, 0.050)]) == pytest.approx((0.0025, 0.005))
    assert fit_overheads([run(6, 0.010), run(18, 0.040)]) == pytest.approx((0.0025, 0.0))
    # noise around the line: the median of the pairwise slopes
    assert fit_overheads([run(6, 0.021), run(10, 0.029), run(18, 0.050)])[0] == pytest.approx(0.0025, rel=0.1)
    # one run of five out of line (4x slower: something else ran) leaves the line where it was;
    # least squares put it at 13.5 ms per action
    line = [run(a, 0.0025 * a + 0.005) for a in (6, 8, 10, 14)]
    assert fit_overheads([*line, run(18, 4 * (0.0025 * 18 + 0.005))]) == pytest.approx((0.0025, 0.005))
    # a falling excess: nothing per action, the mean per step; never negative
    assert fit_overheads([run(6, 0.040), run(18, 0.020)]) == pytest.approx((0.0, 0.030))
    # a flat excess: a slope of zero up to the BLAS kernel's rounding, never below zero
    flat = fit_overheads([run(6, -0.01), run(18, -0.01)])
    assert flat == pytest.approx((0.0, 0.0), abs=1e-12) and min(flat) >= 0.0


def test_a_worker_this_machine_cannot_run_is_refused_before_any_probe(monkeypatch):
    """A worker of more threads than this process may use failed after 12 s (80 s here, under
    load) of probes, when the probe was profiled on its thread count."""
    from hetplan.machine import usable_cores
    from hetplan.runtime import calibrate as cal

    monkeypatch.setattr(cal, "calibrate_link", lambda *a, **k: pytest.fail("a probe ran"))
    too_many = usable_cores() + 1
    cluster = cluster_from_spec({"devices": [{"id": "a", "type": "cpu", "threads": 1, "binding": "cpu"},
                                             {"id": "b", "type": "cpu", "threads": too_many, "binding": "cpu"}]}, "c")
    with pytest.raises(HetplanError, match=f"worker b has {too_many} threads, but this process may use"):
        cal.calibrate_cluster(cluster)


def test_a_smaller_all_reduce_measured_slower_than_a_larger_one_takes_the_larger_ones_time():
    from hetplan.runtime.calibrate import monotone

    assert monotone([(4096.0, 3.9e-3), (1048576.0, 0.9e-3), (8388608.0, 6.9e-3)]) == (
        (4096.0, 0.9e-3), (1048576.0, 0.9e-3), (8388608.0, 6.9e-3))
    steady = ((4096.0, 0.3e-3), (65536.0, 0.4e-3), (1048576.0, 0.9e-3))
    assert monotone(steady) == steady


def test_the_calibration_summary_reads_the_curves_as_the_cost_model_does():
    """What `hetplan calibrate` prints: the measured all-reduce curve read at 32 MiB per group size,
    the optimizer's at 64 MB per device, both by `formulas.measured_s` (linear between points)."""
    from hetplan.cost import calibrated_figures

    report = {"allreduce": {2: {1e6: 0.001, 1e8: 0.1}}, "optimizer_points": {"c0": [(1e6, 0.002), (1e8, 0.2)]}}
    allreduce, optimizer = calibrated_figures(report, 5e7, 64e6)
    assert allreduce == {2: pytest.approx(0.05)} and optimizer == {"c0": pytest.approx(0.128)}
