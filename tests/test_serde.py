import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetplan.errors import InputError
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.plan import Plan
from strategies import clusters, estimates, graphs, plans_for


def roundtrip(obj):
    text = serde.dumps(obj)
    back = serde.loads(text)
    assert back == obj
    assert type(back) is type(obj)
    # Writing it again gives the same text: nothing is lost or reordered.
    assert serde.dumps(back) == text
    return json.loads(text)


@given(graphs(types=("v100-16gb", "cpu-4t")))
def test_graphs_round_trip(g):
    data = roundtrip(g)
    assert data["kind"] == "graph" and data["schema_version"] == serde.SCHEMA_VERSION


@given(clusters())
def test_clusters_round_trip(c):
    assert roundtrip(c)["kind"] == "cluster"


@given(st.data())
def test_plans_round_trip(data):
    g = data.draw(graphs(max_nodes=8))
    c = data.draw(clusters())
    p = data.draw(plans_for(g, c))
    est = data.draw(st.none() | estimates)
    p = Plan(p.stages, p.microbatches, p.schedule, p.planner, predicted=est, meta=p.meta)
    assert roundtrip(p)["kind"] == "plan"


@given(estimates)
def test_estimates_round_trip(e):
    roundtrip(e)


def test_presets_round_trip():
    for name in ("hetero-4", "cloud-mix", "a100+v100-8"):
        roundtrip(load_cluster(name))


def test_save_and_load_file(tmp_path):
    c = load_cluster("hetero-4")
    path = tmp_path / "sub" / "c.json"
    serde.dump(c, path)
    assert serde.load(path, expect="cluster") == c
    assert not list(path.parent.glob(".*.tmp"))  # the temporary file was renamed away


def _graph_dict():
    return {"kind": "graph", "schema_version": 1, "name": "g", "batch_size": 2, "profiled_on": "x",
            "nodes": [{"id": "a", "op": "Linear", "fwd_s": {"x": 1.0}, "bwd_s": {"x": 1.0}},
                      {"id": "b", "op": "Linear", "fwd_s": {"x": 1.0}, "bwd_s": {"x": 1.0}}],
            "edges": [{"src": "a", "dst": "b", "bytes": 4}]}


def _load_err(data, match, expect=None):
    with pytest.raises(InputError, match=match) as err:
        serde.from_dict(data, source="g.json", expect=expect)
    assert str(err.value).startswith("g.json: ") and "\n" not in str(err.value)


def test_schema_errors_name_file_and_field():
    d = _graph_dict()
    assert serde.from_dict(d).nodes[1].id == "b"
    _load_err({**d, "schema_version": 2}, "written with schema_version 2, but this hetplan reads up to 1: upgrade")
    _load_err({k: v for k, v in d.items() if k != "schema_version"}, "schema_version is None")
    _load_err({**d, "kind": "banana"}, "kind is 'banana'")
    _load_err(d, "this is a graph file, but a plan is needed here", expect="plan")
    bad = _graph_dict()
    bad["nodes"][1]["fwd_s"]["x"] = "slow"
    _load_err(bad, r"g.json: nodes\[1\].fwd_s.x: Input should be a valid number")
    bad = _graph_dict()
    del bad["nodes"][0]["op"]
    _load_err(bad, r"nodes\[0\].op: Field required")
    bad = _graph_dict()
    bad["nodes"][1]["bwd_s"]["x"] = -2
    _load_err(bad, r"nodes\[1\]: node 'b': bwd_s\['x'\] is -2.0; it must be finite and >= 0")
    bad = _graph_dict()
    bad["edges"].append({"src": "b", "dst": "a"})
    _load_err(bad, "g.json: graph 'g' is not a DAG: it has the cycle")


def test_loads_rejects_broken_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{nope")
    with pytest.raises(InputError, match="x.json: not valid JSON"):
        serde.load(path)
    with pytest.raises(InputError, match="missing.json: no such file"):
        serde.load(tmp_path / "missing.json")
