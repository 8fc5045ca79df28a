"""Cluster files: the YAML/JSON description of a cluster (module doc of `hetplan.cluster`), its
presets, and saved clusters, read into a `Cluster` with one-line errors that name the file and
the field. The data model lives in `hetplan.cluster`; reading files is I/O, so it lives here, and
the model imports nothing of it (no import cycle: cluster <- io.serde <- io.clusters).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hetplan import catalog
from hetplan.catalog import DeviceType
from hetplan.cluster import (
    DEFAULT_INTER_HOST,
    DEFAULT_INTRA_HOST,
    MAX_DEVICES,
    MAX_THREADS,
    Cluster,
    Device,
    Link,
    LinkOverride,
    is_finite,
    too_many_devices,
)
from hetplan.errors import ClusterError, HetplanError, InputError, listing, shown
from hetplan.io import serde
from hetplan.machine import usable_cores
from hetplan.units import parse_bandwidth, parse_bytes, parse_duration, parse_flops

__all__ = ["cluster_from_data", "cluster_from_spec", "load_cluster", "local_spec", "preset_spec", "presets"]


_TOP_KEYS = {"name", "types", "devices", "network"}
_DEVICE_KEYS = {"id", "type", "host", "threads", "memory", "usd_per_hour", "binding", "count", "action_overhead",
                "step_overhead"}
_TYPE_KEYS = {"base", "kind", "peak_flops", "peak_flops_fp16", "memory", "memory_bandwidth",
              "usd_per_hour", "threads", "description", "bf16_tensor"}
_NETWORK_KEYS = {"intra_host", "inter_host", "host_nic", "links"}
_LINK_KEYS = {"bandwidth", "latency"}


def _check_keys(obj: object, allowed: set[str], where: str, required: tuple[str, ...] = ()) -> dict:
    if not isinstance(obj, Mapping):
        raise ClusterError(f"{where}: expected a mapping of fields, got {shown(obj)}")
    unknown = sorted((k for k in obj if k not in allowed), key=repr)  # YAML keys can be of mixed types
    if unknown:
        raise ClusterError(f"{where}: unknown field {shown(unknown[0])} (allowed: {', '.join(sorted(allowed))})")
    for key in required:
        if key not in obj:
            raise ClusterError(f"{where}: missing field {key!r}")
    return dict(obj)


def _text(value: object, where: str) -> str:
    """A name, id or host: YAML text, or a whole number such as `0` (never a list or a mapping,
    whose text could be huge: a YAML alias bomb)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**18:  # longer is no id
        return str(value)
    raise ClusterError(f"{where}: expected a name, got {shown(value)}; write it as text (in quotes)")


