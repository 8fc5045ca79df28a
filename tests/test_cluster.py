import math

import pytest
import yaml
from hypothesis import given

from hetplan import catalog
from hetplan.errors import HetplanError, InputError
from hetplan.io.clusters import cluster_from_spec, load_cluster, local_spec, presets
from strategies import cluster_specs

GiB = 2**30

EXAMPLE = """
name: lab
devices:
  - {id: a0, type: a100-40gb, host: n0}
  - {id: v0, type: v100-16gb, host: n0}
  - {id: c0, type: cpu, host: n1, threads: 8, memory: 64GiB}
network:
  intra_host: {bandwidth: 150GB/s, latency: 5us}
  inter_host: {bandwidth: 10Gbit/s, latency: 50us}
  links: [{between: [a0, v0], bandwidth: 32GB/s}]
"""


def test_catalog_has_the_required_types():
    for name in ("h100-80gb", "a100-80gb", "a100-40gb", "v100-32gb", "v100-16gb", "t4-16gb",
                 "rtx3090-24gb", "l4-24gb"):
        t = catalog.CATALOG[name]
        assert t.kind == "gpu" and t.peak_flops > 0 and t.peak_flops_fp16 > t.peak_flops
        assert t.mem_bytes == int(name.split("-")[-1].removesuffix("gb")) * GiB
        assert t.mem_bw_Bps > 0 and t.usd_per_hour > 0
    assert catalog.CATALOG["h100-80gb"].peak_flops_fp16 > catalog.CATALOG["a100-80gb"].peak_flops_fp16
    assert catalog.CATALOG["t4-16gb"].usd_per_hour < catalog.CATALOG["a100-40gb"].usd_per_hour


def test_cpu_types_scale_with_threads():
    one, four = catalog.lookup("cpu", 1), catalog.lookup("cpu", 4)
    assert (one.name, four.name) == ("cpu-1t", "cpu-4t")
    assert four.peak_flops == 4 * one.peak_flops
    assert catalog.lookup("cpu-4t") == four


def test_the_issue_example_loads_with_its_units():
    c = cluster_from_spec(yaml.safe_load(EXAMPLE), "lab.yaml")
    assert c.name == "lab" and c.ids == ("a0", "v0", "c0")
    assert c.device("c0").type == "cpu-8t" and c.device("c0").mem_bytes == 64 * GiB
    assert c.device("c0").threads == 8
    assert c.device("a0").mem_bytes == 40 * GiB
    assert c.link("a0", "v0").bandwidth_Bps == 32e9           # the override
    assert c.link("v0", "a0").bandwidth_Bps == 32e9           # both directions
    assert c.link("a0", "v0").latency_s == 5e-6               # latency of the pair's default link
    assert c.link("v0", "c0").bandwidth_Bps == 1.25e9         # 10 Gbit/s between hosts
    assert c.link("v0", "c0").latency_s == 50e-6
    assert math.isinf(c.link("c0", "c0").bandwidth_Bps)
    assert set(c.types) == {"a100-40gb", "v100-16gb", "cpu-8t"}


def test_count_custom_types_and_price_overrides():
    spec = {
        "types": {"cheap-a100": {"base": "a100-40gb", "usd_per_hour": 0.9},
                  "npu": {"kind": "gpu", "peak_flops": "50TFLOP/s", "memory": "24GiB",
                          "memory_bandwidth": "1TB/s", "usd_per_hour": 1.2}},
        "devices": [{"id": "t", "type": "t4-16gb", "count": 3, "usd_per_hour": 0.2},
                    {"id": "x", "type": "cheap-a100"}, {"id": "n", "type": "npu"}],
    }
    c = cluster_from_spec(spec, "custom.yaml")
    assert c.ids == ("t0", "t1", "t2", "x", "n")
    assert c.device("t1").usd_per_hour == 0.2
    assert c.device_type("x").peak_flops == catalog.CATALOG["a100-40gb"].peak_flops
    assert c.device("x").usd_per_hour == 0.9
    assert c.device_type("n").peak_flops == 50e12 and c.device("n").mem_bytes == 24 * GiB
    assert c.name == "custom"
    # No network section: the documented defaults.
    assert c.link("t0", "t1").bandwidth_Bps == 12e9


def test_presets():
    names = presets()
    for required in ("v100x4", "v100x8", "hetero-4", "a100+v100-8", "cloud-mix", "cloud-ctr", "local"):
        assert required in names
    h = load_cluster("hetero-4")
    assert [h.device(d).type for d in h.ids] == ["a100-40gb", "v100-32gb", "t4-16gb", "t4-16gb"]
    assert len(h.hosts) == 2
    assert len(load_cluster("v100x4").devices) == 4 and len(load_cluster("v100x8").devices) == 8
    mixed = load_cluster("a100+v100-8")
    assert mixed.link("v0", "v1").bandwidth_Bps == 50e9 and mixed.link("a0", "a1").bandwidth_Bps == 200e9
    cloud = load_cluster("cloud-mix")
    assert {t.kind for t in cloud.types.values()} == {"cpu", "gpu"}
    assert all(d.usd_per_hour > 0 for d in cloud.devices)


def test_local_preset_is_this_machine():
    spec = local_spec(cpu_count=2)
    c = cluster_from_spec(spec, "local")
    assert c.ids == ("cpu0", "cpu1") and all(d.binding == "cpu" and d.threads == 1 for d in c.devices)
    assert len(load_cluster("local").devices) >= 1


