"""Fuzz the CLI with malformed graphs, clusters and plans.

Each example starts from a small valid file and breaks it in one way that is invalid by
construction: a required key dropped, a value of the wrong type, a negative, NaN or infinite
number, a reference to a node or device that does not exist, a cycle, an empty list, random
bytes, or the text cut short (the files are written on one line, so any cut leaves a bracket
open). The CLI must refuse each with exit status 2, exactly one line on stderr, no traceback,
and must leave its output files as they were.
"""

import copy
import json
import math
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetplan.cluster import MAX_DEVICES
from hetplan.io import serde
from hetplan.io.clusters import cluster_from_spec
from slowness import limit_s

NAN, INF = math.nan, math.inf
HUGE = 10**400  # more than a float holds
NOT_TEXT = [1.5, [], {}, None, True]
NOT_NUMBER = ["x", "4", "0.5", [], {}, None]  # a number written as text is not one
BAD_SECONDS = [-1, -1e-9, NAN, INF, -INF, HUGE, *NOT_NUMBER]
BAD_WHOLE = [0, -1, 1.5, NAN, True, *NOT_NUMBER]
BAD_BYTES = [-1, 1.5, NAN, INF, HUGE, *NOT_NUMBER]


def _node(node_id):
    return {"id": node_id, "op": "Linear", "fwd_s": {"cpu-1t": 0.01}, "bwd_s": {"cpu-1t": 0.02}, "flops": 1e6,
            "param_bytes": 1024, "out_bytes": 4096, "act_bytes": 4096, "module": [f"layers.{node_id}"]}


GRAPH = {"kind": "graph", "schema_version": 1, "name": "tiny", "batch_size": 8, "profiled_on": "cpu-1t",
         "nodes": [_node("a"), _node("b"), _node("c")],
         "edges": [{"src": "a", "dst": "b", "bytes": 4096}, {"src": "b", "dst": "c", "bytes": 4096}],
         "meta": {"granularity": "layer"}}

CLUSTER = {"name": "lab", "types": {"big-cpu": {"base": "cpu", "threads": 4, "usd_per_hour": 0.1}},
           "devices": [{"id": "c", "type": "cpu", "threads": 1, "count": 2, "host": "h0", "binding": "cpu",
                        "memory": "8GiB"},
                       {"id": "b0", "type": "big-cpu", "host": "h1", "usd_per_hour": 0.2, "action_overhead": "1ms"}],
           "network": {"intra_host": {"bandwidth": "2GB/s", "latency": "50us"},
                       "inter_host": {"bandwidth": "10Gbit/s", "latency": "100us"},
                       "links": [{"between": ["c0", "b0"], "bandwidth": "1GB/s", "latency": "20us"}]}}

PLAN = {"kind": "plan", "schema_version": 1, "planner": "hand", "objective": "time", "graph": "tiny", "cluster": "lab",
        "stages": [{"nodes": ["a", "b"], "devices": ["c0"]}, {"nodes": ["c"], "devices": ["c1"]}],
        "microbatches": 2, "schedule": "1f1b", "shared_devices": False, "meta": {"seed": 0},
        "predicted": {"step_s": 0.1, "samples_per_s": 80.0, "busy_s": {"c0": 0.05}, "peak_mem_bytes": {"c0": 1000},
                      "bubble_fraction": 0.2, "link_bytes": {"c0->c1": 4096}, "usd_per_step": 1e-6,
                      "feasible": True, "violations": [], "method": "event", "link_busy_s": {}}}

