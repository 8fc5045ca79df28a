"""What a cut costs on the cluster's network: the links between two stages' devices, the hosts'
network interfaces they cross, and the transfers routed as the runtime routes rows; and the
links of GPU workers from what `hetplan calibrate` measured. One owner for these; `CostModel`'s
methods of the same names call them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from hetplan.cluster import Cluster, Device, Link, LinkOverride
from hetplan.cost import formulas


def host_pairs(cluster: Cluster, senders: Sequence[str], receivers: Sequence[str]) -> tuple[dict, list[float]]:
    """The pairs from `senders` to `receivers` counted by host pair, those with a `links`
    entry and a device to itself left out (so that big groups cost hosts^2, not devices^2),
    and the bandwidths of the `links` entries among them."""
    by_host: dict[str, list[str]] = {}
    for a in senders:
        by_host.setdefault(cluster.device(a).host, []).append(a)
    into: dict[str, list[str]] = {}
    for b in receivers:
        into.setdefault(cluster.device(b).host, []).append(b)
    pairs = {(ha, hb): len(xs) * len(ys) for ha, xs in by_host.items() for hb, ys in into.items()}
    for b in set(senders) & set(receivers):
        pairs[(cluster.device(b).host,) * 2] -= 1
    special: list[float] = []
    if cluster.links:
        s_set, r_set = set(senders), set(receivers)
        for o in cluster.links:
            x, y = o.between
            for a, b in ((x, y), (y, x)) if x != y else ((x, y),):
                if a in s_set and b in r_set:
                    pairs[(cluster.device(a).host, cluster.device(b).host)] -= 1
                    special.append(o.bandwidth_Bps)
    return {k: n for k, n in pairs.items() if n > 0}, special

def slowest_Bps(cluster: Cluster, senders: Sequence[str], receivers: Sequence[str]) -> float:
    """The slowest link's bandwidth from any of `senders` to any of `receivers` (`Cluster.link`)."""
    generic, special = host_pairs(cluster, senders, receivers)
    rates = [cluster.intra_host.bandwidth_Bps if ha == hb else
             cluster._between_hosts.get((ha, hb), cluster.inter_host).bandwidth_Bps for ha, hb in generic]
    return min([*rates, *special], default=math.inf)

def nic_cap_Bps(cluster: Cluster, senders: Sequence[str], receivers: Sequence[str]) -> float:
    """What the hosts' network interfaces carry at once from `senders` to `receivers`: the
    sending hosts' together, and the receiving hosts' together, of the pairs that cross
    hosts (inf when none does)."""
    cross = [(ha, hb) for ha, hb in host_pairs(cluster, senders, receivers)[0] if ha != hb]
    if not cross:
        return math.inf
    out_hosts = {ha for ha, _ in cross}
    in_hosts = {hb for _, hb in cross}
    return min(math.fsum(cluster.nic_Bps(h) for h in out_hosts), math.fsum(cluster.nic_Bps(h) for h in in_hosts))

def cut_Bps(cluster: Cluster, senders: Sequence[str], receivers: Sequence[str]) -> float:
    """The bandwidth of the cut from a stage on `senders` to one on `receivers`
    (`formulas.shared_Bps`: min(k, k') transfers at once at the slowest link, within the
    hosts' network interfaces), as the simulator's interfaces share it when every replica
    sends at once."""
    return formulas.shared_Bps(slowest_Bps(cluster, senders, receivers), min(len(senders), len(receivers)),
                               nic_cap_Bps(cluster, senders, receivers))

