"""Hypothesis strategies for random graphs, clusters and plans, and small builders."""

from hypothesis import strategies as st

from hetplan import catalog
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import cluster_from_spec
from hetplan.plan import Estimate, Plan, Stage
from hetplan.schedule import ONE_STAGE_PER_RANK

OPS = ("Linear", "Conv2d", "ReLU", "Add", "GPT2Block", "LayerNorm")
TYPES = (*catalog.CATALOG, "cpu-1t", "cpu-4t")
times = st.one_of(st.just(0.0), st.floats(1e-6, 2.0))  # no denormals: a step of 1e-310 s overflows rates
sizes = st.integers(0, 2**34)


@st.composite
def graphs(draw, min_nodes=1, max_nodes=12, types=("v100-16gb",)):
    n = draw(st.integers(min_nodes, max_nodes))
    ids = [f"n{i}" for i in range(n)]
    pairs = draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))
    edges = sorted({(min(a, b), max(a, b)) for a, b in pairs if a != b})
    nodes = []
    for i in range(n):
        params = draw(sizes)
        nodes.append(Node(
            id=ids[i], op=draw(st.sampled_from(OPS)),
            fwd_s={t: draw(times) for t in types}, bwd_s={t: draw(times) for t in types},
            flops=draw(st.floats(0, 1e15)), param_bytes=params, out_bytes=draw(sizes),
            act_bytes=draw(sizes), module=tuple(draw(st.lists(st.sampled_from(["h.0", "h.1", "ln_f"]), max_size=2))),
            is_input=(i == 0 and draw(st.booleans())),
            runs_on_host=draw(st.booleans()),
            updated_bytes=draw(st.none() | st.integers(0, params)),  # a sparse table's looked-up rows
            opt_s={t: draw(times) for t in types} if draw(st.booleans()) else {},  # optimizer step, measured
        ))
    listed = draw(st.permutations(nodes))
    return Graph(
        name=draw(st.sampled_from(["g", "gpt2", "resnet50"])),
        nodes=tuple(listed),
        edges=tuple(Edge(ids[a], ids[b], draw(sizes)) for a, b in edges),
        batch_size=draw(st.integers(1, 512)),
        profiled_on=types[0],
    )


@st.composite
def cluster_specs(draw, min_devices=1, max_devices=6):
    k = draw(st.integers(min_devices, max_devices))
    devices = []
    for i in range(k):
        t = draw(st.sampled_from([*catalog.CATALOG, "cpu"]))
        d = {"id": f"d{i}", "type": t, "host": draw(st.sampled_from(["h0", "h1", "h2"]))}
        if t == "cpu":
            d["threads"] = draw(st.integers(1, 32))
        if draw(st.booleans()):
            d["memory"] = f"{draw(st.integers(1, 128))}GiB"
        if draw(st.booleans()):
            d["usd_per_hour"] = draw(st.floats(0, 10, allow_nan=False))
        devices.append(d)
    links = []
    if k >= 2:
        for _ in range(draw(st.integers(0, 2))):
            a, b = draw(st.lists(st.sampled_from([d["id"] for d in devices]), min_size=2, max_size=2, unique=True))
            if all({a, b} != set(x["between"]) for x in links):
                links.append({"between": [a, b], "bandwidth": f"{draw(st.integers(1, 400))}GB/s"})
    return {
        "name": "random",
        "devices": devices,
        "network": {
            "intra_host": {"bandwidth": f"{draw(st.integers(1, 600))}GB/s", "latency": f"{draw(st.integers(0, 20))}us"},
            "inter_host": {"bandwidth": f"{draw(st.integers(1, 400))}Gbit/s",
                           "latency": f"{draw(st.integers(0, 99))}us"},
            "links": links,
        },
    }


def clusters(**kw):
    return cluster_specs(**kw).map(lambda spec: cluster_from_spec(spec, "random.yaml"))