# (path, values that make the file invalid there, whether dropping the key does too)
GRAPH_FIELDS = [
    (("kind",), ["plan", "banana", 1, None, []], True),
    (("schema_version",), [2, 0, -1, "1", 1.5, None, []], True),
    (("name",), NOT_TEXT, True),
    (("batch_size",), [*BAD_WHOLE, HUGE], True),
    (("profiled_on",), ["tpu-v9", *NOT_TEXT], True),
    (("nodes",), [[], "x", 1, {}, None], True),
    (("edges",), ["x", 1, {}, None], True),
    (("meta",), ["x", [], {"k": 1}, {"k": []}], False),
    *[p for i in range(3) for p in [
        (("nodes", i), ["x", 1, [], None], False),
        (("nodes", i, "id"), ["", "b" if i != 1 else "a", *NOT_TEXT], True),
        (("nodes", i, "op"), NOT_TEXT, True),
        (("nodes", i, "fwd_s"), [{}, {"cpu-2t": 0.1}, "x", 1, [], None], True),
        (("nodes", i, "bwd_s"), [{}, {"cpu-1t": 0.1, "cpu-2t": 0.1}, "x", 1, [], None], True),
        (("nodes", i, "fwd_s", "cpu-1t"), BAD_SECONDS, True),
        (("nodes", i, "bwd_s", "cpu-1t"), BAD_SECONDS, True),
        (("nodes", i, "fwd_fixed_s"), [{"cpu-1t": 1.0}, {"cpu-2t": 0.0}, {"cpu-1t": -1}, "x", []], False),
        (("nodes", i, "flops"), BAD_SECONDS, False),
        (("nodes", i, "param_bytes"), BAD_BYTES, False),
        (("nodes", i, "out_bytes"), BAD_BYTES, False),
        (("nodes", i, "act_bytes"), BAD_BYTES, False),
        (("nodes", i, "module"), ["x", [1], {}, 1], False),
        (("nodes", i, "is_input"), ["x", "true", "yes", [], {}, 2], False),
    ]],
    *[p for j in range(2) for p in [
        (("edges", j), ["x", 1, [], None], False),
        (("edges", j, "src"), ["ghost", *NOT_TEXT], True),
        (("edges", j, "dst"), ["ghost", *NOT_TEXT], True),
        (("edges", j, "bytes"), BAD_BYTES, False),
    ]],
]

GRAPH_BREAKS = [  # (name, change): structural mistakes
    ("edge to a missing node", lambda g: g["edges"].append({"src": "c", "dst": "ghost"})),
    ("cycle", lambda g: g["edges"].append({"src": "c", "dst": "a"})),
    ("self loop", lambda g: g["edges"].append({"src": "b", "dst": "b"})),
    ("duplicate edge", lambda g: g["edges"].append(dict(g["edges"][0]))),
    ("duplicate node", lambda g: g["nodes"].append(copy.deepcopy(g["nodes"][2]))),
    ("unknown field", lambda g: g.update(nodez=[])),
    ("unknown node field", lambda g: g["nodes"][1].update(fwd_time=1.0)),
    ("unknown edge field", lambda g: g["edges"][0].update(size=8)),
]

CLUSTER_FIELDS = [
    (("name",), [1.5, ["x"], {"a": 1}, True], False),  # an empty name takes the file's
    (("types",), ["x", 1, [1]], False),
    (("types", "big-cpu"), ["x", 1, [], None], False),
    (("types", "big-cpu", "base"), ["nosuch", 1, [], {}, None], False),
    (("types", "big-cpu", "threads"), [*BAD_WHOLE, 10**6], False),
    (("types", "big-cpu", "usd_per_hour"), [-1, NAN, INF, HUGE, *NOT_NUMBER, True], False),
    (("devices",), [[], "x", 1, {}, None], True),
    (("devices", 0), ["x", 1, [], None], False),
    (("devices", 0, "id"), NOT_TEXT, True),
    (("devices", 0, "type"), ["nosuch-gpu", "cpu-0t", f"cpu-{HUGE}t", 1, [], None], True),
    (("devices", 0, "threads"), [*BAD_WHOLE[:-1], [], 10**6], False),
    (("devices", 0, "count"), [0, -1, 1.5, "x", [], MAX_DEVICES + 1, 10**12], False),
    (("devices", 0, "host"), [[], {}, None, 1.5], False),
    (("devices", 0, "binding"), ["tpu", 3, [], {}], False),
    (("devices", 0, "memory"), ["-4GiB", "four", "5 parsecs", -1, 0, "0GiB", NAN, INF, HUGE, [], None,
                                "99999999999999999999999PiB", "2PiB", 2**51], False),
    (("devices", 1, "usd_per_hour"), [-1, NAN, INF, HUGE, *NOT_NUMBER, True], False),
    (("devices", 1, "action_overhead"), ["-1ms", "soon", -1, NAN, INF, HUGE, [], None], False),
    (("network",), ["x", 1, [1]], False),
    *[p for side in ("intra_host", "inter_host") for p in [
        (("network", side), ["x", 1, [], None], False),
        (("network", side, "bandwidth"), ["0GB/s", 0, -1, "fast", NAN, INF, HUGE, [], None], True),
        (("network", side, "latency"), ["-5us", "slow", -1, NAN, INF, HUGE, []], False),
    ]],
    (("network", "links"), ["x", 1, {"a": 1}], False),
    (("network", "links", 0), ["x", 1, [], None], False),
    (("network", "links", 0, "between"), [["c0"], ["c0", "c0"], ["c0", "ghost"], "c0", None, [["c0"], "b0"],
                                          ["c0", "b0", "c1"]], True),
    (("network", "links", 0, "bandwidth"), ["0GB/s", 0, -1, "fast", NAN, INF, HUGE, [], None], False),
    (("network", "links", 0, "latency"), ["-5us", -1, NAN, INF, []], False),
]

