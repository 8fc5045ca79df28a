"""Clusters: devices, the hosts they sit on, and the links between them.

A cluster is written by hand in YAML (or JSON) with human units:

    name: lab
    types:                                   # optional: new types, or catalog types changed
      cheap-a100: {base: a100-40gb, usd_per_hour: 0.9}
    devices:
      - {id: a0, type: a100-40gb, host: n0}
      - {id: t, type: t4-16gb, host: n1, count: 2}     # t0, t1
      - {id: c0, type: cpu, host: n1, threads: 8, memory: 64GiB, binding: cpu}
    network:
      intra_host: {bandwidth: 150GB/s, latency: 5us}
      inter_host: {bandwidth: 10Gbit/s, latency: 50us}
      links: [{between: [a0, t0], bandwidth: 32GB/s}]

Two devices on the same host talk over `intra_host`, on different hosts over `inter_host`,
unless a `links` entry names the pair (both directions). Built-in presets (`v100x4`,
`hetero-4`, `cloud-mix`, `local`, ...) can be used wherever a cluster file can.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hetplan import catalog
from hetplan._frozen import FrozenMap
from hetplan.catalog import DeviceType
from hetplan.errors import ClusterError, HetplanError, InputError
from hetplan.units import parse_bandwidth, parse_bytes, parse_duration, parse_flops

__all__ = ["Cluster", "Device", "DeviceType", "Link", "LinkOverride", "load_cluster", "presets"]

# Used when a cluster file gives no network section: PCIe 3.0 x16 inside a host, 10 GbE between.
DEFAULT_INTRA_HOST = {"bandwidth": "12GB/s", "latency": "10us"}
DEFAULT_INTER_HOST = {"bandwidth": "10Gbit/s", "latency": "50us"}


@dataclass(frozen=True)
class Link:
    """A point-to-point link: a transfer of b bytes takes `latency_s + b / bandwidth_Bps`."""

    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (self.bandwidth_Bps > 0):
            raise ClusterError(f"link bandwidth is {self.bandwidth_Bps!r}; it must be > 0")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ClusterError(f"link latency is {self.latency_s!r}; it must be finite and >= 0")

    def transfer_s(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_Bps


LOCAL_LINK = Link(math.inf, 0.0)  # a device to itself: no transfer


@dataclass(frozen=True)
class LinkOverride:
    """The link between two named devices, used in both directions."""

    between: tuple[str, str]
    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "between", tuple(self.between))
        if len(self.between) != 2 or self.between[0] == self.between[1]:
            raise ClusterError(f"a link names two different devices, got {list(self.between)}")
        Link(self.bandwidth_Bps, self.latency_s)


@dataclass(frozen=True)
class Device:
    """One device. `type` names a `DeviceType` of the cluster; `mem_bytes` and `usd_per_hour`
    start from the type's and can be set per device. `binding` says where a real run puts it
    (`cpu`, `cuda:0`); None means the device is only simulated. `action_overhead_s` is what the
    runtime spends per pipeline action on this device outside the model's operators (schedule
    bookkeeping, sending and receiving), and `step_overhead_s` what it spends once per step
    (barriers, starting the schedule), as `hetplan calibrate` measures them; the simulator adds
    the first to every forward and backward action and the second to the end of the step."""

    id: str
    type: str
    host: str
    mem_bytes: int
    usd_per_hour: float
    threads: int | None = None
    binding: str | None = None
    action_overhead_s: float = 0.0
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.id:
            raise ClusterError("a device needs a non-empty id")
        if not self.host:
            raise ClusterError(f"device {self.id!r} needs a host")
        if self.mem_bytes <= 0:
            raise ClusterError(f"device {self.id!r}: mem_bytes is {self.mem_bytes!r}; it must be > 0")
        if not math.isfinite(self.usd_per_hour) or self.usd_per_hour < 0:
            raise ClusterError(f"device {self.id!r}: usd_per_hour is {self.usd_per_hour!r}; it must be >= 0")
        if self.binding is not None and not (
            self.binding == "cpu" or self.binding == "cuda" or self.binding.startswith("cuda:")
        ):
            raise ClusterError(f"device {self.id!r}: binding {self.binding!r}; allowed: cpu, cuda, cuda:N")
        for name in ("action_overhead_s", "step_overhead_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ClusterError(f"device {self.id!r}: {name} is {value!r}; it must be >= 0")


@dataclass(frozen=True)
class Cluster:
    """Devices, their types (self-contained, so a saved cluster needs no catalog) and links."""

    name: str
    devices: tuple[Device, ...]
    types: Mapping[str, DeviceType]
    intra_host: Link
    inter_host: Link
    links: tuple[LinkOverride, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "types", FrozenMap(self.types))
        if not self.devices:
            raise ClusterError(f"cluster {self.name!r} has no devices")
        for key, dtype in self.types.items():
            if key != dtype.name:
                raise ClusterError(f"cluster {self.name!r}: type entry {key!r} holds type {dtype.name!r}")
        ids: set[str] = set()
        for dev in self.devices:
            if dev.id in ids:
                raise ClusterError(f"cluster {self.name!r}: duplicate device id {dev.id!r}")
            ids.add(dev.id)
            if dev.type not in self.types:
                raise ClusterError(
                    f"cluster {self.name!r}: device {dev.id!r} has type {dev.type!r}, which the "
                    f"cluster does not define (defined: {', '.join(self.types)})"
                )
        pairs: set[frozenset[str]] = set()
        for link in self.links:
            for end in link.between:
                if end not in ids:
                    raise ClusterError(
                        f"cluster {self.name!r}: link {link.between[0]}-{link.between[1]} names "
                        f"device {end!r}, which does not exist"
                    )
            pair = frozenset(link.between)
            if pair in pairs:
                raise ClusterError(f"cluster {self.name!r}: two links for {link.between[0]}-{link.between[1]}")
            pairs.add(pair)

    @cached_property
    def by_id(self) -> Mapping[str, Device]:
        return FrozenMap({d.id: d for d in self.devices})

    @cached_property
    def _overrides(self) -> Mapping[frozenset[str], Link]:
        return FrozenMap({frozenset(o.between): Link(o.bandwidth_Bps, o.latency_s) for o in self.links})

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)

    @cached_property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.host for d in self.devices))

    def device(self, device_id: str) -> Device:
        try:
            return self.by_id[device_id]
        except KeyError:
            raise ClusterError(
                f"cluster {self.name!r} has no device {device_id!r} (devices: {', '.join(self.ids)})"
            ) from None

    def device_type(self, device_id: str) -> DeviceType:
        return self.types[self.device(device_id).type]

    def link(self, a: str, b: str) -> Link:
        """The link from device `a` to device `b` (links are symmetric)."""
        if a == b:
            self.device(a)
            return LOCAL_LINK
        override = self._overrides.get(frozenset((a, b)))
        if override is not None:
            return override
        return self.intra_host if self.device(a).host == self.device(b).host else self.inter_host


# ---- loading ---------------------------------------------------------------------------------

_TOP_KEYS = {"name", "types", "devices", "network"}
_DEVICE_KEYS = {"id", "type", "host", "threads", "memory", "usd_per_hour", "binding", "count", "action_overhead",
                "step_overhead"}
_TYPE_KEYS = {"base", "kind", "peak_flops", "peak_flops_fp16", "memory", "memory_bandwidth",
              "usd_per_hour", "threads", "description"}
_NETWORK_KEYS = {"intra_host", "inter_host", "links"}
_LINK_KEYS = {"bandwidth", "latency"}


def _check_keys(obj: object, allowed: set[str], where: str, required: tuple[str, ...] = ()) -> dict:
    if not isinstance(obj, Mapping):
        raise ClusterError(f"{where}: expected a mapping of fields, got {obj!r}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ClusterError(f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    for key in required:
        if key not in obj:
            raise ClusterError(f"{where}: missing field {key!r}")
    return dict(obj)


def _price(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ClusterError(f"{where}: {value!r} is not a price; write US dollars per hour as a number >= 0")
    return float(value)


def _parse_type(name: str, spec: object, where: str) -> DeviceType:
    spec = _check_keys(spec, _TYPE_KEYS, where)
    base = catalog.lookup(spec["base"], spec.get("threads")) if "base" in spec else None
    fields: dict[str, Any] = {} if base is None else {
        "kind": base.kind, "peak_flops": base.peak_flops, "peak_flops_fp16": base.peak_flops_fp16,
        "mem_bytes": base.mem_bytes, "mem_bw_Bps": base.mem_bw_Bps,
        "usd_per_hour": base.usd_per_hour, "threads": base.threads, "description": base.description,
    }
    if "kind" in spec:
        fields["kind"] = spec["kind"]
    if "peak_flops" in spec:
        fields["peak_flops"] = parse_flops(spec["peak_flops"], f"{where}.peak_flops")
    if "peak_flops_fp16" in spec:
        fields["peak_flops_fp16"] = parse_flops(spec["peak_flops_fp16"], f"{where}.peak_flops_fp16")
    if "memory" in spec:
        fields["mem_bytes"] = parse_bytes(spec["memory"], f"{where}.memory")
    if "memory_bandwidth" in spec:
        fields["mem_bw_Bps"] = parse_bandwidth(spec["memory_bandwidth"], f"{where}.memory_bandwidth")
    if "usd_per_hour" in spec:
        fields["usd_per_hour"] = _price(spec["usd_per_hour"], f"{where}.usd_per_hour")
    if "threads" in spec:
        fields["threads"] = spec["threads"]
    if "description" in spec:
        fields["description"] = str(spec["description"])
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
    bw = parse_bandwidth(spec["bandwidth"], f"{where}.bandwidth") if "bandwidth" in spec else default.bandwidth_Bps
    lat = parse_duration(spec["latency"], f"{where}.latency") if "latency" in spec else (
        default.latency_s if default else 0.0)
    if bw <= 0:
        raise ClusterError(f"{where}.bandwidth: must be > 0")
    return Link(bw, lat)


def cluster_from_spec(spec: object, source: str = "<cluster>") -> Cluster:
    """Build a `Cluster` from a parsed YAML/JSON description (see the module docstring)."""
    spec = _check_keys(spec, _TOP_KEYS, source, ("devices",))
    name = str(spec.get("name") or Path(source).stem)

    custom: dict[str, DeviceType] = {}
    types_spec = spec.get("types") or {}
    if not isinstance(types_spec, Mapping):
        raise ClusterError(f"{source}: types: expected a mapping from type name to its fields")
    for tname, tspec in types_spec.items():
        custom[str(tname)] = _parse_type(str(tname), tspec, f"{source}: types.{tname}")

    devices: list[Device] = []
    used: dict[str, DeviceType] = {}
    dev_specs = spec["devices"]
    if not isinstance(dev_specs, list) or not dev_specs:
        raise ClusterError(f"{source}: devices: expected a non-empty list of devices")
    for i, raw in enumerate(dev_specs):
        where = f"{source}: devices[{i}]"
        d = _check_keys(raw, _DEVICE_KEYS, where, ("id", "type"))
        tname = str(d["type"])
        threads = d.get("threads")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ClusterError(f"{where}.threads: {threads!r} is not a whole number >= 1")
        try:
            dtype = custom[tname] if tname in custom else catalog.lookup(tname, threads)
        except ClusterError as exc:
            known = ", ".join([*custom, *catalog.catalog_names()])
            raise ClusterError(f"{where}.type: unknown device type {tname!r} (known: {known})") from exc
        if threads is not None and dtype.kind != "cpu":
            raise ClusterError(f"{where}.threads: only cpu devices take a thread count ({tname} is a {dtype.kind})")
        if dtype.name in used and used[dtype.name] != dtype:
            raise ClusterError(f"{where}.type: two different types are named {dtype.name!r}")
        used[dtype.name] = dtype
        mem = parse_bytes(d["memory"], f"{where}.memory") if "memory" in d else dtype.mem_bytes
        if mem <= 0:
            raise ClusterError(f"{where}.memory: must be > 0")
        price = _price(d["usd_per_hour"], f"{where}.usd_per_hour") if "usd_per_hour" in d else dtype.usd_per_hour
        overhead = parse_duration(d["action_overhead"], f"{where}.action_overhead") if "action_overhead" in d else 0.0
        per_step = parse_duration(d["step_overhead"], f"{where}.step_overhead") if "step_overhead" in d else 0.0
        count = d.get("count", None)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ClusterError(f"{where}.count: {count!r} is not a whole number >= 1")
        ids = [f"{d['id']}{k}" for k in range(count)] if count else [str(d["id"])]
        for dev_id in ids:
            try:
                devices.append(Device(
                    id=dev_id, type=dtype.name, host=str(d.get("host", "host0")), mem_bytes=mem,
                    usd_per_hour=price, threads=dtype.threads, binding=d.get("binding"),
                    action_overhead_s=overhead, step_overhead_s=per_step,
                ))
            except ClusterError as exc:
                raise ClusterError(f"{where}: {exc}") from None

    net = _check_keys(spec.get("network") or {}, _NETWORK_KEYS, f"{source}: network")
    intra = _parse_link(net.get("intra_host", DEFAULT_INTRA_HOST), f"{source}: network.intra_host", None)
    inter = _parse_link(net.get("inter_host", DEFAULT_INTER_HOST), f"{source}: network.inter_host", None)
    overrides: list[LinkOverride] = []
    hosts = {dev.id: dev.host for dev in devices}
    links_spec = net.get("links") or []
    if not isinstance(links_spec, list):
        raise ClusterError(f"{source}: network.links: expected a list of links")
    for i, raw in enumerate(links_spec):
        where = f"{source}: network.links[{i}]"
        lk = _check_keys(raw, _LINK_KEYS | {"between"}, where, ("between",))
        between = lk.pop("between")
        if not isinstance(between, list | tuple) or len(between) != 2:
            raise ClusterError(f"{where}.between: expected two device ids, got {between!r}")
        for end in between:
            if end not in hosts:
                raise ClusterError(f"{where}.between: no device {end!r} (devices: {', '.join(hosts)})")
        a, b = str(between[0]), str(between[1])
        default = intra if hosts[a] == hosts[b] else inter
        link = _parse_link(lk, where, default)
        overrides.append(LinkOverride((a, b), link.bandwidth_Bps, link.latency_s))
    try:
        return Cluster(name, tuple(devices), used, intra, inter, tuple(overrides))
    except ClusterError as exc:
        raise ClusterError(f"{source}: {exc}") from None


def presets() -> tuple[str, ...]:
    """Names of the built-in clusters."""
    files = resources.files("hetplan").joinpath("presets")
    names = sorted(p.name.removesuffix(".yaml") for p in files.iterdir() if p.name.endswith(".yaml"))
    return (*names, "local")


def local_spec(cpu_count: int | None = None) -> dict:
    """This machine's CPU as worker processes: one single-threaded worker per core (at most 8)."""
    cores = cpu_count or os.cpu_count() or 1
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


def _read_yaml(path: Path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the file ({exc})") from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: not valid YAML: {first}") from None


def cluster_from_data(data: object, source: str) -> Cluster:
    """A cluster from parsed file contents: a saved cluster (`kind: cluster`) or a description."""
    from hetplan.io import serde  # serde imports this module

    if serde.is_hetplan_file(data):
        return serde.from_dict(data, source=source, expect="cluster")
    return cluster_from_spec(data, source)


def load_cluster(ref: str | os.PathLike) -> Cluster:
    """A cluster from a YAML/JSON description, a saved cluster JSON, or a preset name."""
    path = Path(ref)
    if path.is_file():
        if path.suffix == ".json":
            from hetplan.io.serde import read_json

            return cluster_from_data(read_json(path), str(path))
        return cluster_from_data(_read_yaml(path), str(path))
    if str(ref) in presets():
        return cluster_from_spec(preset_spec(str(ref)), str(ref))
    if path.suffix in (".yaml", ".yml", ".json") or os.sep in str(ref):
        raise InputError(f"{ref}: no such file")
    raise HetplanError(f"{ref!r} is neither a cluster file nor a preset (presets: {', '.join(presets())})")
