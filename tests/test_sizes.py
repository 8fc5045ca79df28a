"""Clusters of many devices: loading is linear, and past `MAX_DEVICES` a
cluster is refused at once, in one line that names the file and the limit; files far bigger than
any hetplan file are refused before they are read."""

import json
import time
from pathlib import Path

import pytest

from hetplan.cluster import MAX_DEVICES
from hetplan.errors import ClusterError, HetplanError, InputError
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from slowness import limit_s


def _cpus(path, *counts):
    entries = ", ".join(f"{{id: c{i}_, type: cpu, threads: 1, binding: cpu, count: {n}}}" for i, n in enumerate(counts))
    path.write_text(f"devices: [{entries}]\n")
    return path


def _tiny_plan(tmp_path):
    graph = {"kind": "graph", "schema_version": 1, "name": "g", "batch_size": 8, "profiled_on": "cpu-1t",
             "nodes": [{"id": n, "op": "Linear", "fwd_s": {"cpu-1t": 0.01}, "bwd_s": {"cpu-1t": 0.02}} for n in "ab"],
             "edges": [{"src": "a", "dst": "b", "bytes": 1000}]}
    plan = {"kind": "plan", "schema_version": 1, "planner": "hand", "microbatches": 2, "schedule": "1f1b",
            "stages": [{"nodes": ["a"], "devices": ["c0_0"]}, {"nodes": ["b"], "devices": ["c0_1"]}]}
    (tmp_path / "g.json").write_text(json.dumps(graph))
    (tmp_path / "p.json").write_text(json.dumps(plan))
    return tmp_path / "p.json", tmp_path / "g.json"


def test_a_count_of_100000_is_refused_at_once_by_the_cli(cli, tmp_path):
    big = _cpus(tmp_path / "big.yaml", 100_000)
    plan, graph = _tiny_plan(tmp_path)
    for args in (("simulate", plan, "--graph", graph, "--cluster", big), ("info", big, "--json"),
                 ("plan", graph, "--cluster", big, "--planner", "single")):
        start = time.perf_counter()
        r = cli(*args)
        elapsed = time.perf_counter() - start
        lines = r.err.splitlines()
        assert r.code == 2 and len(lines) == 1 and r.out == "", r.err
        assert str(big) in lines[0] and f"more than the {MAX_DEVICES}" in lines[0] and "100000 devices" in lines[0]
        assert elapsed < limit_s(5), (args[0], elapsed)


def test_a_huge_count_is_refused_before_its_devices_are_made(tmp_path):
    """count: 10**12 once ran out of memory making the ids; the total is checked first."""
    start = time.perf_counter()
    with pytest.raises(ClusterError, match=r"devices\[0\]: 1000000000000 devices, more than the 1024"):
        load_cluster(_cpus(tmp_path / "huge.yaml", 10**12))
    assert time.perf_counter() - start < limit_s(1)


def test_a_cluster_at_the_limit_loads_and_one_more_device_is_refused(tmp_path):
    start = time.perf_counter()
    cluster = load_cluster(_cpus(tmp_path / "full.yaml", MAX_DEVICES - 24, 24))
    assert len(cluster.devices) == MAX_DEVICES and time.perf_counter() - start < limit_s(2)
    assert cluster.link("c0_0", "c1_23") == cluster.intra_host
    with pytest.raises(ClusterError, match=rf"over.yaml: devices\[1\]: {MAX_DEVICES + 1} devices, more than"):
        load_cluster(_cpus(tmp_path / "over.yaml", MAX_DEVICES - 24, 25))


def test_a_saved_cluster_over_the_limit_is_refused(tmp_path):
    """A saved cluster (`kind: cluster`) is checked too: the limit is in `Cluster` itself."""
    cluster = load_cluster(_cpus(tmp_path / "full.yaml", MAX_DEVICES))
    saved = serde.to_dict(cluster)
    saved["devices"].append({**saved["devices"][0], "id": "one-more"})
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    with pytest.raises(InputError, match=rf"saved.json: .*{MAX_DEVICES + 1} devices, more than the {MAX_DEVICES}"):
        load_cluster(path)


def test_messages_about_a_big_cluster_stay_short(tmp_path):
    """Errors that list the devices list the first few and the count, not a thousand ids."""
    cluster = load_cluster(_cpus(tmp_path / "full.yaml", MAX_DEVICES))
    with pytest.raises(HetplanError) as err:
        cluster.device("nope")
    assert f"({MAX_DEVICES} in all)" in str(err.value) and len(str(err.value)) < 200


def test_info_on_a_cluster_at_the_limit_is_quick(cli, tmp_path):
    """`info` listed the link of every pair of devices: n^2/2 rows, 36 s and 5.5 GB at 3,000."""
    big = _cpus(tmp_path / "big.yaml", MAX_DEVICES)
    start = time.perf_counter()
    r = cli("info", big, "--json")
    assert r.code == 0 and time.perf_counter() - start < limit_s(5)
    assert r.json()["links"] == [] and r.json()["links_listed"] == "the links set per pair"
    assert len(cli("info", "hetero-4", "--json").json()["links"]) == 6  # a small cluster: every pair


def test_a_cluster_file_far_bigger_than_any_cluster_is_refused_before_parsing(cli, tmp_path):
    """PyYAML reads ~0.2 MB/s, so a 50 MB YAML of 795,703 devices would take over 300 s to parse
    before the device limit could be checked: size alone refuses it first (here 5 MB of comments)."""
    big = tmp_path / "big.yaml"
    big.write_text(("#" * 99 + "\n") * 50_000 + "name: x\ndevices: [{id: c0, type: cpu, threads: 1}]\n")
    start = time.perf_counter()
    bad = cli("info", big)
    assert bad.code == 2 and "5.0 MB of YAML, more than a cluster of 1024 devices needs" in bad.err
    assert time.perf_counter() - start < limit_s(2)


def test_a_json_file_bigger_than_any_hetplan_file_is_refused_before_it_is_read(cli, tmp_path, monkeypatch):
    """A file is read whole into memory before it is parsed: its size is checked first (a sparse
    file of 300 MB here: nothing is written to disk)."""
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(300 << 20)
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("read before the size was checked"))
    bad = cli("info", big)
    assert bad.code == 2 and "300 MiB, more than any hetplan file holds" in bad.err
    assert serde.MAX_JSON_BYTES < 300 << 20