CLUSTER_BREAKS = [
    ("duplicate device", lambda c: c["devices"].append(dict(c["devices"][1]))),
    ("duplicate link", lambda c: c["network"]["links"].append({"between": ["b0", "c0"]})),
    ("threads on a gpu", lambda c: c["devices"].append({"id": "g", "type": "t4-16gb", "threads": 2})),
    ("more devices than allowed", lambda c: c["devices"][0].update(count=MAX_DEVICES)),
    ("unknown top-level key", lambda c: c.update(colour="red")),
    ("unknown device key", lambda c: c["devices"][1].update(colour="red")),
    ("unknown type key", lambda c: c["types"]["big-cpu"].update(colour="red")),
    ("unknown network key", lambda c: c["network"].update(colour="red")),
    ("unknown link key", lambda c: c["network"]["links"][0].update(colour="red")),
    ("a type of two definitions", lambda c: c["types"].update({"cpu-1t": {"base": "cpu", "threads": 2}})
     or c["devices"].append({"id": "x", "type": "cpu-1t"})),
]

# the same cluster as `hetplan calibrate` or `serde.dump` saves it, with a kind and exact numbers
SAVED = serde.to_dict(cluster_from_spec(CLUSTER, "lab.yaml"))
BAD_POSITIVE = [0, -1, NAN, HUGE, *NOT_NUMBER]
SAVED_FIELDS = [
    (("kind",), ["graph", "banana", 1, None, []], True),
    (("schema_version",), [2, 0, -1, "1", 1.5, None, []], True),
    (("name",), NOT_TEXT, True),
    (("devices",), [[], "x", 1, {}, None], True),
    (("types",), ["x", 1, [], None, {}], True),
    *[p for i in range(3) for p in [
        (("devices", i), ["x", 1, [], None], False),
        (("devices", i, "id"), ["", *NOT_TEXT], True),
        (("devices", i, "type"), ["nosuch", *NOT_TEXT], True),
        (("devices", i, "host"), ["", *NOT_TEXT], True),
        (("devices", i, "mem_bytes"), [*BAD_POSITIVE, 1.5, INF], True),
        (("devices", i, "usd_per_hour"), [-1, NAN, INF, HUGE, *NOT_NUMBER], True),
        (("devices", i, "threads"), [0, -1, 1.5, 10**6, "x", []], False),
        (("devices", i, "binding"), ["tpu", 3, [], {}], False),
        (("devices", i, "action_overhead_s"), [-1, NAN, INF, HUGE, *NOT_NUMBER], False),
    ]],
    *[p for t in ("cpu-1t", "big-cpu") for p in [
        (("types", t), ["x", 1, [], None], True),
        (("types", t, "name"), ["other", *NOT_TEXT], True),
        (("types", t, "kind"), ["tpu", *NOT_TEXT], True),
        *[(("types", t, f), [*BAD_POSITIVE, INF], True) for f in ("peak_flops", "peak_flops_fp16", "mem_bw_Bps")],
        (("types", t, "mem_bytes"), [*BAD_POSITIVE, 1.5, INF], True),
        (("types", t, "usd_per_hour"), [-1, NAN, INF, HUGE, *NOT_NUMBER], True),
        (("types", t, "threads"), [0, -1, 1.5, "x", []], False),
    ]],
    *[p for side in ("intra_host", "inter_host") for p in [
        ((side,), ["x", 1, [], None], True),
        ((side, "bandwidth_Bps"), [0, -1, NAN, HUGE, *NOT_NUMBER], True),
        ((side, "latency_s"), [-1, NAN, INF, HUGE, *NOT_NUMBER], True),
    ]],
    (("links",), ["x", 1, {}, None], False),
    (("links", 0), ["x", 1, [], None], False),
    (("links", 0, "between"), [["c0"], ["c0", "c0"], ["c0", "ghost"], "c0", None, ["c0", "b0", "c1"]], True),
    (("links", 0, "bandwidth_Bps"), [0, -1, NAN, HUGE, *NOT_NUMBER], True),
    (("links", 0, "latency_s"), [-1, NAN, INF, HUGE, *NOT_NUMBER], True),
]
SAVED_BREAKS = [
    ("duplicate device", lambda c: c["devices"].append(dict(c["devices"][2]))),
    ("duplicate link", lambda c: c["links"].append({**c["links"][0], "between": ["b0", "c0"]})),
    ("more devices than allowed", lambda c: c["devices"].extend(
        {**c["devices"][0], "id": f"x{k}"} for k in range(MAX_DEVICES))),
    ("unknown field", lambda c: c.update(hosts=[])),
    ("unknown device field", lambda c: c["devices"][0].update(gpus=8)),
    ("a pebibyte and more", lambda c: c["devices"][0].update(mem_bytes=2**51)),
]

