"""Device orders for the dynamic program (`hetplan.planners.dp`) and exact search: which devices
are interchangeable, and the sequences of devices along which stages take their replicas.

Every distinct order of the cluster's device classes (devices of one type, host, memory, price
and threads, with no link of their own) when there are at most `MAX_ORDERS`; otherwise orders
that keep types together, two per order of the types (fastest first, ...): hosts one after the
other, and hosts taking turns (so that a stage of k replicas spans k hosts and the next stage's
replicas sit beside them: one pipeline per host), plus for
the cost objective cheapest-per-speed first and, per order of the types, 1, 2, 4, ... devices of
the first type and then the types taken in turn (a plan uses a prefix of an order: so it can take
a few devices of each type).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator

from hetplan.cluster import Cluster

MAX_ORDERS = 24


def device_classes(cluster: Cluster) -> list[list[str]]:
    """Groups of interchangeable devices: same type, host, memory, price and threads, and no
    link of their own."""
    special = {d for o in cluster.links for d in o.between}
    classes: dict[tuple, list[str]] = {}
    for d in cluster.devices:
        key = (d.type, d.host, d.mem_bytes, d.usd_per_hour, d.threads, d.id if d.id in special else "")
        classes.setdefault(key, []).append(d.id)
    return list(classes.values())


def distinct_permutations(items: list) -> Iterator[list]:
    """The distinct orders of a sorted multiset, in lexicographic order (the classic next-
    permutation step), each made in O(n): 16 identical devices have one order, not 16! tuples
    to deduplicate."""
    seq = list(items)
    while True:
        yield list(seq)
        i = len(seq) - 2
        while i >= 0 and seq[i] >= seq[i + 1]:
            i -= 1
        if i < 0:
            return
        j = len(seq) - 1
        while seq[j] <= seq[i]:
            j -= 1
        seq[i], seq[j] = seq[j], seq[i]
        seq[i + 1:] = reversed(seq[i + 1:])


def device_orders(cluster: Cluster, speed: dict[str, float], cheap_first: bool = False,
                  limit: int = MAX_ORDERS) -> list[tuple[str, ...]]:
    """Sequences of all devices: every distinct order of device classes (`device_classes`) when
    there are at most `limit`, else a few orders that keep types and hosts together (and with
    `cheap_first`, the cheapest work first: `Objective.cheap_first`)."""
    classes = {(cluster.device(ids[0]).type, cluster.device(ids[0]).host, k): ids
               for k, ids in enumerate(device_classes(cluster))}  # (type, host, number) -> ids
    counts = Counter({c: len(ids) for c, ids in classes.items()})
    n_orders = math.factorial(sum(counts.values()))
    for c in counts.values():
        n_orders //= math.factorial(c)

    def realise(seq: list[tuple[str, str, int]]) -> tuple[str, ...]:
        taken: dict[tuple[str, str, int], int] = {}
        out = []
        for c in seq:
            out.append(classes[c][taken.get(c, 0)])
            taken[c] = taken.get(c, 0) + 1
        return tuple(out)

    if n_orders <= limit:
        return [realise(s) for s in distinct_permutations(sorted(c for c, k in counts.items() for _ in range(k)))]
    types = sorted({c[0] for c in classes}, key=lambda t: (-speed[t], t))
    type_orders = list(itertools.permutations(types)) if len(types) <= 3 else [tuple(types), tuple(reversed(types))]
    orders = []
    for tord in type_orders:
        seq, across = [], []  # hosts one after the other; and taking turns (one pipeline per host)
        for t in tord:
            queues = [[key] * len(ids) for key, ids in sorted(classes.items(), key=lambda kv: kv[0][1:])
                      if key[0] == t]
            seq += [key for q in queues for key in q]
            across += [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
        orders += [realise(seq)] + ([realise(across)] if across != seq else [])
    if cheap_first:  # cheapest work first: price per unit of speed
        seq = sorted(classes, key=lambda c: (cluster.device(classes[c][0]).usd_per_hour / speed[c[0]], c))
        orders.append(realise([c for c in seq for _ in classes[c]]))
        # k = 1, 2, 4, ... devices of the first type, then the types taken in turn: a plan uses a
        # prefix of an order, and with the types kept together one cheap GPU after eight CPU
        # workers comes only with all eight (parsing on two CPUs, the MLP on a GPU)
        for tord in type_orders:
            queues = [[key for key, ids in sorted(classes.items(), key=lambda kv: kv[0][1:]) if key[0] == t
                       for _ in ids] for t in tord]
            k = 1
            while k < len(queues[0]):
                rest = [*queues[1:], queues[0][k:]]  # the next type right after the k
                orders.append(realise(queues[0][:k] + [q[i] for i in range(max(map(len, rest)))
                                                       for q in rest if i < len(q)]))
                k *= 2
    return list(dict.fromkeys(orders))[:limit]