def _whole(value: object, where: str, top: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{where}: {shown(value)} is not a whole number >= 1")
    if top is not None and value > top:
        raise ClusterError(f"{where}: {shown(value)} is more than {top}; give at most {top}")
    return value


def _unit(parse: Callable[[object, str], float], value: object, where: str) -> Any:
    """`parse` (a `hetplan.units` parser) on a number or a string; anything else is refused here,
    before the parser quotes it whole in its message."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ClusterError(f"{where}: expected a number or a string with a unit, got {shown(value)}")
    try:
        return parse(value, where)
    except OverflowError:
        raise ClusterError(f"{where}: {shown(value)} is too large") from None


def _price(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not is_finite(value) or value < 0:
        raise ClusterError(f"{where}: {shown(value)} is not a price; write US dollars per hour as a number >= 0")
    return float(value)


def _lookup(name: str, threads: int | None, where: str) -> DeviceType:
    """A catalog type; a `cpu-Nt` name with a huge N is an unknown type, not an overflow."""
    try:
        return catalog.lookup(name, threads)
    except ClusterError as exc:
        raise ClusterError(f"{where}: {exc}") from None
    except (OverflowError, ValueError):
        raise ClusterError(f"{where}: {shown(name)} has more threads than a cpu type may have") from None


def _type_fields(spec: dict, where: str) -> dict[str, Any]:
    """The fields of a custom type: its base's, then the ones the spec gives."""
    threads = _whole(spec["threads"], f"{where}.threads", MAX_THREADS) if "threads" in spec else None
    base = _lookup(_text(spec["base"], f"{where}.base"), threads, f"{where}.base") if "base" in spec else None
    fields: dict[str, Any] = {} if base is None else {
        "kind": base.kind, "peak_flops": base.peak_flops, "peak_flops_fp16": base.peak_flops_fp16,
        "mem_bytes": base.mem_bytes, "mem_bw_Bps": base.mem_bw_Bps,
        "usd_per_hour": base.usd_per_hour, "threads": base.threads, "description": base.description,
        "bf16_tensor": base.bf16_tensor,
    }
    parsers = {"peak_flops": ("peak_flops", parse_flops), "peak_flops_fp16": ("peak_flops_fp16", parse_flops),
               "memory": ("mem_bytes", parse_bytes), "memory_bandwidth": ("mem_bw_Bps", parse_bandwidth)}
    for key, (name, parse) in parsers.items():
        if key in spec:
            fields[name] = _unit(parse, spec[key], f"{where}.{key}")
    for key in ("kind", "description"):
        if key in spec:
            fields[key] = _text(spec[key], f"{where}.{key}")
    if "bf16_tensor" in spec:
        if not isinstance(spec["bf16_tensor"], bool):
            raise ClusterError(f"{where}.bf16_tensor: {shown(spec['bf16_tensor'])} is not true or false")
        fields["bf16_tensor"] = spec["bf16_tensor"]
    if "usd_per_hour" in spec:
        fields["usd_per_hour"] = _price(spec["usd_per_hour"], f"{where}.usd_per_hour")
    if threads is not None:
        fields["threads"] = threads
    return fields


def _parse_type(name: str, spec: object, where: str) -> DeviceType:
    fields = _type_fields(_check_keys(spec, _TYPE_KEYS, where), where)
    fields.setdefault("peak_flops_fp16", fields.get("peak_flops"))
    missing = [k for k in ("kind", "peak_flops", "mem_bytes", "mem_bw_Bps") if k not in fields]
    if missing:
        names = {"mem_bytes": "memory", "mem_bw_Bps": "memory_bandwidth"}
        raise ClusterError(
            f"{where}: missing {', '.join(names.get(m, m) for m in missing)} "
            f"(or give 'base: <catalog type>' to start from one)"
        )
    fields.setdefault("usd_per_hour", 0.0)
    try:
        return DeviceType(name=name, **fields)
    except ClusterError as exc:
        raise ClusterError(f"{where}: {exc}") from None


def _parse_link(spec: object, where: str, default: Link | None) -> Link:
    spec = _check_keys(spec, _LINK_KEYS, where, () if default else ("bandwidth",))
    bw = (_unit(parse_bandwidth, spec["bandwidth"], f"{where}.bandwidth") if "bandwidth" in spec
          else default.bandwidth_Bps)
    lat = _unit(parse_duration, spec["latency"], f"{where}.latency") if "latency" in spec else (
        default.latency_s if default else 0.0)
    if bw <= 0:
        raise ClusterError(f"{where}.bandwidth: must be > 0")
    try:
        return Link(bw, lat)
    except ClusterError as exc:
        raise ClusterError(f"{where}: {exc}") from None


def _parse_types(spec: dict, source: str) -> dict[str, DeviceType]:
    types_spec = spec.get("types") or {}
    if not isinstance(types_spec, Mapping):
        raise ClusterError(f"{source}: types: expected a mapping from type name to its fields")
    custom: dict[str, DeviceType] = {}
    for key, tspec in types_spec.items():
        tname = _text(key, f"{source}: types: a type name")
        custom[tname] = _parse_type(tname, tspec, f"{source}: types.{tname}")
    return custom


def _device_type(d: dict, custom: Mapping[str, DeviceType], where: str) -> DeviceType:
    tname = _text(d["type"], f"{where}.type")
    threads = _whole(d["threads"], f"{where}.threads", MAX_THREADS) if d.get("threads") is not None else None
    try:
        dtype = custom[tname] if tname in custom else _lookup(tname, threads, f"{where}.type")
    except ClusterError as exc:
        known = listing([*custom, *catalog.catalog_names()], limit=20)
        raise ClusterError(f"{where}.type: unknown device type {shown(tname)} (known: {known})") from exc
    if threads is not None and dtype.kind != "cpu":
        raise ClusterError(f"{where}.threads: only cpu devices take a thread count ({tname} is a {dtype.kind})")
    return dtype


def _parse_devices(entries: list, types: dict[str, DeviceType], used: dict[str, DeviceType],
                   source: str) -> list[Device]:
    """The devices of the entries, `count` expanded; the types they use are added to `used`."""
    devices: list[Device] = []
    for i, raw in enumerate(entries):
        where = f"{source}: devices[{i}]"
        d = _check_keys(raw, _DEVICE_KEYS, where, ("id", "type"))
        count = _whole(d["count"], f"{where}.count") if d.get("count") is not None else None
        if len(devices) + (count or 1) > MAX_DEVICES:  # before making them: a count can be 10**9
            raise ClusterError(too_many_devices(len(devices) + (count or 1), f"{where}: "))
        dtype = _device_type(d, types, where)
        if dtype.name in used and used[dtype.name] != dtype:
            raise ClusterError(f"{where}.type: two different types are named {dtype.name!r}")
        used[dtype.name] = dtype
        devices += _device_entry(d, dtype, count, where)
    return devices


def _device_entry(d: dict, dtype: DeviceType, count: int | None, where: str) -> list[Device]:
    """The devices of one entry: one, or `count` of them named id0, id1, ..."""
    mem = _unit(parse_bytes, d["memory"], f"{where}.memory") if "memory" in d else dtype.mem_bytes
    if mem <= 0:
        raise ClusterError(f"{where}.memory: must be > 0")
    price = _price(d["usd_per_hour"], f"{where}.usd_per_hour") if "usd_per_hour" in d else dtype.usd_per_hour
    overheads = {f"{key}_s": _unit(parse_duration, d[key], f"{where}.{key}") if key in d else 0.0
                 for key in ("action_overhead", "step_overhead")}
    dev_id = _text(d["id"], f"{where}.id")
    host = _text(d.get("host", "host0"), f"{where}.host")
    binding = _text(d["binding"], f"{where}.binding") if d.get("binding") is not None else None
    ids = [f"{dev_id}{k}" for k in range(count)] if count else [dev_id]
    try:
        return [Device(id=i, type=dtype.name, host=host, mem_bytes=mem, usd_per_hour=price, threads=dtype.threads,
                       binding=binding, **overheads) for i in ids]
    except ClusterError as exc:
        raise ClusterError(f"{where}: {exc}") from None


def _parse_overrides(links_spec: object, hosts: Mapping[str, str], intra: Link, inter: Link,
                     source: str) -> list[LinkOverride]:
    if not isinstance(links_spec, list):
        raise ClusterError(f"{source}: network.links: expected a list of links")
    overrides: list[LinkOverride] = []
    for i, raw in enumerate(links_spec):
        where = f"{source}: network.links[{i}]"
        lk = _check_keys(raw, _LINK_KEYS | {"between"}, where, ("between",))
        between = lk.pop("between")
        if not isinstance(between, list | tuple) or len(between) != 2:
            raise ClusterError(f"{where}.between: expected two device ids, got {shown(between)}")
        a, b = (_text(end, f"{where}.between") for end in between)
        for end in (a, b):
            if end not in hosts:
                raise ClusterError(f"{where}.between: no device {end!r} (devices: {listing(hosts)})")
        link = _parse_link(lk, where, intra if hosts[a] == hosts[b] else inter)
        try:
            overrides.append(LinkOverride((a, b), link.bandwidth_Bps, link.latency_s))
        except ClusterError as exc:
            raise ClusterError(f"{where}: {exc}") from None
    return overrides


def _parse_nics(spec: object, hosts: set[str], source: str) -> dict[str, float]:
    """`network.host_nic`: host -> the bandwidth of its network interface."""
    where = f"{source}: network.host_nic"
    if not isinstance(spec, Mapping):
        raise ClusterError(f"{where}: expected a mapping of host: bandwidth, e.g. {{n0: 25Gbit/s}}")
    out = {}
    for host, value in spec.items():
        name = _text(host, where)
        if name not in hosts:
            raise ClusterError(f"{where}: no device is on host {name!r} (hosts: {listing(sorted(hosts))})")
        out[name] = _unit(parse_bandwidth, value, f"{where}.{name}")
        if not out[name] > 0:
            raise ClusterError(f"{where}.{name}: must be > 0")
    return out


def cluster_from_spec(spec: object, source: str = "<cluster>") -> Cluster:
    """Build a `Cluster` from a parsed YAML/JSON description (see the module docstring)."""
    spec = _check_keys(spec, _TOP_KEYS, source, ("devices",))
    name = _text(spec["name"], f"{source}: name") if spec.get("name") else Path(source).stem
    types = _parse_types(spec, source)
    dev_specs = spec["devices"]
    if not isinstance(dev_specs, list) or not dev_specs:
        raise ClusterError(f"{source}: devices: expected a non-empty list of devices")
    used: dict[str, DeviceType] = {}
    devices = _parse_devices(dev_specs, types, used, source)
    net = _check_keys(spec.get("network") or {}, _NETWORK_KEYS, f"{source}: network")
    intra = _parse_link(net.get("intra_host", DEFAULT_INTRA_HOST), f"{source}: network.intra_host", None)
    inter = _parse_link(net.get("inter_host", DEFAULT_INTER_HOST), f"{source}: network.inter_host", None)
    hosts = {dev.id: dev.host for dev in devices}
    overrides = _parse_overrides(net.get("links") or [], hosts, intra, inter, source)
    nics = _parse_nics(net.get("host_nic") or {}, set(hosts.values()), source)
    try:
        return Cluster(name, tuple(devices), used, intra, inter, tuple(overrides), host_nic_Bps=nics)
    except ClusterError as exc:
        raise ClusterError(f"{source}: {exc}") from None


def hosts_spec(groups: Sequence[tuple[str, int, int]], inter_host: str = "1.7GB/s", intra_host: str = "100GB/s",
               name: str = "hosts") -> dict:
    """The description of a cluster of whole hosts: `groups` are (device type, hosts, devices per
    host), each host of one type (`t4-16gb`, 2, 8: hosts t4-16gb-0 and t4-16gb-1, devices
    t4-16gb-0.0 ...); the network's two bandwidths as in a cluster file."""
    devices = [{"id": f"{t}-{h}.", "type": t, "host": f"{t}-{h}", "count": per}
               for t, hosts, per in groups for h in range(hosts)]
    return {"name": name, "devices": devices,
            "network": {"intra_host": {"bandwidth": intra_host}, "inter_host": {"bandwidth": inter_host}}}


def presets() -> tuple[str, ...]:
    """Names of the built-in clusters."""
    files = resources.files("hetplan").joinpath("presets")
    names = sorted(p.name.removesuffix(".yaml") for p in files.iterdir() if p.name.endswith(".yaml"))
    return (*names, "local")


def local_spec(cpu_count: int | None = None) -> dict:
    """This machine's CPU as worker processes: one single-threaded worker per core (at most 8)."""
    cores = cpu_count or usable_cores()
    return {
        "name": "local",
        "devices": [{"id": f"cpu{i}", "type": "cpu", "threads": 1, "host": "localhost", "binding": "cpu"}
                    for i in range(min(cores, 8))],
        # Workers on one machine exchange tensors through gloo over loopback.
        "network": {"intra_host": {"bandwidth": "2GB/s", "latency": "50us"}},
    }


def preset_spec(name: str) -> dict:
    if name == "local":
        return local_spec()
    path = resources.files("hetplan").joinpath("presets").joinpath(f"{name}.yaml")
    if not path.is_file():
        raise ClusterError(f"no cluster preset {name!r} (presets: {', '.join(presets())})")
    return yaml.safe_load(path.read_text())


class _StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """PyYAML's safe loader (its C parser, libyaml, where PyYAML has it: ten times faster than its
    Python one), but a key written twice in one mapping is an error: PyYAML keeps the last one
    silently, so a second `devices:` would drop the first list without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {shown(key_node.value)} is given twice", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, in one line (PyYAML's own text spans several)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__


# A description of MAX_DEVICES devices takes well under a megabyte of YAML; PyYAML reads ~0.2 MB/s
# of it, so a file far over that is refused before a long parse (50 MB took over 300 s).
MAX_YAML_BYTES = 4 << 20


MAX_YAML_NESTING = 200  # cluster files nest a few levels
_OPENS = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
          yaml.FlowSequenceStartToken)
_CLOSES = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


def _too_deep(text: str) -> bool:
    """Whether the text's collections nest deeper than `MAX_YAML_NESTING`, from its tokens, read
    only as far as that (the scanner does not recurse; the C composer does, without a limit:
    nesting 100,000 deep crashes the process)."""
    depth = 0
    for token in yaml.scan(text, Loader=_StrictLoader):
        if isinstance(token, _OPENS):
            depth += 1
            if depth > MAX_YAML_NESTING:
                return True
        elif isinstance(token, _CLOSES):
            depth -= 1
    return False


def _read_yaml(path: Path) -> object:
    size = path.stat().st_size
    if size > MAX_YAML_BYTES:
        raise InputError(f"{path}: {size / 1e6:.1f} MB of YAML, more than a cluster of {MAX_DEVICES} devices "
                         f"needs ({MAX_YAML_BYTES >> 20} MiB at most); is it the right file?")
    try:
        text = path.read_text()
        if _too_deep(text):
            raise RecursionError
        data = yaml.load(text, Loader=_StrictLoader)
    except UnicodeDecodeError as exc:
        raise InputError(serde.not_utf8(path, exc)) from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise InputError(f"{path}: not valid YAML: nested more deeply than Python can parse; cluster files "
                         "nest a few levels") from None
    except ValueError:  # Python converts at most 4300 digits of an integer
        raise InputError(f"{path}: not valid YAML: a number has more digits than Python reads; write numbers "
                         "of a usual size") from None
    serde.check_depth(data, str(path))
    return data


def cluster_from_data(data: object, source: str) -> Cluster:
    """A cluster from parsed file contents: a saved cluster (`kind: cluster`) or a description."""
    if serde.is_hetplan_file(data):
        return serde.from_dict(data, source=source, expect="cluster")
    return cluster_from_spec(data, source)


def load_cluster(ref: str | os.PathLike) -> Cluster:
    """A cluster from a YAML/JSON description, a saved cluster JSON, or a preset name."""
    path = Path(ref)
    if path.is_file():
        if path.suffix == ".json":
            return cluster_from_data(serde.read_json(path), str(path))
        return cluster_from_data(_read_yaml(path), str(path))
    if str(ref) in presets():
        return cluster_from_spec(preset_spec(str(ref)), str(ref))
    if path.suffix in (".yaml", ".yml", ".json") or os.sep in str(ref):
        raise InputError(f"{ref}: no such file")
    raise HetplanError(f"{ref!r} is neither a cluster file nor a preset (presets: {', '.join(presets())})")