ESTIMATE_NUMBERS = ("step_s", "samples_per_s", "bubble_fraction", "usd_per_step")
PLAN_FIELDS = [
    (("kind",), ["graph", "banana", 1, None, []], True),
    (("schema_version",), [2, 0, -1, "1", 1.5, None, []], True),
    (("stages",), [[], "x", 1, {}, None], True),
    (("microbatches",), [*BAD_WHOLE, 9, HUGE], True),  # the graph's batch is 8
    (("schedule",), ["nosuch", *NOT_TEXT], True),
    (("planner",), NOT_TEXT, True),
    (("objective",), ["nosuch", *NOT_TEXT], False),
    (("graph",), NOT_TEXT, False),
    (("cluster",), NOT_TEXT, False),
    (("shared_devices",), ["x", "true", [], {}, 2], False),
    (("predicted",), ["x", 1, []], False),
    (("meta",), ["x", 1, []], False),
    *[(("predicted", name), BAD_SECONDS, True) for name in ESTIMATE_NUMBERS],
    (("predicted", "busy_s"), [{"c0": "x"}, "x", [], None], True),
    (("predicted", "feasible"), ["x", [], None], True),
    *[p for i in range(2) for p in [
        (("stages", i), ["x", 1, [], None], False),
        (("stages", i, "nodes"), [[], "a", [1], None, ["ghost"], [[]]], True),
        (("stages", i, "devices"), [[], "c0", [1], None, ["ghost"], ["c0", "c0"]], True),
        (("stages", i, "recompute"), ["yes", "true", 1, 2.0, [], None], False),
    ]],
]

PLAN_BREAKS = [
    ("node in two stages", lambda p: p["stages"][1]["nodes"].append("a")),
    ("a node in no stage", lambda p: p["stages"][0]["nodes"].remove("b")),
    ("stage dropped", lambda p: p["stages"].pop()),
    ("stages backwards", lambda p: p["stages"].reverse()),
    ("stage not convex", lambda p: p.update(stages=[{"nodes": ["a", "c"], "devices": ["c0"]},
                                                    {"nodes": ["b"], "devices": ["c1"]}])),
    ("device in two stages", lambda p: p["stages"][1].update(devices=["c0"])),
    ("missing device", lambda p: p["stages"][1]["devices"].append("z9")),
    ("unknown field", lambda p: p.update(micro_batches=4)),
    ("unknown stage field", lambda p: p["stages"][0].update(colour="red")),
    ("unknown estimate field", lambda p: p["predicted"].update(step_ms=1.0)),
]


def _get(data, path):
    for key in path:
        data = data[key]
    return data


def _set(data, path, value):
    _get(data, path[:-1])[path[-1]] = value


def _drop(data, path):
    del _get(data, path[:-1])[path[-1]]


def one_line_json(data):
    return json.dumps(data)  # NaN and Infinity as JavaScript writes them


def one_line_yaml(data):
    return yaml.safe_dump(data, default_flow_style=True, width=10**9)