@st.composite
def plans_for(draw, graph, cluster):
    """A valid plan: consecutive pieces of the topological order, distinct devices."""
    order = graph.topo_order
    k = draw(st.integers(1, min(len(order), len(cluster.devices))))
    cuts = sorted(draw(st.sets(st.integers(1, len(order) - 1), min_size=k - 1, max_size=k - 1))) if k > 1 else []
    bounds = [0, *cuts, len(order)]
    devices = list(draw(st.permutations(cluster.ids)))
    stages = []
    for i in range(k):
        reps = 1 if i < k - 1 else draw(st.integers(1, len(devices) - k + 1))
        stages.append(Stage(order[bounds[i]:bounds[i + 1]], tuple(devices[i:i + reps]) if i < k - 1
                            else tuple(devices[k - 1:k - 1 + reps])))
    return Plan(tuple(stages), draw(st.integers(1, graph.batch_size)), draw(st.sampled_from(ONE_PER_RANK)),
                "random", meta={"seed": draw(st.integers(0, 9))})


estimates = st.builds(
    Estimate,
    step_s=times, samples_per_s=times, busy_s=st.dictionaries(st.text(min_size=1, max_size=4), times, max_size=3),
    peak_mem_bytes=st.dictionaries(st.text(min_size=1, max_size=4), sizes, max_size=3),
    bubble_fraction=st.floats(0, 1), link_bytes=st.dictionaries(st.just("a->b"), sizes, max_size=1),
    usd_per_step=times, feasible=st.booleans(), violations=st.lists(st.text(max_size=20), max_size=2).map(tuple),
)


V = "v100-16gb"
ONE_PER_RANK = list(ONE_STAGE_PER_RANK)  # the others need plans whose stages take turns on groups of devices


def chain(n, fwd=0.03, bwd=0.05, edge_bytes=0, params=0, acts=0, batch=64):
    """A chain of n equal nodes profiled on a V100."""
    nodes = tuple(Node(f"n{i}", "Linear", {V: fwd}, {V: bwd}, param_bytes=params, act_bytes=acts) for i in range(n))
    edges = tuple(Edge(f"n{i}", f"n{i + 1}", edge_bytes) for i in range(n - 1))
    return Graph("chain", nodes, edges, batch_size=batch, profiled_on=V)


def one_per_stage(n, m, schedule="1f1b", ids=None):
    """Node i of a chain on device ids[i] (default v0, v1, ...)."""
    ids = ids or [f"v{i}" for i in range(n)]
    return Plan(tuple(Stage((f"n{i}",), (ids[i],)) for i in range(n)), m, schedule, "test")


# six devices of four types on three hosts, for random plans
MIXED = cluster_from_spec({
    "devices": [{"id": "a0", "type": "a100-40gb", "host": "h0"}, {"id": "a1", "type": "a100-40gb", "host": "h0"},
                {"id": "v0", "type": "v100-32gb", "host": "h0"}, {"id": "t0", "type": "t4-16gb", "host": "h1"},
                {"id": "t1", "type": "t4-16gb", "host": "h1"}, {"id": "c0", "type": "cpu", "threads": 8, "host": "h2"}],
    "network": {"intra_host": {"bandwidth": "50GB/s", "latency": "5us"},
                "inter_host": {"bandwidth": "10Gbit/s", "latency": "30us"}},
}, "mixed")


def one_stream_per_host_interface(cluster, devices) -> bool:
    """Whether, in a chain on these devices, every host's network interface carries the tensors
    of one pair of devices at most (then every interface's order is fixed)."""
    seen: dict = {}
    for a, b in zip(devices, devices[1:], strict=False):
        for src, dst in ((a, b), (b, a)):
            for port in cluster.interfaces(src, dst)[2:]:
                seen.setdefault(port, set()).add((src, dst))
    return all(len(pairs) <= 1 for pairs in seen.values())


def exact_step_dp_matches(graph, cluster, options, describe, check=lambda plan: None) -> float:
    """Plan with exact and with dp: both find a plan or neither; dp's step (to 1e-9), micro-batches
    and `describe(plan)` are exact's; each plan fits and passes `check`. Returns exact's step
    (infinite when there is no plan)."""
    import pytest

    from hetplan.errors import InfeasibleError
    from hetplan.planners import make_plan

    found = {}
    for planner in ("exact", "dp"):
        try:
            plan = make_plan(graph, cluster, planner, options)
        except InfeasibleError:
            found[planner] = None
            continue
        assert plan.predicted.feasible
        check(plan)
        found[planner] = (plan.predicted.step_s, plan.microbatches, describe(plan))
    assert (found["dp"] is None) == (found["exact"] is None)
    if found["dp"] is None:
        return float("inf")
    assert found["dp"][0] == pytest.approx(found["exact"][0], rel=1e-9)
    assert found["dp"][1:] == found["exact"][1:]
    return found["exact"][0]
