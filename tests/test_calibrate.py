"""The runtime's cost per action: parsed from cluster files and charged by the simulators."""

import pytest

from hetplan.cluster import cluster_from_spec
from hetplan.errors import HetplanError
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