def _alias_bomb(levels=9):
    """A cluster whose name is 9**9 items once its YAML aliases are followed, in 300 bytes."""
    lists = ["&l0 [x, x, x, x, x, x, x, x, x]"] + [f"&l{k} [{', '.join([f'*l{k - 1}'] * 9)}]" for k in range(1, levels)]
    return f"name: [{', '.join(lists)}]\ndevices: [{{id: c, type: cpu}}]\n".encode()


# Files that do not parse, or parse into something hetplan cannot walk.
NASTY = [b"", b"\n", b"null", b"[]", b"42", b"'text'", b"[" * 100_000, b"{" * 100_000, b"- " * 5000 + b"x",
         b'{"a": ' * 5000 + b"1" + b"}" * 5000, b"9" * 5000,
         b'{"kind": "graph", "schema_version": 1' + b"0" * 5000 + b"}",
         b"\xff\xfe\x00\x01", b"\x00" * 64, "é".encode("latin-1"), bytes(range(256)),
         b"a: &a [*a]", b"&a {devices: [*a]}", b"\t", b"devices: []\ndevices: [{id: c, type: cpu}]\n",
         b"? [1, 2]\n: 3\n", _alias_bomb()]


@st.composite
def malformed(draw, base, fields, breaks, dumps):
    """How the file was broken, and its bytes, made from `base`."""
    how = draw(st.sampled_from(["field", "field", "field", "break", "bytes", "nasty", "cut"]))
    if how == "bytes":
        return how, draw(st.binary(max_size=300))
    if how == "nasty":
        return how, draw(st.sampled_from(NASTY))
    data = copy.deepcopy(base)
    if how == "field":
        path, bad, droppable = draw(st.sampled_from(fields))
        choices = [*bad, "drop"] if droppable else bad
        value = draw(st.sampled_from(choices))
        _drop(data, path) if value == "drop" else _set(data, path, copy.deepcopy(value))
    elif how == "break":
        draw(st.sampled_from(breaks))[1](data)
    text = dumps(data).strip()
    if how == "cut":
        text = text[:draw(st.integers(0, len(text) - 1))]
    return how, text.encode()


@pytest.fixture
def workdir(tmp_path):
    """Valid inputs, and an output folder filled with files the commands would write."""
    (tmp_path / "g.json").write_text(json.dumps(GRAPH))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CLUSTER))
    (tmp_path / "p.json").write_text(json.dumps(PLAN))
    out = tmp_path / "out"
    out.mkdir()
    for name in ("plan.json", "trace.json", "step.png"):
        (out / name).write_text(f"known {name}\n")
    return tmp_path


def _commands(w: Path, kind: str, bad: Path) -> list[tuple]:
    out = w / "out"
    graph, cluster, plan = (bad if kind == k else w / f for k, f in
                            (("graph", "g.json"), ("cluster", "c.yaml"), ("plan", "p.json")))
    if kind == "plan":
        return [("simulate", plan, "--graph", graph, "--cluster", cluster, "--trace", out / "trace.json",
                 "--gantt", out / "step.png")]
    return [("plan", graph, "--cluster", cluster, "--planner", "single", "-o", out / "plan.json"), ("info", bad)]


def _outputs(w: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted((w / "out").iterdir())}


def _refused(cli, w: Path, kind: str, suffix: str, broken: tuple[str, bytes]) -> None:
    how, content = broken
    bad = w / f"bad-{kind}{suffix}"
    bad.write_bytes(content)
    before = _outputs(w)
    # A plan is checked against the graph and the cluster together, and that message names no file.
    named = kind != "plan" or how in ("bytes", "nasty", "cut")
    for args in _commands(w, kind, bad):
        r = cli(*args)
        lines = r.err.splitlines()
        assert r.code == 2, (args[0], content[:300], r.code, r.err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), r.err[-2000:]
        assert str(bad) in lines[0] or not named, lines[0]
        assert "Traceback" not in r.err and r.out == ""
        assert _outputs(w) == before


FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.mark.parametrize("content", NASTY, ids=lambda c: repr(c[:12]))
def test_files_that_do_not_parse_are_one_line(cli, workdir, content):
    """Each kind of file, and a cluster as YAML and as JSON."""
    start = time.perf_counter()
    for kind, suffix in (("graph", ".json"), ("cluster", ".yaml"), ("cluster", ".json"), ("plan", ".json")):
        _refused(cli, workdir, kind, suffix, ("nasty", content))
    assert time.perf_counter() - start < limit_s(5)


