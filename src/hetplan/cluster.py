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
      host_nic: {n1: 25Gbit/s}                 # optional: a host's network interface
      links: [{between: [a0, t0], bandwidth: 32GB/s}]

Two devices on the same host talk over `intra_host`, on different hosts over `inter_host`,
unless a `links` entry names the pair (both directions).

Interfaces (`Cluster.interfaces`): every device sends through its own interface and receives
through another (PCIe or NVLink: full duplex), and traffic between hosts also leaves through the
sending host's network interface and enters through the receiving host's (`host_nic`; a host not
named there has one of `inter_host`'s bandwidth, and a transfer between hosts goes no faster than
either end's interface). Transfers that share an interface take turns on it
(`hetplan.sim.engine`): one sender feeding two replicas, or two devices of a host sending to
another host, take twice as long as one transfer. A `links` entry is a dedicated link (NVLink
between two GPUs): it uses the two devices' interfaces, not the hosts'. Built-in presets (`v100x4`,
`hetero-4`, `cloud-mix`, `local`, ...) can be used wherever a cluster file can. A cluster has at
most `MAX_DEVICES` (1024) devices, counts included.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from hetplan._frozen import FILE_SCHEMA, FrozenMap
from hetplan.catalog import MAX_MEM_BYTES, DeviceType, memory_problem
from hetplan.errors import ClusterError, listing, shown

__all__ = ["MAX_DEVICES", "AllreduceCurve", "Calibration", "Cluster", "Device", "DeviceType", "Link", "LinkOverride"]

# The most devices a cluster may have. Loading is linear in the devices, but what users do next is
# not: `hetplan info` lists the link of every pair (about 3 s and 0.7 GB at 1024 devices, 110 s and
# 10 GB at 4096) and the planners search over orders of devices. The pipelines hetplan plans use
# tens to hundreds of devices; a mistyped `count: 100000` is refused at once instead of running on.
MAX_DEVICES = 1024
# A CPU worker's thread count beyond any real machine is a typo, and would overflow its FLOP rate.
MAX_THREADS = 4096


def is_finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


# Used when a cluster file gives no network section: PCIe 3.0 x16 inside a host, 10 GbE between.
DEFAULT_INTRA_HOST = {"bandwidth": "12GB/s", "latency": "10us"}
DEFAULT_INTER_HOST = {"bandwidth": "10Gbit/s", "latency": "50us"}



def too_many_devices(count: int, where: str = "") -> str:
    return (f"{where}{count} devices, more than the {MAX_DEVICES} a cluster may have (hetplan.cluster.MAX_DEVICES); "
            "describe fewer devices or lower the counts")


@dataclass(frozen=True)
class Link:
    """A point-to-point link (what a transfer over it costs: `hetplan.cost.formulas.transfer_s`)."""

    __pydantic_config__ = FILE_SCHEMA

    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (self.bandwidth_Bps > 0):
            raise ClusterError(f"link bandwidth is {self.bandwidth_Bps!r}; it must be > 0")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ClusterError(f"link latency is {self.latency_s!r}; it must be finite and >= 0")


LOCAL_LINK = Link(math.inf, 0.0)  # a device to itself: no transfer


@dataclass(frozen=True)
class LinkOverride:
    """The link between two named devices, used in both directions."""

    __pydantic_config__ = FILE_SCHEMA

    between: tuple[str, str]
    bandwidth_Bps: float
    latency_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "between", tuple(self.between))
        if len(self.between) != 2 or self.between[0] == self.between[1]:
            raise ClusterError(f"a link names two different devices, got {list(self.between)}")
        Link(self.bandwidth_Bps, self.latency_s)


def _points(points, what: str) -> tuple[tuple[float, float], ...]:
    """Measured (size, seconds) points, sorted, each finite with size > 0 and seconds >= 0."""
    out = tuple(sorted((float(x), float(y)) for x, y in points))
    for x, y in out:
        if not (is_finite(x) and x > 0 and is_finite(y) and y >= 0):
            raise ClusterError(f"{what}: measured point ({x!r}, {y!r}) needs a size > 0 and seconds >= 0")
    if len({x for x, _ in out}) != len(out):
        raise ClusterError(f"{what}: two measured points have the same size")
    return out


@dataclass(frozen=True)
class AllreduceCurve:
    """All-reduce times measured between `replicas` local workers: (bytes, seconds) points."""

    __pydantic_config__ = FILE_SCHEMA

    replicas: int
    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 2:
            raise ClusterError(f"an all-reduce curve is for 2 or more replicas, got {self.replicas!r}")
        object.__setattr__(self, "points", _points(self.points, f"all-reduce of {self.replicas}"))
        if not self.points:
            raise ClusterError(f"the all-reduce curve of {self.replicas} replicas has no points")


