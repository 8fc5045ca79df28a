"""The event-driven simulator: exact answers on small cases, invariants on random plans."""

import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetplan.cost import CostModel
from hetplan.cost.table import step_costs
from hetplan.errors import GraphError
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import cluster_from_spec, load_cluster
from hetplan.plan import Estimate, Plan, Stage, validate_plan
from hetplan.schedule import SCHEDULES, get_schedule, rank_orders, schedule_order, stage_ranks
from hetplan.sim import simulate
from hetplan.timeline import ALLREDUCE, OPTIMIZER
from strategies import MIXED as CLUSTER
from strategies import V, chain, graphs, one_per_stage

GiB = 2**30


def two_hosts(bandwidth="1GB/s", latency="0us", types=(V, V)):
    spec = {"devices": [{"id": "a", "type": types[0], "host": "x"}, {"id": "b", "type": types[1], "host": "y"}],
            "network": {"inter_host": {"bandwidth": bandwidth, "latency": latency}}}
    return cluster_from_spec(spec, "two")


@pytest.mark.parametrize("n,m", [(1, 1), (2, 4), (4, 8), (4, 1), (3, 2), (8, 16)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_equal_stages_without_communication(n, m, schedule):
    """(m + n - 1) x (t_fwd + t_bwd) per micro-batch: the textbook pipeline formula."""
    g = chain(n, fwd=0.03, bwd=0.05)
    est = simulate(g, load_cluster("v100x8"), one_per_stage(n, m, schedule)).estimate
    t_fwd, t_bwd = 0.03 / m, 0.05 / m
    assert est.step_s == pytest.approx((m + n - 1) * (t_fwd + t_bwd), rel=1e-12)
    assert est.bubble_fraction == pytest.approx((n - 1) / (m + n - 1))
    assert est.samples_per_s == pytest.approx(64 / est.step_s)
    assert est.feasible and est.method == "event" and est.link_bytes == {}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_peak_memory_follows_the_schedule(schedule, m):
    """Weights x4 (weights, gradients, Adam's two moments) plus the stashed activations of the
    micro-batches in flight: all m under GPipe, min(m, n - i) under 1F1B."""
    n = 4
    g = chain(n, params=1000, acts=800)
    plan = one_per_stage(n, m, schedule)
    est = simulate(g, load_cluster("v100x4"), plan).estimate
    cm = CostModel(g, load_cluster("v100x4"))
    for i in range(n):
        held = m if schedule == "gpipe" else min(m, n - i)
        assert est.peak_mem_bytes[f"v{i}"] == 4 * 1000 + 800 * held // m == cm.stage_memory_bytes(plan, i, f"v{i}")


def test_memory_violation_is_readable():
    g = chain(2, params=5 * GiB, acts=0)
    est = simulate(g, load_cluster("hetero-4"), one_per_stage(2, 1, ids=["a0", "t0"])).estimate
    assert not est.feasible
    assert est.violations == ("stage 1 on t0 (t4-16gb) needs 20.0 GiB, has 16.0 GiB",)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_a_slow_link_bounds_the_step(m):
    """Transfers of L seconds, compute much shorter: under GPipe the activations stream over the
    link back to back and the gradients likewise the other way, so the step is
    2 (t_fwd + t_bwd) + 2 m L; under any schedule it is at least the m L the link is busy."""
    g = chain(2, fwd=0.001, bwd=0.002, edge_bytes=8 * 10**9)
    cluster = two_hosts("1GB/s")
    big_l = 8.0 / m
    for schedule in ("gpipe", "1f1b"):
        est = simulate(g, cluster, one_per_stage(2, m, schedule, ids=["a", "b"])).estimate
        assert est.link_bytes == {"a->b": 8 * 10**9, "b->a": 8 * 10**9}
        assert est.link_busy_s["a->b"] == pytest.approx(m * big_l)
        assert est.step_s >= m * big_l
        if schedule == "gpipe":
            assert est.step_s == pytest.approx(2 * (0.001 + 0.002) / m + 2 * m * big_l)


def test_latency_is_paid_per_transfer():
    g = chain(2, fwd=0.0, bwd=0.0, edge_bytes=10**6)
    est = simulate(g, two_hosts("1GB/s", "1ms"), one_per_stage(2, 4, "gpipe", ids=["a", "b"])).estimate
    # four activations back to back, then four gradients back to back: 8 x (1 ms + 0.25 ms)
    assert est.step_s == pytest.approx(8 * (1e-3 + 0.25e-3))


def test_two_replicas_of_different_speeds_finish_together():
    g = chain(2, fwd=0.1, bwd=0.2, params=10**8)
    cluster = load_cluster("hetero-4")
    plan = Plan((Stage(("n0",), ("v0",)), Stage(("n1",), ("a0", "t0"))), 4, "1f1b", "test")
    sim = simulate(g, cluster, plan)
    est = sim.estimate
    cm = CostModel(g, cluster)
    # each replica's rows of every micro-batch of 16: in proportion to speed, in whole rows
    speed = {d: 1 / cm._device_stage_s(("n1",), d) for d in ("a0", "t0")}
    rows = {d: 16 * speed[d] / (speed["a0"] + speed["t0"]) for d in speed}
    whole = {d: round(r) for d, r in rows.items()}
    assert sum(whole.values()) == 16 and all(abs(whole[d] - rows[d]) < 0.5 for d in whole)
    for d in ("a0", "t0"):  # busy for its 4 x whole[d] of the 64 samples
        assert est.busy_s[d] == pytest.approx(cm._device_stage_s(("n1",), d) * 4 * whole[d] / 64)
    together = 1 / (1 / cm._device_stage_s(("n1",), "a0") + 1 / cm._device_stage_s(("n1",), "t0"))
    # they finish together but for the rounding of one row
    assert abs(est.busy_s["a0"] - together) <= max(cm._device_stage_s(("n1",), d) for d in speed) * 4 / 64
    last_b = {d: max(s.end_s for s in sim.timeline.spans if s.resource == d and s.kind == "B") for d in ("a0", "t0")}
    ar = [s for s in sim.timeline.spans if s.kind == ALLREDUCE]
    assert {s.resource for s in ar} == {"a0", "t0"}
    slowest = min(cluster.types[cluster.device(d).type].mem_bw_Bps for d in ("a0", "t0"))
    allreduce = cm._allreduce_s(10**8, ("a0", "t0")) + 2 * 10**8 / slowest  # and the copies to and from its buffer
    assert ar[0].end_s - ar[0].start_s == pytest.approx(allreduce)
    # then each replica's optimizer step: Adam reads and writes 7 x the weights' bytes
    opt = {d: 7 * 10**8 / cluster.types[cluster.device(d).type].mem_bw_Bps for d in ("a0", "t0", "v0")}
    assert {s.resource: s.end_s - s.start_s for s in sim.timeline.spans if s.kind == OPTIMIZER} == pytest.approx(opt)
    assert est.step_s == pytest.approx(max(max(last_b.values()) + allreduce + max(opt["a0"], opt["t0"]),
                                           max(s.end_s for s in sim.timeline.spans if s.resource == "v0")))


def test_one_replicated_stage_is_data_parallelism():
    g = chain(1, fwd=0.1, bwd=0.2, params=10**8)
    cluster = load_cluster("hetero-4")
    cm = CostModel(g, cluster)
    est = simulate(g, cluster, Plan((Stage(("n0",), ("a0", "t0")),), 1, "gpipe", "test")).estimate
    t = {d: cm._device_stage_s(("n0",), d) for d in ("a0", "t0")}
    a0_rows = round(64 * (1 / t["a0"]) / (1 / t["a0"] + 1 / t["t0"]))  # the batch of 64 split by speed
    busy = {"a0": t["a0"] * a0_rows / 64, "t0": t["t0"] * (64 - a0_rows) / 64}
    assert est.busy_s == pytest.approx(busy)
    opt = max(cm._optimizer_s(10**8, d) for d in ("a0", "t0"))
    pack = 2 * 10**8 / min(cluster.types[cluster.device(d).type].mem_bw_Bps for d in ("a0", "t0"))
    assert est.step_s == pytest.approx(max(busy.values()) + cm._allreduce_s(10**8, ("a0", "t0")) + pack + opt)


def diamond():
    """n0 feeds n1 and n2, which both feed n3."""
    t = {"n0": 0.01, "n1": 0.04, "n2": 0.03, "n3": 0.02}
    nodes = tuple(Node(k, "Linear", {V: v}, {V: 2 * v}) for k, v in t.items())
    edges = (Edge("n0", "n1", 0), Edge("n0", "n2", 0), Edge("n1", "n3", 0), Edge("n2", "n3", 0))
    return Graph("diamond", nodes, edges, batch_size=8, profiled_on=V), t


def test_branches_of_a_dag_of_stages_run_in_parallel():
    g, t = diamond()
    plan = Plan(tuple(Stage((k,), (f"v{i}",)) for i, k in enumerate(t)), 1, "1f1b", "test")
    cluster = load_cluster("v100x4")
    direct = simulate(g, cluster, plan, routing="direct")
    span = {(s.resource, s.kind): s for s in direct.timeline.spans}
    assert span[("v1", "F")].start_s == span[("v2", "F")].start_s == pytest.approx(0.01)
    # forward n0, then the longer branch, then n3; backward the same way back (twice the time)
    assert direct.estimate.step_s == pytest.approx(3 * (0.01 + 0.04 + 0.02))
    relay = simulate(g, cluster, plan, routing="relay")
    assert relay.estimate.step_s == pytest.approx(3 * sum(t.values()))


def test_relay_passes_skipping_tensors_through_the_stages_between():
    nodes = tuple(Node(f"n{i}", "Linear", {V: 0.0}, {V: 0.0}) for i in range(3))
    edges = (Edge("n0", "n1", 10**6), Edge("n1", "n2", 10**6), Edge("n0", "n2", 3 * 10**6))
    g = Graph("skip", nodes, edges, batch_size=4, profiled_on=V)
    plan = one_per_stage(3, 1)
    cluster = load_cluster("v100x4")
    assert simulate(g, cluster, plan, routing="direct").estimate.link_bytes == {
        "v0->v1": 10**6, "v1->v0": 10**6, "v0->v2": 3 * 10**6, "v2->v0": 3 * 10**6,
        "v1->v2": 10**6, "v2->v1": 10**6}
    assert simulate(g, cluster, plan, routing="relay").estimate.link_bytes == {
        "v0->v1": 4 * 10**6, "v1->v0": 4 * 10**6, "v1->v2": 4 * 10**6, "v2->v1": 4 * 10**6}


def test_price_per_step():
    g = chain(2)
    cluster = load_cluster("hetero-4")
    est = simulate(g, cluster, one_per_stage(2, 2, ids=["a0", "t0"])).estimate
    assert est.usd_per_step == pytest.approx((1.50 + 0.35) * est.step_s / 3600)


def test_each_device_runs_its_stage_in_the_torch_schedule_order():
    """The order of actions on a device is the schedule's order (held against torch's own in
    test_schedules.py), whatever the timing."""
    g = chain(4, fwd=0.01, bwd=0.03, edge_bytes=10**8)
    for schedule in ("gpipe", "1f1b"):
        plan = one_per_stage(4, 6, schedule, ids=["a0", "t0", "v0", "t1"])
        sim = simulate(g, load_cluster("hetero-4"), plan)
        orders = schedule_order(schedule, 4, 6)
        for r, d in enumerate(["a0", "t0", "v0", "t1"]):
            ran = [s for s in sorted(sim.timeline.spans, key=lambda s: s.start_s) if s.resource == d]
            assert [s.label for s in ran] == [str(a) for a in orders[r]]


# ---- invariants over random plans ---------------------------------------------------------------



@st.composite
def random_plans(draw, shared=False):
    """A random DAG, cut into convex stages (pieces of a topological order); each stage on one
    to three devices; with `shared`, devices may hold several stages. Under an interleaved
    schedule, n >= 2 groups of devices take the stages in turn."""
    graph = draw(graphs(min_nodes=1, max_nodes=9, types=("v100-16gb",)).filter(lambda g: g.batch_size >= 1))
    order = graph.topo_order
    shapes = {name: [(n, n * v) for n in range(2, min(len(order), 3) + 1) for v in range(1, len(order) // n + 1)
                     if any(not sched.problem(n * v, n, m) for m in range(1, 13))]
              for name, sched in SCHEDULES.items() if sched.interleaved}  # (ranks, stages) each can run
    schedule = draw(st.sampled_from([s for s in SCHEDULES if shapes.get(s, True)]))
    interleaved = SCHEDULES[schedule].interleaved
    ranks, k = draw(st.sampled_from(shapes[schedule])) if interleaved else (0, draw(st.integers(1, min(len(order), 4))))
    holder = stage_ranks(schedule, k, ranks) if interleaved else ()
    cuts = sorted(draw(st.sets(st.integers(1, len(order) - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
    bounds = [0, *cuts, len(order)]
    pool = list(draw(st.permutations(CLUSTER.ids)))
    stages = []
    for i in range(k):
        reps = draw(st.integers(1, 3 if shared else max(1, (len(pool) - (k - 1 - i)) // 2)))
        if interleaved and holder[i] < i:  # its rank's devices, taken by a stage before
            devices = stages[holder.index(holder[i])].devices
        elif interleaved:
            devices, pool = tuple(pool[:min(reps, 2)]), pool[min(reps, 2):]
        elif shared:
            devices = tuple(draw(st.lists(st.sampled_from(CLUSTER.ids), min_size=1, max_size=reps, unique=True)))
        else:
            devices, pool = tuple(pool[:reps]), pool[reps:]
        stages.append(Stage(order[bounds[i]:bounds[i + 1]], devices))
    m = draw(st.integers(1, min(graph.batch_size, 12)).filter(
        lambda m: not SCHEDULES[schedule].problem(k, ranks or k, m)))
    plan = Plan(tuple(stages), m, schedule, "random", shared_devices=shared)
    validate_plan(plan, graph, CLUSTER)
    return graph, plan, draw(st.sampled_from(["direct", "relay"]))


def check_timeline(graph, plan, routing):
    sim = simulate(graph, CLUSTER, plan, routing=routing)
    spans, est = sim.timeline.spans, sim.estimate
    model = step_costs(graph, CLUSTER, plan, routing)
    eps = 1e-9 * max(est.step_s, 1.0)
    kinds = get_schedule(plan.schedule).backward_kinds
    compute = _check_every_action_once(spans, model, plan.microbatches, kinds)
    _check_one_at_a_time(spans, eps)
    lower_bound = _check_dependencies(spans, compute, model, plan, eps, kinds[0])
    _check_critical_path(est, compute, lower_bound, model, plan.microbatches, eps, kinds)
    _check_memory(est, model)
    assert 0 <= est.bubble_fraction <= 1
    return sim


def _check_every_action_once(spans, model, m, kinds):
    """Every action of every stage replica runs exactly once; returns them by (stage, device,
    kind, micro-batch)."""
    compute = {(s.stage, s.resource, s.kind, s.microbatch): s for s in spans if s.resource in CLUSTER.by_id
               and s.kind not in (ALLREDUCE, OPTIMIZER)}
    expected = {(st_.index, r.device, kind, i) for st_ in model.stages for r in st_.replicas
                for kind in ("F", *kinds) for i in range(m)}
    assert set(compute) == expected
    assert len([s for s in spans if s.resource in CLUSTER.by_id and s.kind not in (ALLREDUCE, OPTIMIZER)]) == len(
        expected)
    return compute


def _check_one_at_a_time(spans, eps):
    """A device computes one action at a time; a link sends one tensor at a time, in FIFO order."""
    rows = defaultdict(list)
    for s in spans:
        if s.kind not in (ALLREDUCE, OPTIMIZER):
            rows[s.resource].append(s)
    for row in rows.values():
        row.sort(key=lambda s: (s.start_s, s.end_s))
        for a, b in zip(row, row[1:], strict=False):
            assert b.start_s >= a.end_s - eps


def _check_dependencies(spans, compute, model, plan, eps, grad_kind):
    """A stage's actions run in schedule order; inputs arrive before they are used (gradients:
    made by B, or by I where the backward is split). Returns each transfer's duration by
    (producer, consumer, kind, micro-batch)."""
    m = plan.microbatches
    orders = schedule_order(plan.schedule, len(plan.stages), m, plan.ranks)
    for st_ in model.stages:
        for r in st_.replicas:
            ran = [compute[(st_.index, r.device, a.kind, a.microbatch)] for a in orders[st_.index]]
            for a, b in zip(ran, ran[1:], strict=False):
                assert b.start_s >= a.end_s - eps
    transfers = {(s.resource, s.kind, s.stage, s.to_stage, s.microbatch): s for s in spans if "->" in s.resource}
    lower_bound = {}
    for msg in model.messages:
        for i in (i for i in range(m) if msg.bytes_mb[i] is not None):  # slices that share rows
            for kind, src, dst, s_from, s_to in (("F", msg.src, msg.dst, msg.src_stage, msg.dst_stage),
                                                 (grad_kind, msg.dst, msg.src, msg.dst_stage, msg.src_stage)):
                made, used = compute[(s_from, src, kind, i)], compute[(s_to, dst, kind, i)]
                if src == dst or msg.bytes_per_batch == 0:
                    assert used.start_s >= made.end_s - eps
                    continue
                x = transfers[(f"{src}->{dst}", "F" if kind == "F" else "B", s_from, s_to, i)]
                assert x.start_s >= made.end_s - eps and used.start_s >= x.end_s - eps
                lower_bound[(s_from, src, s_to, dst, kind, i)] = x.end_s - x.start_s
    return lower_bound


def _check_critical_path(est, compute, lower_bound, model, m, eps, kinds):
    """The step is never shorter than the busiest device nor than the critical path."""
    assert est.step_s >= max(est.busy_s.values()) - eps
    duration = {k: s.end_s - s.start_s for k, s in compute.items()}
    feeds = defaultdict(list)
    for (s_from, src, s_to, dst, kind, i), dt in lower_bound.items():
        feeds[(s_to, dst, kind, i)].append(((s_from, src, kind, i), dt))
    for msg in model.messages:
        if msg.src == msg.dst or msg.bytes_per_batch == 0:
            for i in (i for i in range(m) if msg.bytes_mb[i] is not None):
                feeds[(msg.dst_stage, msg.dst, "F", i)].append(((msg.src_stage, msg.src, "F", i), 0.0))
                feeds[(msg.src_stage, msg.src, kinds[0], i)].append(((msg.dst_stage, msg.dst, kinds[0], i), 0.0))
    memo = {}

    def finish(key):  # earliest end of an action given only data dependencies
        if key not in memo:
            start = max([finish(k) + dt for k, dt in feeds[key]], default=0.0)
            if key[2] != "F":  # B or I after its forward, W after its I
                before = "F" if key[2] == kinds[0] else kinds[0]
                start = max(start, finish((key[0], key[1], before, key[3])))
            memo[key] = start + duration[key]
        return memo[key]

    assert est.step_s >= max(finish(k) for k in compute) - eps


def _check_memory(est, model):
    """Weights of every stage a device holds plus at most all of its activations."""
    for d, peak in est.peak_mem_bytes.items():
        weights = sum(st_.weight_bytes for st_ in model.stages for r in st_.replicas if r.device == d)
        acts = sum(r.act_bytes for st_ in model.stages for r in st_.replicas if r.device == d)
        assert weights <= peak <= weights + math.ceil(acts) + 1


@settings(max_examples=60, deadline=None)
@given(random_plans())
def test_random_plans_respect_resources_and_dependencies(case):
    check_timeline(*case)


@settings(max_examples=40, deadline=None)
@given(random_plans(shared=True))
def test_random_plans_with_shared_devices(case):
    check_timeline(*case)


@settings(max_examples=30, deadline=None)
@given(random_plans())
def test_the_simulation_is_deterministic(case):
    graph, plan, routing = case
    a, b = simulate(graph, CLUSTER, plan, routing=routing), simulate(graph, CLUSTER, plan, routing=routing)
    assert a == b
    assert simulate(graph, CLUSTER, plan, routing=routing, timeline=False).estimate == a.estimate


def test_the_busiest_link_is_the_one_that_sends_longest():
    est = Estimate(1.0, 1.0, {}, {}, 0.0, {"x->y": 10, "y->z": 5}, 0.0, True, link_busy_s={"x->y": 0.1, "y->z": 0.4})
    assert est.peak_link == ("y->z", 5)
    assert Estimate(1.0, 1.0, {}, {}, 0.0, {}, 0.0, True).peak_link is None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fixed_costs_per_action(schedule):
    """A pass's fixed part is paid by every micro-batch: with n equal stages each action takes
    fixed + variable / m, and the pipeline formula holds for that action time. The fast path
    agrees."""
    from hetplan.sim.fast import fast_step_s

    n, m, fixed = 3, 4, 0.004
    nodes = tuple(Node(f"n{i}", "Linear", {V: 0.03}, {V: 0.05}, fwd_fixed_s={V: fixed}, bwd_fixed_s={V: fixed})
                  for i in range(n))
    g = Graph("fixed", nodes, tuple(Edge(f"n{i}", f"n{i + 1}", 0) for i in range(n - 1)), 64, V)
    plan = one_per_stage(n, m, schedule)
    est = simulate(g, load_cluster("v100x4"), plan).estimate
    action = 2 * fixed + (0.03 - fixed + 0.05 - fixed) / m
    assert est.step_s == pytest.approx((m + n - 1) * action, rel=1e-12)
    assert fast_step_s(g, load_cluster("v100x4"), [plan])[0] == pytest.approx(est.step_s, rel=1e-12)
    with pytest.raises(GraphError, match="more than the whole pass"):
        Node("x", "Linear", {V: 0.01}, {V: 0.01}, fwd_fixed_s={V: 0.02})


@pytest.mark.parametrize("n,v,m", [(2, 2, 4), (2, 3, 6), (4, 2, 8), (2, 2, 2), (4, 2, 4)])
def test_interleaved_1f1b_shrinks_the_bubble_v_times(n, v, m):
    """n devices, v equal stages each, no communication: (m v + n - 1) actions of a stage per
    step, against 1F1B's (m + n - 1) actions v times as long on the same devices (Narayanan et
    al. 2021: the bubble v times shorter)."""
    g = chain(n * v, fwd=0.03, bwd=0.05, batch=48)
    plan = Plan(tuple(Stage((f"n{s}",), (f"v{s % n}",)) for s in range(n * v)), m, "interleaved-1f1b", "test")
    validate_plan(plan, g, load_cluster("v100x8"))
    est = simulate(g, load_cluster("v100x8"), plan).estimate
    action = (0.03 + 0.05) / m
    assert est.step_s == pytest.approx((m * v + n - 1) * action, rel=1e-12)
    assert est.bubble_fraction == pytest.approx((n - 1) / (m * v + n - 1))
    chunks = Plan(tuple(Stage(tuple(f"n{s}" for s in range(k * v, (k + 1) * v)), (f"v{k}",)) for k in range(n)),
                  m, "1f1b", "test")
    assert simulate(g, load_cluster("v100x8"), chunks).estimate.step_s == pytest.approx((m + n - 1) * v * action)


def test_a_device_runs_its_ranks_one_list_under_interleaving():
    """Each device runs its rank's actions in torch's order (stages k, k + n, ... interleaved),
    whatever the timing; messages between two devices carry several stages' tensors."""
    g = chain(6, fwd=0.01, bwd=0.03, edge_bytes=10**8)
    ids = ["a0", "t0", "v0"]
    plan = Plan(tuple(Stage((f"n{s}",), (ids[s % 3],)) for s in range(6)), 6, "interleaved-1f1b", "test")
    sim = simulate(g, load_cluster("hetero-4"), plan)
    orders = rank_orders("interleaved-1f1b", 6, 6, 3)
    for r, d in enumerate(ids):
        ran = [s for s in sorted(sim.timeline.spans, key=lambda s: s.start_s) if s.resource == d
               and s.kind in "FB"]
        assert [s.label for s in ran] == [str(a) for a in orders[r]]


def test_the_cost_models_stage_memory_holds_what_the_interleaved_order_holds():
    """4 stages on 2 devices, 6 micro-batches: stage k holds 4, 3, 2, 1 micro-batches at its peak
    under the ranks' lists (read as 4 ranks of one stage: 6, 5, 3, 1), and each device's
    simulated peak is at most its two stages' peaks together."""
    g = chain(4, params=1000, acts=600, batch=48)
    plan = Plan(tuple(Stage((f"n{s}",), (f"v{s % 2}",)) for s in range(4)), 6, "interleaved-1f1b", "test")
    cm = CostModel(g, load_cluster("v100x8"))
    per_stage = [cm.stage_memory_bytes(plan, k, f"v{k % 2}") for k in range(4)]
    assert per_stage == pytest.approx([4 * 1000 + 600 * held / 6 for held in (4, 3, 2, 1)], abs=1)
    peak = simulate(g, load_cluster("v100x8"), plan).estimate.peak_mem_bytes
    assert peak["v0"] <= per_stage[0] + per_stage[2] and peak["v1"] <= per_stage[1] + per_stage[3]