def routed_cut_s(cluster: Cluster, senders: Sequence[str], receivers: Sequence[str],
                 sender_weights: Sequence[float] | None = None,
                 receiver_weights: Sequence[float] | None = None) -> float:
    """Seconds to carry one byte of a micro-batch across the cut from a stage on `senders` to
    one on `receivers`, routed as the runtime routes rows: replica p sends to replica q the
    share of the micro-batch their slices have in common (each stage's replicas take
    consecutive slices in proportion to their weights, equal by default: `hetplan.rows`), and
    the transfers share the interfaces they cross (`busiest_interface_s`), none faster than
    its own link. Replicas in line on one host talk inside it: one pipeline per host is as
    fast as its hosts, not as the slowest link between the two stages."""
    pairs = routed_shares(sender_weights or [1.0] * len(senders), receiver_weights or [1.0] * len(receivers))
    share = {(senders[p], receivers[q]): f for (p, q), f in pairs.items() if senders[p] != receivers[q]}
    if not share:
        return 0.0
    alone = max(f / cluster.link(a, b).bandwidth_Bps for (a, b), f in share.items())
    return max(alone, busiest_interface_s(cluster, share))

def busiest_interface_s(cluster: Cluster, pair_bytes: Mapping[tuple[str, str], float]) -> float:
    """How long the busiest interface (`Cluster.interfaces`) is busy carrying `pair_bytes`
    ((sender, receiver) -> bytes), each transfer at its link's bandwidth and taking that much
    of the interface: a lower bound on the time to carry them all, as the simulator's
    interfaces share them; for one pair, bytes / its link's bandwidth."""
    load: dict[tuple[str, str], float] = {}
    for (a, b), nbytes in pair_bytes.items():
        if a == b or nbytes <= 0:
            continue
        rate = cluster.link(a, b).bandwidth_Bps
        for port in cluster.interfaces(a, b):
            # bytes / rate seconds holding min(rate, cap) of the interface's cap: bytes / max(rate, cap)
            cap = cluster.interface_Bps(port)
            load[port] = load.get(port, 0.0) + formulas.wire_s(nbytes, max(rate, cap))
    return max(load.values(), default=0.0)


def routed_shares(sender_weights: Sequence[float], receiver_weights: Sequence[float]) -> dict[tuple[int, int], float]:
    """(p, q) -> the share of a micro-batch that replica p of one stage sends to replica q of the
    next: the overlap of their slices, each stage's replicas taking consecutive slices in
    proportion to their weights (the continuous form of `hetplan.rows.shared_rows`)."""
    def edges(weights: Sequence[float]) -> np.ndarray:
        w = np.asarray(weights, dtype=float)
        return np.concatenate([[0.0], np.cumsum(w / w.sum())])

    a, b = edges(sender_weights), edges(receiver_weights)
    out, q = {}, 0
    for p in range(len(a) - 1):
        while q < len(b) - 1 and b[q + 1] <= a[p]:
            q += 1
        k = q
        while k < len(b) - 1 and b[k] < a[p + 1]:
            overlap = min(a[p + 1], b[k + 1]) - max(a[p], b[k])
            if overlap > 1e-15:
                out[(p, k)] = float(overlap)
            k += 1
    return out


def gpu_links(workers: Sequence[Device], host_link: Link, copies: dict[str, Link], nccl_link: Link | None
              ) -> tuple[LinkOverride, ...]:
    """What `hetplan calibrate` measured, as links: of every pair of workers a GPU worker is in, as
    the run's messages go between them (`Transport.wire`): NCCL between two GPUs where the run
    talks over it (`nccl_link`, or None), else gloo on the host (`host_link`) after a GPU's copy
    to the host and before the other's copy from it (`copies`, by binding), one after the other
    (`formulas.in_series`)."""
    out = []
    for i, a in enumerate(workers):
        for b in workers[i + 1:]:
            ends = [copies[d.binding] for d in (a, b) if d.binding in copies]
            if not ends:
                continue
            if nccl_link is not None and len(ends) == 2:
                link = nccl_link
            else:
                link = Link(*formulas.in_series((x.bandwidth_Bps, x.latency_s) for x in (host_link, *ends)))
            out.append(LinkOverride((a.id, b.id), link.bandwidth_Bps, link.latency_s))
    return tuple(out)