def test_the_unbroken_files_are_valid(cli, workdir):
    """The fuzz tests below break these files; whole, every command takes them."""
    for kind, suffix, base in (("graph", ".json", GRAPH), ("cluster", ".yaml", CLUSTER), ("cluster", ".json", CLUSTER),
                               ("cluster", ".saved.json", SAVED), ("plan", ".json", PLAN)):
        bad = workdir / f"whole-{kind}{suffix}"
        bad.write_text((one_line_yaml if suffix == ".yaml" else one_line_json)(base))
        for args in _commands(workdir, kind, bad):
            r = cli(*args)
            assert r.code == 0, (args, r.err)


@FUZZ
@given(broken=malformed(GRAPH, GRAPH_FIELDS, GRAPH_BREAKS, one_line_json))
def test_malformed_graphs_are_refused_in_one_line(cli, workdir, broken):
    _refused(cli, workdir, "graph", ".json", broken)


CLUSTER_FORMS = {  # suffix: the bad file's strategy
    ".yaml": malformed(CLUSTER, CLUSTER_FIELDS, CLUSTER_BREAKS, one_line_yaml),
    ".json": malformed(CLUSTER, CLUSTER_FIELDS, CLUSTER_BREAKS, one_line_json),
    ".saved.json": malformed(SAVED, SAVED_FIELDS, SAVED_BREAKS, one_line_json),
}


@FUZZ
@given(data=st.data())
def test_malformed_clusters_are_refused_in_one_line(cli, workdir, data):
    """Cluster descriptions in YAML and in JSON, and saved clusters (`kind: cluster`)."""
    suffix = data.draw(st.sampled_from(list(CLUSTER_FORMS)))
    _refused(cli, workdir, "cluster", suffix, data.draw(CLUSTER_FORMS[suffix]))


@FUZZ
@given(broken=malformed(PLAN, PLAN_FIELDS, PLAN_BREAKS, one_line_json))
def test_malformed_plans_are_refused_in_one_line(cli, workdir, broken):
    _refused(cli, workdir, "plan", ".json", broken)


BROKEN_FACTORIES = [  # tests/user_models.py
    ("broken", []), ("sizeless", ["--batch-size", "4"]), ("returns_none", []), ("returns_the_model_alone", []),
    ("batch_not_a_dict", []), ("batch_of_the_wrong_shape", []), ("batch_without_a_batch_dimension", []),
    ("not_a_module", []), ("exits", []), ("raises_keyboard_interrupt_like", []), ("not_callable", []),
    ("no_such_factory", []),
]