@dataclass(frozen=True)
class Calibration:
    """What `hetplan calibrate` measured on the machine a cluster's workers run on, beside the
    link (`Cluster.intra_host`) and each device's own figures: all-reduce times by group size
    (gloo between local processes), and how much CPU workers on one host slow each other down
    (`corun_slowdown`: (busy CPU workers, factor on each one's compute)). `source` says where and
    when it was measured."""

    __pydantic_config__ = FILE_SCHEMA

    source: str
    allreduce: tuple[AllreduceCurve, ...] = ()
    corun_slowdown: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "allreduce", tuple(sorted(self.allreduce, key=lambda c: c.replicas)))
        object.__setattr__(self, "corun_slowdown", tuple(sorted((int(k), float(v)) for k, v in self.corun_slowdown)))
        if len({c.replicas for c in self.allreduce}) != len(self.allreduce):
            raise ClusterError("calibration: two all-reduce curves for the same number of replicas")
        for k, v in self.corun_slowdown:
            if k < 1 or not (is_finite(v) and v > 0):
                raise ClusterError(f"calibration: co-running slowdown ({k}, {v}) needs workers >= 1 and a factor > 0")


@dataclass(frozen=True)
class Device:
    """One device. `type` names a `DeviceType` of the cluster; `mem_bytes` and `usd_per_hour`
    start from the type's and can be set per device. `binding` says where a real run puts it
    (`cpu`, `cuda:0`); None means the device is only simulated. `action_overhead_s` is what the
    runtime spends per pipeline action on this device outside the model's operators (schedule
    bookkeeping, sending and receiving), and `step_overhead_s` what it spends once per step
    (barriers, starting the schedule), as `hetplan calibrate` measures them; the simulator adds
    the first to every forward and backward action and the second to the end of the step.
    `optimizer_points` are `(parameter bytes, seconds)` of the optimizer step as measured on this
    device (`hetplan calibrate`); empty, the cost model's memory-bound formula is used."""

    __pydantic_config__ = FILE_SCHEMA

    id: str
    type: str
    host: str
    mem_bytes: int
    usd_per_hour: float
    threads: int | None = None
    binding: str | None = None
    action_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    optimizer_points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "optimizer_points", _points(self.optimizer_points, f"device {self.id!r}: optimizer"))
        if not self.id:
            raise ClusterError("a device needs a non-empty id")
        if not self.host:
            raise ClusterError(f"device {self.id!r} needs a host")
        if not is_finite(self.mem_bytes) or self.mem_bytes <= 0:
            raise ClusterError(f"device {self.id!r}: mem_bytes is {shown(self.mem_bytes)}; it must be finite and > 0")
        if self.mem_bytes > MAX_MEM_BYTES:
            raise ClusterError(f"device {self.id!r}: {memory_problem(self.mem_bytes)}")
        if self.threads is not None and (isinstance(self.threads, bool) or not 1 <= self.threads <= MAX_THREADS):
            raise ClusterError(f"device {self.id!r}: threads is {shown(self.threads)}; it must be from 1 to "
                               f"{MAX_THREADS}")
        if not is_finite(self.usd_per_hour) or self.usd_per_hour < 0:
            raise ClusterError(f"device {self.id!r}: usd_per_hour is {shown(self.usd_per_hour)}; it must be >= 0")
        if self.binding is not None and not (isinstance(self.binding, str) and (
            self.binding == "cpu" or self.binding == "cuda" or self.binding.startswith("cuda:")
        )):
            raise ClusterError(f"device {self.id!r}: binding {shown(self.binding)}; allowed: cpu, cuda, cuda:N")
        for name in ("action_overhead_s", "step_overhead_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ClusterError(f"device {self.id!r}: {name} is {value!r}; it must be >= 0")


@dataclass(frozen=True)
class Cluster:
    """Devices, their types (self-contained, so a saved cluster needs no catalog) and links."""

    __pydantic_config__ = FILE_SCHEMA

    name: str
    devices: tuple[Device, ...]
    types: Mapping[str, DeviceType]
    intra_host: Link
    inter_host: Link
    links: tuple[LinkOverride, ...] = ()
    calibration: Calibration | None = None  # None: nothing measured on the machine (`hetplan calibrate`)
    host_nic_Bps: Mapping[str, float] = field(default_factory=dict)  # host -> its network interface

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "host_nic_Bps", FrozenMap({str(h): float(v) for h, v in self.host_nic_Bps.items()}))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "types", FrozenMap(self.types))
        if not self.devices:
            raise ClusterError(f"cluster {self.name!r} has no devices")
        if len(self.devices) > MAX_DEVICES:
            raise ClusterError(too_many_devices(len(self.devices)))
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
                    f"cluster does not define (defined: {listing(self.types)})"
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
        self._check_nics()

    def _check_nics(self) -> None:
        for host, bandwidth in self.host_nic_Bps.items():
            if host not in self.hosts:
                raise ClusterError(f"cluster {self.name!r}: host_nic names host {host!r}, which has no device "
                                   f"(hosts: {listing(self.hosts)})")
            if not (is_finite(bandwidth) and bandwidth > 0):
                raise ClusterError(f"cluster {self.name!r}: host_nic of {host!r} is {bandwidth!r}; it must be > 0")

    def subset(self, device_ids: Sequence[str], name: str | None = None) -> Cluster:
        """The cluster of some of its devices (in its own order), with their links and calibration."""
        keep = set(device_ids)
        devices = tuple(d for d in self.devices if d.id in keep)
        hosts = {d.host for d in devices}
        return replace(self, name=name or f"{self.name}[{len(keep)}]", devices=devices,
                       links=tuple(lk for lk in self.links if set(lk.between) <= keep),
                       host_nic_Bps={h: v for h, v in self.host_nic_Bps.items() if h in hosts})

    @cached_property
    def by_id(self) -> Mapping[str, Device]:
        return FrozenMap({d.id: d for d in self.devices})

    @cached_property
    def _overrides(self) -> Mapping[frozenset[str], Link]:
        return FrozenMap({frozenset(o.between): Link(o.bandwidth_Bps, o.latency_s) for o in self.links})

    @cached_property
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
                f"cluster {self.name!r} has no device {shown(device_id)} (devices: {listing(self.ids)})"
            ) from None

    def device_type(self, device_id: str) -> DeviceType:
        return self.types[self.device(device_id).type]

    def nic_Bps(self, host: str) -> float:
        """The bandwidth of a host's network interface (`host_nic`, else `inter_host`'s)."""
        return self.host_nic_Bps.get(host, self.inter_host.bandwidth_Bps)

    @cached_property
    def _between_hosts(self) -> Mapping[tuple[str, str], Link]:
        """The link between two hosts: `inter_host`, no faster than either host's interface."""
        if not self.host_nic_Bps:
            return FrozenMap({})
        return FrozenMap({(a, b): Link(min(self.inter_host.bandwidth_Bps, self.nic_Bps(a), self.nic_Bps(b)),
                                       self.inter_host.latency_s) for a in self.hosts for b in self.hosts if a != b})

    def link(self, a: str, b: str) -> Link:
        """The link from device `a` to device `b` (links are symmetric), for one transfer alone
        on it (what sharing the interfaces costs: `interfaces`)."""
        if a == b:
            self.device(a)
            return LOCAL_LINK
        override = self._overrides.get(frozenset((a, b)))
        if override is not None:
            return override
        ha, hb = self.device(a).host, self.device(b).host
        if ha == hb:
            return self.intra_host
        return self._between_hosts.get((ha, hb), self.inter_host)

    def crosses_hosts(self, a: str, b: str) -> bool:
        """Whether a transfer from `a` to `b` goes through the two hosts' network interfaces."""
        return a != b and self.device(a).host != self.device(b).host and frozenset((a, b)) not in self._overrides

    def interface_Bps(self, interface: tuple[str, str]) -> float:
        """An interface's bandwidth: a device's (either way) is `intra_host`'s, a host's `nic_Bps`."""
        kind, name = interface
        return self.intra_host.bandwidth_Bps if kind in ("send", "receive") else self.nic_Bps(name)

    def interfaces(self, a: str, b: str) -> tuple[tuple[str, str], ...]:
        """The interfaces a transfer from device `a` to device `b` occupies: `a`'s sending side
        and `b`'s receiving side, and between hosts (no `links` entry) the two hosts' network
        interfaces, each way on its own (full duplex): ("send", device), ("receive", device),
        ("host sends", host), ("host receives", host)."""
        if a == b:
            return ()
        ports = (("send", a), ("receive", b))
        if self.crosses_hosts(a, b):
            ports += (("host sends", self.device(a).host), ("host receives", self.device(b).host))
        return ports


# ---- loading ---------------------------------------------------------------------------------
