"""What the policies see: features of the units of a graph and of the cluster's devices.

- Hierarchical placer (Mirhoseini et al. 2018): each operation is described by its type, its
  output size and its neighbours; here a unit gets the share of each operator type among its
  nodes, its Z-scored log output bytes, Z-scored time and Z-scored log parameter bytes, and its
  position in the order.
- Trinity (Zeng et al. 2022): Z-scored runtime, a Node2vec structure embedding, the operator
  type vocabulary and the output size. Node2vec (Grover and Leskovec, KDD 2016) is a skip-gram
  over second-order biased random walks (return parameter p, in-out parameter q). The walks are
  a few lines of numpy below (the `node2vec` package pins numpy < 2); the skip-gram is gensim's
  Word2Vec, with one worker and a fixed hash so that the embedding is the same on every run.
"""

from __future__ import annotations

import zlib

import numpy as np

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.cost.stage_table import StageTable
from hetplan.graph import Graph


def _z(x: np.ndarray) -> np.ndarray:
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else np.zeros_like(x)


def _per_unit(values: np.ndarray, starts: np.ndarray, how: str = "sum") -> np.ndarray:
    sums = np.add.reduceat(values, starts[:-1], axis=0)
    if how == "mean":
        sums = sums / np.diff(starts).reshape((-1,) + (1,) * (values.ndim - 1))
    return sums


def node_times(graph: Graph, cluster: Cluster) -> np.ndarray:
    """Forward + backward time of each node (topological order) on the cluster's fastest type."""
    cm = CostModel(graph, cluster)
    table = StageTable.of_chain(cm)
    return table.node_s(table.type_kind(cm.fastest_type()))


def op_vocabulary(graph: Graph, starts: np.ndarray) -> np.ndarray:
    """(U, ops) share of each operator type among a unit's nodes."""
    ops = sorted({n.op for n in graph.nodes})
    index = {op: k for k, op in enumerate(ops)}
    by_id = graph.by_id
    onehot = np.zeros((len(graph.topo_order), len(ops)))
    for i, v in enumerate(graph.topo_order):
        onehot[i, index[by_id[v].op]] = 1.0
    return _per_unit(onehot, starts, "mean")


def hierarchical_features(graph: Graph, cluster: Cluster, starts: np.ndarray) -> np.ndarray:
    """Unit features for the Hierarchical placer / TAPP policy (see the module docstring)."""
    by_id = graph.by_id
    order = graph.topo_order
    out = np.array([by_id[v].out_bytes for v in order], dtype=float)
    params = np.array([by_id[v].param_bytes for v in order], dtype=float)
    u = len(starts) - 1
    cols = [
        op_vocabulary(graph, starts),
        _z(np.log1p(_per_unit(out, starts)))[:, None],
        _z(_per_unit(node_times(graph, cluster), starts))[:, None],
        _z(np.log1p(_per_unit(params, starts)))[:, None],
        (np.arange(u) / max(u - 1, 1))[:, None],
    ]
    return np.concatenate(cols, axis=1).astype(np.float32)


def _stable_hash(text: str) -> int:
    # gensim seeds each word's vector with hashfxn(word + seed); Python's hash() of a str changes
    # between processes (PYTHONHASHSEED), which would make the embedding differ run to run
    return zlib.crc32(text.encode())


def node2vec_walks(graph: Graph, rng: np.random.Generator, walks_per_node: int = 10, length: int = 20,
                   p: float = 1.0, q: float = 0.5) -> list[list[str]]:
    """Second-order biased random walks on the undirected graph (Grover and Leskovec 2016): from
    t to v, the next node x is weighted 1/p if x == t, 1 if x is a neighbour of t, 1/q otherwise."""
    nbrs: dict[str, list[str]] = {n.id: [] for n in graph.nodes}
    for e in graph.edges:
        nbrs[e.src].append(e.dst)
        nbrs[e.dst].append(e.src)
    sets = {v: set(ns) for v, ns in nbrs.items()}
    walks = []
    nodes = graph.topo_order
    for _ in range(walks_per_node):
        for start in rng.permutation(len(nodes)):
            walk = [nodes[start]]
            while len(walk) < length:
                cur = walk[-1]
                options = nbrs[cur]
                if not options:
                    break
                if len(walk) == 1:
                    walk.append(options[int(rng.integers(len(options)))])
                    continue
                prev = walk[-2]
                w = np.array([1.0 / p if x == prev else (1.0 if x in sets[prev] else 1.0 / q) for x in options])
                walk.append(options[int(rng.choice(len(options), p=w / w.sum()))])
            walks.append(walk)
    return walks


def node2vec_embedding(graph: Graph, dims: int = 16, seed: int = 0) -> np.ndarray:
    """(nodes, dims) Node2vec embedding in topological order (gensim skip-gram, one worker)."""
    from gensim.models import Word2Vec

    walks = node2vec_walks(graph, np.random.default_rng(seed))
    model = Word2Vec(walks, vector_size=dims, window=5, min_count=1, sg=1, workers=1, seed=seed, epochs=5,
                     hashfxn=_stable_hash)
    return np.array([model.wv[v] for v in graph.topo_order], dtype=np.float32)


def trinity_features(graph: Graph, cluster: Cluster, starts: np.ndarray, seed: int = 0,
                     dims: int = 16) -> np.ndarray:
    """Unit features of Trinity's partition network: Z-scored runtime, Node2vec embedding (mean
    over the unit's nodes), operator type vocabulary, Z-scored log output size."""
    by_id = graph.by_id
    out = np.array([by_id[v].out_bytes for v in graph.topo_order], dtype=float)
    cols = [
        _z(_per_unit(node_times(graph, cluster), starts))[:, None],
        _per_unit(node2vec_embedding(graph, dims, seed), starts, "mean"),
        op_vocabulary(graph, starts),
        _z(np.log1p(_per_unit(out, starts)))[:, None],
    ]
    return np.concatenate(cols, axis=1).astype(np.float32)


def device_features(graph: Graph, cluster: Cluster) -> np.ndarray:
    """(D, 3) per device: relative speed on this graph, log memory and price, Z-scored."""
    cm = CostModel(graph, cluster)
    total = {t: cm.whole_graph_s(t) for t in {d.type for d in cluster.devices}}
    speed = np.array([1.0 / max(total[d.type], 1e-30) for d in cluster.devices])
    mem = np.log(np.array([d.mem_bytes for d in cluster.devices], dtype=float))
    usd = np.array([d.usd_per_hour for d in cluster.devices])
    return np.stack([_z(np.log(speed)), _z(mem), _z(usd)], axis=1).astype(np.float32)