def test_load_cluster_from_files(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(EXAMPLE)
    assert load_cluster(path).ids == ("a0", "v0", "c0")
    as_json = tmp_path / "lab.json"
    as_json.write_text(__import__("json").dumps(yaml.safe_load(EXAMPLE)))
    assert load_cluster(as_json) == load_cluster(path)


def _err(spec, match):
    with pytest.raises(HetplanError, match=match) as err:
        cluster_from_spec(spec, "lab.yaml")
    assert "\n" not in str(err.value)
    return str(err.value)


def test_unknown_device_type_lists_the_known_ones():
    msg = _err({"devices": [{"id": "a", "type": "a100"}]}, r"lab.yaml: devices\[0\].type: unknown device type 'a100'")
    assert "a100-40gb" in msg and "cpu" in msg


def test_bad_sizes_name_the_field():
    _err({"devices": [{"id": "a", "type": "cpu", "memory": "-4GiB"}]}, r"devices\[0\].memory: '-4GiB' is negative")
    _err({"devices": [{"id": "a", "type": "cpu", "memory": "four"}]}, r"devices\[0\].memory: cannot read 'four'")
    _err({"devices": [{"id": "a", "type": "cpu"}], "network": {"inter_host": {"bandwidth": "fast"}}},
         r"network.inter_host.bandwidth: cannot read 'fast'")


def test_other_bad_clusters():
    _err({"devices": [{"id": "a", "type": "cpu"}, {"id": "a", "type": "cpu"}]}, "duplicate device id 'a'")
    _err({"devices": [{"id": "a", "type": "t4-16gb", "threads": 4}]}, "only cpu devices take a thread count")
    _err({"devices": [{"id": "a", "type": "cpu", "colour": "red"}]}, r"unknown field 'colour' \(allowed: ")
    _err({"devices": []}, "non-empty list of devices")
    _err({"name": "x"}, "missing field 'devices'")
    _err({"devices": [{"id": "a", "type": "cpu"}],
          "network": {"links": [{"between": ["a", "b"], "bandwidth": "1GB/s"}]}},
         r"network.links\[0\].between: no device 'b'")
    _err({"devices": [{"id": "a", "type": "cpu", "usd_per_hour": -1}]}, "not a price")
    _err({"types": {"x": {"kind": "gpu"}}, "devices": [{"id": "a", "type": "x"}]}, "missing peak_flops, memory")


def test_unknown_preset_and_missing_file():
    with pytest.raises(HetplanError, match="neither a cluster file nor a preset .*hetero-4"):
        load_cluster("hetero-5")
    with pytest.raises(InputError, match="nowhere.yaml: no such file"):
        load_cluster("nowhere.yaml")


@given(cluster_specs())
def test_random_specs_give_valid_clusters(spec):
    c = cluster_from_spec(spec, "random.yaml")
    assert len(c.devices) == len(spec["devices"])
    for a in c.ids:
        for b in c.ids:
            assert c.link(a, b) == c.link(b, a)
            if a != b:
                same = c.device(a).host == c.device(b).host
                overridden = any({a, b} == set(x["between"]) for x in spec["network"]["links"])
                if not overridden:
                    assert c.link(a, b) == (c.intra_host if same else c.inter_host)


def test_saved_cluster_json_loads_as_a_cluster(tmp_path):
    from hetplan.io import serde

    c = load_cluster("a100+v100-8")
    serde.dump(c, tmp_path / "saved.json")
    assert load_cluster(tmp_path / "saved.json") == c


def test_every_gpu_type_of_the_catalog_is_found_by_a_name_its_driver_reports():
    """At the memory a driver reports (a little under the nominal), as "NVIDIA <model number>"."""
    gpus = [t for t in catalog.CATALOG.values() if t.kind == "gpu"]
    assert gpus and all(t.driver_names for t in gpus)
    for t in gpus:
        assert any(catalog.by_driver_name(f"NVIDIA {n.upper()}", int(t.mem_bytes * 0.97)) is t
                   for n in t.driver_names), t.name
    assert catalog.by_driver_name("NVIDIA H200", 16 * GiB) is catalog.CATALOG["h200-141gb"]  # a slice: one type
    assert catalog.by_driver_name("Mystery GPU 9000", 16 * GiB) is None


def test_a_cluster_saved_before_driver_names_loads(tmp_path):
    """Driver names are the catalog's: a saved cluster without them loads, and a description
    never needs them."""
    import json

    from hetplan.io import serde

    data = serde.to_dict(load_cluster("hetero-4"))
    assert data["types"]["a100-40gb"]["driver_names"] == ["a100"]
    for t in data["types"].values():
        del t["driver_names"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_cluster(tmp_path / "old.json")
    assert old.types["a100-40gb"].driver_names == ()
    assert old.types["a100-40gb"].mem_bytes == catalog.CATALOG["a100-40gb"].mem_bytes
    with pytest.raises(HetplanError, match="unknown field 'driver_names'"):
        cluster_from_spec({"types": {"x": {"base": "t4-16gb", "driver_names": ["t4"]}},
                           "devices": [{"id": "x0", "type": "x"}]}, "lab.yaml")


def test_broken_yaml_is_named(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("devices: [{id: a0, type: t4-16gb\n")
    with pytest.raises(InputError, match="broken.yaml: not valid YAML"):
        load_cluster(path)