@pytest.mark.parametrize("factory,flags", BROKEN_FACTORIES, ids=[f for f, _ in BROKEN_FACTORIES])
def test_broken_factories_are_one_line(cli, workdir, monkeypatch, factory, flags):
    """A user's factory that raises, exits, returns the wrong things or a batch the model cannot
    take: `profile` and `run` (which loads the model to check it before starting workers) each
    say so in one line and write nothing."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    plan = workdir / "one.json"
    plan.write_text(json.dumps({**PLAN, "stages": [{"nodes": ["a", "b", "c"], "devices": ["c0"]}]}))
    before = _outputs(workdir)
    ref = f"user_models:{factory}"
    for args in (("profile", ref, *flags, "-o", workdir / "out" / "g.json"),
                 ("run", plan, "--model", ref, "--cluster", workdir / "c.yaml", "--batch-size", "4", "--dry-run",
                  "--out", workdir / "out" / "run")):
        r = cli(*args)
        lines = r.err.splitlines()
        assert r.code == 2 and len(lines) == 1 and lines[0].startswith("hetplan: error: "), (args[0], r.err[-2000:])
        assert "Traceback" not in r.err and _outputs(workdir) == before


def _full_disk(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


UNWRITABLE = {
    "under a file": lambda w: w / "g.json" / "sub",
    "a read-only file system": lambda w: Path("/proc/hetplan-cannot-write"),
    "a full disk": lambda w: w / "out",
}


@pytest.mark.parametrize("where", list(UNWRITABLE))
def test_outputs_that_cannot_be_written_are_one_line(cli, workdir, monkeypatch, where):
    """Every command that writes, into a folder that cannot take a file: exit 2, one line that
    names the path, nothing half-written left (the full disk is a fake: every write and rename
    fails with ENOSPC once the command has read its inputs)."""
    folder = UNWRITABLE[where](workdir)
    g, c, p = workdir / "g.json", workdir / "c.yaml", workdir / "p.json"
    commands = [("plan", g, "--cluster", c, "--planner", "single", "-o", folder / "plan.json"),
                ("simulate", p, "--graph", g, "--cluster", c, "--trace", folder / "trace.json"),
                ("simulate", p, "--graph", g, "--cluster", c, "--gantt", folder / "step.png"),
                ("report", p, "--graph", g, "--cluster", c, "-o", folder / "p.html"),
                ("run", p, "--model", "mlp", "--cluster", c, "--dry-run", "--out", folder / "run")]
    before = _outputs(workdir)
    if where == "a full disk":
        monkeypatch.setattr("os.replace", _full_disk)
        monkeypatch.setattr("pathlib.Path.write_bytes", _full_disk)
    for args in commands:
        r = cli(*args)
        lines = r.err.splitlines()
        assert r.code == 2 and len(lines) == 1 and lines[0].startswith("hetplan: error: "), (args[0], r.err[-2000:])
        assert str(folder) in lines[0] and "Traceback" not in r.err, lines[0]
        assert _outputs(workdir) == before


def _bad_lines(w: Path, shared: Path = Path("profiles")) -> list[tuple]:
    """Command lines that are wrong in one way each, with what the one line must say."""
    g, c, p, run = w / "g.json", w / "c.yaml", w / "p.json", ("--out", w / "out" / "run")
    mlp_plan = w / "mlp.json"
    return [
        (("plan", g, "--cluster", c, "--planner", "nonsense"), "invalid choice: 'nonsense'"),
        (("run", p, "--model", "mlp", "--steps", "ten", *run), "invalid int value: 'ten'"),
        (("nosuch",), "invalid choice: 'nosuch'"),
        (("plan", g, "--cluster", c, "--global-batch", "1000000000000000"), "must be at most"),
        (("simulate", p, "--graph", g, "--cluster", c, "--global-batch", "0"), "--global-batch: 0 must be"),
        (("compare", g, "--cluster", c, "--planners", ""), "names no planner"),
        (("compare", g, "--cluster", c, "--planners", " , "), "names no planner"),
        (("profile", "mlp", "--batch-size", "1000000000000", "-o", w / "out" / "g.json"), "must be at most"),
        (("profile", "badsyntax:f", "-o", w / "out" / "g.json"), "is not valid Python: invalid syntax"),
        (("calibrate", "--cluster", "local", "--steps", "0", "-o", w / "out" / "cal.json"), "--steps 0"),
        (("calibrate", "--cluster", "local", "--steps", "-3", "-o", w / "out" / "cal.json"), "--steps -3"),
        (("calibrate", "--cluster", "local", "-o", "/proc/hetplan-nope/cal.json"), "cannot write cal.json there"),
        (("run", p, "--model", "mlp", "--cluster", c, *run), "is not a module of the model"),
        (("run", mlp_plan, "--model", "mlp", "--timeout-s", "0", *run), "--timeout-s 0.0: must be a number above 0"),
        (("run", mlp_plan, "--model", "mlp", "--timeout-s", "nan", *run), "--timeout-s nan"),
        (("run", mlp_plan, "--model", "mlp", "--lr", "nan", *run), "--lr nan"),
        (("run", mlp_plan, "--model", "mlp", "--lr", "-1", *run), "--lr -1.0"),
        (("run", mlp_plan, "--model", "mlp", "--backend", "nccl", *run), "--backend nccl: worker 0 runs on the CPU"),
        (("import", "pipedream", shared / "resnet18" / "graph.txt", "--device-type", "tpu-v9",
          "-o", w / "out" / "r.json"), "--device-type 'tpu-v9': not a device type"),
        (("import", "pipedream", w / "half" / "graph.txt", "--batch-size", "32", "-o", w / "out" / "r.json"),
         "the file looks cut short"),
    ]


@pytest.fixture(scope="module")
def made(tmp_path_factory, profiles):
    """What the bad command lines need, made once: an mlp graph and a plan for it, a factory that
    is not Python, a PipeDream profile cut short."""
    from hetplan.cli import main

    folder = tmp_path_factory.mktemp("made")
    (folder / "badsyntax.py").write_text("def f(:\n    pass\n")
    (folder / "half").mkdir()
    lines = (profiles / "resnet18" / "graph.txt").read_text().splitlines()
    (folder / "half" / "graph.txt").write_text("\n".join(lines[:110]) + "\n")
    assert main(["profile", "mlp", "-o", str(folder / "mlp-graph.json")]) == 0
    assert main(["plan", str(folder / "mlp-graph.json"), "--cluster", "local", "--planner", "single",
                 "-o", str(folder / "mlp.json")]) == 0
    return folder


@pytest.mark.parametrize("case", range(len(_bad_lines(Path("w")))))
def test_bad_command_lines_are_one_line_found_before_any_work(cli, workdir, monkeypatch, profiles, made, case):
    """Flags out of range, a factory that is not Python, a plan of another model, a PipeDream
    profile cut short: exit 2, one line that says what, nothing written, and found before any
    worker or probe starts (calibrate's probes take a minute; the check takes none)."""
    for name in ("badsyntax.py", "half", "mlp-graph.json", "mlp.json"):
        (workdir / name).symlink_to(made / name)
    monkeypatch.syspath_prepend(str(workdir))
    args, said = _bad_lines(workdir, profiles)[case]
    before = _outputs(workdir)
    start = time.perf_counter()
    r = cli(*args)
    lines = r.err.splitlines()
    assert r.code == 2 and len(lines) == 1 and lines[0].startswith("hetplan: error: "), (args, r.err[-2000:])
    assert said in lines[0] and "Traceback" not in r.err, lines[0]
    assert _outputs(workdir) == before and not (workdir / "out" / "run").exists()
    assert time.perf_counter() - start < limit_s(20)


def test_a_learning_curve_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """`plan --curve` writes a table and a picture; when the picture cannot be written (a full
    disk), the table it wrote first goes again and the error is hetplan's one line."""
    from hetplan.errors import HetplanError
    from hetplan.report.curve import write_curve

    plan = serde.from_dict({**PLAN, "planner": "ppo", "meta": {"ppo": {"curve": [[0, 4, 0.1, 2.0, None],
                                                                              [1, 8, 0.2, 1.5, 1.5]]}}})
    assert [Path(f).name for f in write_curve(plan, tmp_path / "ok")][:2] == ["ok.csv", "ok.png"]
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, path, **kw: _full_disk())
    with pytest.raises(HetplanError, match="cannot write the learning curve"):
        write_curve(plan, tmp_path / "sub")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("sub", ".sub"))]


