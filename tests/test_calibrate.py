"""The runtime's cost per action: parsed from cluster files and charged by the simulators."""

import pytest

from hetplan.errors import HetplanError
from hetplan.io.clusters import cluster_from_spec
from hetplan.sim import simulate
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


def test_gloo_link_between_two_local_processes_is_measured():
    from hetplan.runtime.calibrate import LINK_SIZES_BYTES, calibrate_link

    bandwidth, latency, points = calibrate_link(repeats=3)
    assert 1e6 < bandwidth < 1e12 and 0 <= latency < 0.1
    assert sorted(points["allreduce_s_by_bytes"]) == sorted(LINK_SIZES_BYTES)
    # the line goes through the larger size's time (the fit's definition), whatever the noise
    big = max(LINK_SIZES_BYTES)
    small = min(LINK_SIZES_BYTES)
    t_small, t_big = points["allreduce_s_by_bytes"][small], points["allreduce_s_by_bytes"][big]
    if t_big > t_small and t_small > (t_big - t_small) / (big - small) * small:
        assert 2 * latency + big / bandwidth == pytest.approx(t_big, rel=1e-6)
