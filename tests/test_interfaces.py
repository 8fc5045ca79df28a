"""The network's interfaces: every device sends and receives through one interface of
its own, traffic between hosts goes through the hosts' network interfaces, and transfers that
share an interface take turns. Closed forms on steps made of communication only (no compute,
no latency), so that every time is bytes over bandwidth."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.errors import ClusterError
from hetplan.io import serde
from hetplan.io.clusters import cluster_from_spec
from hetplan.plan import Plan, Stage
from hetplan.planners.randomized import random_plan
from hetplan.sim import simulate
from hetplan.sim.engine import FORWARD
from strategies import MIXED, chain, graphs

X = 1e9  # bytes per second of a link
B = 4e9  # bytes of the one tensor a batch sends across the cut: B / X = 4 s on one link


def cluster(hosts: dict[str, list[str]], nic: dict[str, str] | None = None, intra: str = "1GB/s"):
    devices = [{"id": d, "type": "v100-32gb", "host": h} for h, ids in hosts.items() for d in ids]
    network = {"intra_host": {"bandwidth": intra, "latency": "0us"},
               "inter_host": {"bandwidth": "1GB/s", "latency": "0us"}}
    if nic:
        network["host_nic"] = nic
    return cluster_from_spec({"devices": devices, "network": network}, "test")


def two_stages(first: tuple[str, ...], second: tuple[str, ...]) -> Plan:
    return Plan((Stage(("n0",), first), Stage(("n1",), second)), 1, "1f1b", "test")


GRAPH = chain(2, fwd=0.0, bwd=0.0, edge_bytes=int(B), batch=4)


def forward_ends(c, plan) -> list[float]:
    spans = simulate(GRAPH, c, plan).timeline.spans
    return sorted(s.end_s for s in spans if s.kind == FORWARD and "->" in s.resource)


def test_one_sender_feeding_two_replicas_takes_turns():
    """Each replica receives half the tensor; the sender's interface carries one half after the
    other, so the second replica has its half after 2 x (B/2)/X: twice one half's time, as long as
    one receiver of the whole tensor (the old model, a link per pair, gave B/2X to both)."""
    c = cluster({"h": ["s", "r0", "r1"]})
    assert forward_ends(c, two_stages(("s",), ("r0", "r1"))) == pytest.approx([B / 2 / X, B / X])
    assert forward_ends(c, two_stages(("s",), ("r0",))) == pytest.approx([B / X])


def test_two_senders_feeding_one_receiver_take_turns_on_its_interface():
    c = cluster({"h": ["s0", "s1", "r"]})
    assert forward_ends(c, two_stages(("s0", "s1"), ("r",))) == pytest.approx([B / 2 / X, B / X])


def test_two_replicas_feeding_two_replicas_use_two_lanes():
    """Rows line up (s0 -> r0, s1 -> r1): four interfaces, two transfers at once."""
    c = cluster({"h": ["s0", "s1", "r0", "r1"]})
    assert forward_ends(c, two_stages(("s0", "s1"), ("r0", "r1"))) == pytest.approx([B / 2 / X, B / 2 / X])


def test_two_hosts_devices_sending_at_once_share_the_host_link():
    """a0 -> b0 and a1 -> b1 at once: both go through host A's network interface (1 GB/s, as
    inter_host), so the second half arrives after B/X; the gradients go back through host B's
    sending side and A's receiving side, each way on its own: the step is 1.5 B/X. Interfaces
    twice as fast carry both at once: B/2X and a step of B/X."""
    hosts = {"A": ["a0", "a1"], "B": ["b0", "b1"]}
    plan = two_stages(("a0", "a1"), ("b0", "b1"))
    shared = cluster(hosts, intra="100GB/s")
    assert forward_ends(shared, plan) == pytest.approx([B / 2 / X, B / X])
    assert simulate(GRAPH, shared, plan).estimate.step_s == pytest.approx(1.5 * B / X)
    wide = cluster(hosts, nic={"A": "2GB/s", "B": "2GB/s"}, intra="100GB/s")
    assert forward_ends(wide, plan) == pytest.approx([B / 2 / X, B / 2 / X])
    assert simulate(GRAPH, wide, plan).estimate.step_s == pytest.approx(B / X)


def test_a_slow_host_interface_slows_every_transfer_through_it():
    c = cluster({"A": ["a0"], "B": ["b0"]}, nic={"A": "0.5GB/s"}, intra="100GB/s")
    assert c.link("a0", "b0").bandwidth_Bps == pytest.approx(0.5 * X)
    assert forward_ends(c, two_stages(("a0",), ("b0",))) == pytest.approx([2 * B / X])


def test_the_cost_model_counts_the_narrower_side_and_the_host_interfaces():
    from hetplan.cost import CostModel

    same = CostModel(GRAPH, cluster({"h": ["s0", "s1", "r0", "r1"]}))
    assert same._cut_Bps(["s0"], ["r0", "r1"]) == pytest.approx(X)  # one sender: one lane
    assert same._cut_Bps(["s0", "s1"], ["r0"]) == pytest.approx(X)
    assert same._cut_Bps(["s0", "s1"], ["r0", "r1"]) == pytest.approx(2 * X)
    hosts = {"A": ["a0", "a1"], "B": ["b0", "b1"]}
    across = CostModel(GRAPH, cluster(hosts, intra="100GB/s"))
    assert across._cut_Bps(["a0", "a1"], ["b0", "b1"]) == pytest.approx(X)  # one host interface each side
    wide = CostModel(GRAPH, cluster(hosts, nic={"A": "2GB/s", "B": "2GB/s"}, intra="100GB/s"))
    assert wide._cut_Bps(["a0", "a1"], ["b0", "b1"]) == pytest.approx(2 * X)
    # the steady state of the plan above: the cut moves B forward and B back at the cut's bandwidth
    plan = two_stages(("a0", "a1"), ("b0", "b1"))
    assert across.bottleneck_s(plan) == pytest.approx(2 * B / X)
    assert wide.bottleneck_s(plan) == pytest.approx(B / X)


def test_cluster_files_give_a_host_interface():
    c = cluster({"A": ["a0"], "B": ["b0"]}, nic={"B": "25Gbit/s"})
    assert c.nic_Bps("B") == pytest.approx(25e9 / 8)
    assert c.nic_Bps("A") == pytest.approx(X)  # inter_host's
    assert c.interfaces("a0", "b0") == (("send", "a0"), ("receive", "b0"), ("host sends", "A"),
                                        ("host receives", "B"))
    assert serde.loads(serde.dumps(c)) == c
    assert c.subset(["a0"]).host_nic_Bps == {}
    with pytest.raises(ClusterError, match="no device is on host 'C'"):
        cluster({"A": ["a0"]}, nic={"C": "1GB/s"})


def test_a_dedicated_link_skips_the_host_interfaces():
    c = cluster_from_spec({
        "devices": [{"id": "a0", "type": "v100-32gb", "host": "A"}, {"id": "b0", "type": "v100-32gb", "host": "B"}],
        "network": {"links": [{"between": ["a0", "b0"], "bandwidth": "50GB/s"}]}}, "t")
    assert c.interfaces("a0", "b0") == (("send", "a0"), ("receive", "b0"))


@settings(max_examples=80, deadline=None)
@given(graphs(min_nodes=2, max_nodes=8), st.integers(0, 10_000), st.sampled_from(["direct", "relay"]),
       st.sampled_from(["gpipe", "1f1b"]), st.booleans())
def test_random_plans_never_deadlock_on_interfaces(graph, seed, routing, schedule, share):
    """Receiving turns follow each device's action order: replicated stages, stages that share
    devices, tensors that skip stages, both schedules and both routings always finish, and every
    transfer fits its interfaces (no interface carries more than its bandwidth at any time)."""
    rng = np.random.default_rng(seed)
    plan = random_plan(graph, MIXED, rng, max_replicas=3)
    stages = plan.stages
    if share:  # fold the devices onto three, so that devices hold several stages
        fold = {d: MIXED.ids[k % 3] for k, d in enumerate(MIXED.ids)}
        stages = tuple(Stage(s.nodes, tuple(dict.fromkeys(fold[d] for d in s.devices))) for s in stages)
    plan = Plan(stages, plan.microbatches, schedule, "random", shared_devices=share)
    sim = simulate(graph, MIXED, plan, routing=routing)  # raises if the step deadlocks
    assert sim.estimate.step_s >= 0
    for port in {p for a, b in _pairs(sim.timeline) for p in MIXED.interfaces(a, b)}:
        _assert_within_bandwidth(sim.timeline, port)


def _pairs(timeline):
    return {tuple(s.resource.split("->")) for s in timeline.spans if "->" in s.resource}


def _assert_within_bandwidth(timeline, port):
    """At every start of a transfer through `port`, the rates of those running fit its bandwidth."""
    spans = [(s.start_s, s.end_s, MIXED.link(*s.resource.split("->")).bandwidth_Bps)
             for s in timeline.spans if "->" in s.resource and port in MIXED.interfaces(*s.resource.split("->"))]
    cap = MIXED.interface_Bps(port)
    for t0, _, _ in spans:
        running = [min(rate, cap) for a, b, rate in spans if a <= t0 < b and b > a]
        assert sum(running) <= cap * (1 + 1e-6), (port, t0, running)