def _with(base, path, value):
    data = copy.deepcopy(base)
    _set(data, path, value)
    return data


# Each mistake a user made that a file once passed through silently, named (the fuzzers above
# draw them among many; these run every time).
NAMED_FILES = [
    ("graph", ".json", _with(GRAPH, ("edges", 0, "bytes"), "4096")),
    ("graph", ".json", _with(GRAPH, ("nodes", 0, "fwd_s", "cpu-1t"), "0.01")),
    ("graph", ".json", {**GRAPH, "nodez": []}),
    ("graph", ".json", _with(GRAPH, ("nodes", 1, "fwd_time"), 1.0)),
    ("plan", ".json", _with(PLAN, ("microbatches",), "4")),
    ("plan", ".json", _with(PLAN, ("stages", 0, "recompute"), "yes")),
    ("plan", ".json", _with(PLAN, ("stages", 0, "recompute"), 1)),
    ("plan", ".json", _with(PLAN, ("stages", 0, "colour"), "red")),
    ("plan", ".json", {**PLAN, "micro_batches": 4}),
    ("cluster", ".yaml", _with(CLUSTER, ("devices", 0, "memory"), "99999999999999999999999PiB")),
    ("cluster", ".saved.json", _with(SAVED, ("devices", 0, "mem_bytes"), 2**51)),
    ("cluster", ".saved.json", _with(SAVED, ("devices", 0, "gpus"), 8)),
]


@pytest.mark.parametrize("case", range(len(NAMED_FILES)))
def test_named_mistakes_in_files_are_refused_in_one_line(cli, workdir, case):
    kind, suffix, data = NAMED_FILES[case]
    dumps = one_line_yaml if suffix == ".yaml" else one_line_json
    _refused(cli, workdir, kind, suffix, ("field", dumps(data).encode()))
