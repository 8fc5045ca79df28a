"""Import the per-layer profiles that PipeDream's profiler writes (`graph.txt`).

PipeDream (Narayanan et al., SOSP 2019; msr-fiddle/pipedream) writes one line per node (shown
here on two) and one per edge:

    node11 -- MaxPool2d(kernel_size=2, ...) -- forward_compute_time=2.211, backward_compute_time=2.788,
        activation_size=205520896.000, parameter_size=0.000
    <tab>node10 -- node11

Times are milliseconds for the whole batch, sizes are bytes (a list of sizes for a node with
several outputs). The output activation of a node is what its out-edges carry, and PipeDream's
optimizer also counts it as the activation a stage stashes for backward, so both `out_bytes`
and `act_bytes` take it. The `Input` node's forward
time is PipeDream's data-loading time. PipeDream's optimizer (`optimizer_graph_hierarchical.py`)
zeroes every `Input` node's times and stashed size before it plans ("the optimizer shouldn't really get a
choice with where to place the input"): `input_time="zero"` does the same, `"keep"` (the default,
as earlier versions did) counts loading as work of the first stage. Either way the node is
marked `is_input`.

The file does not record the batch size. For image models it is read off the input node: a
batch of B x 3 x H x W fp32 images, H = W one of the usual sizes (224 first, then 299 for
Inception, ...); otherwise the caller must give it.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from hetplan.catalog import catalog_names, find
from hetplan.errors import GraphError, InputError
from hetplan.graph import Edge, Graph, Node

DEFAULT_DEVICE_TYPE = "v100-16gb"  # PipeDream's published profiles were taken on V100s
# square image sides of common vision models, most common first: ImageNet's 224, Inception's 299,
# AlexNet's 227, then others; the first that divides the input's bytes into B x 3 x H x H fp32 wins
IMAGE_SIDES = (224, 299, 227, 256, 331, 320, 384, 512, 240, 260, 300, 380, 456, 528, 600, 32, 28, 64, 96, 128)
INPUT_TIMES = ("keep", "zero")

_NODE = re.compile(r"^(?P<id>\S+) -- (?P<desc>.*) -- (?P<attrs>\w+=.*)$")
_EDGE = re.compile(r"^\t(?P<src>\S+) -- (?P<dst>\S+)\s*$")
_OP = re.compile(r"^[A-Za-z_][\w.]*")
_ATTRS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


def _attrs(text: str, where: str) -> dict[str, float]:
    """`key=value` pairs. A node with several outputs (an LSTM's output and state) has its
    activation size as a list, `[6291456.0; 131072.0; 131072.0]`: the outputs travel together,
    so their sizes add up."""
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, raw = part.strip().partition("=")
        if not sep:
            raise InputError(f"{where}: expected key=value, got {part.strip()!r}")
        raw = raw.strip()
        items = raw[1:-1].split(";") if raw.startswith("[") and raw.endswith("]") else [raw]
        try:
            values[key] = sum(float(item) for item in items)
        except ValueError:
            raise InputError(f"{where}: {key} is {raw!r}, not a number") from None
    missing = [a for a in _ATTRS if a not in values]
    if missing:
        raise InputError(f"{where}: missing {', '.join(missing)}")
    return values


def infer_batch_size(input_activation_bytes: float) -> int | None:
    """The batch size of a B x 3 x H x H fp32 image input of this many bytes (H the first of
    `IMAGE_SIDES` that fits), or None if it is not one."""
    n = int(input_activation_bytes)
    if n <= 0 or n != input_activation_bytes:
        return None
    for side in IMAGE_SIDES:
        if n % (3 * side * side * 4) == 0:
            return n // (3 * side * side * 4)
    return None


def parse_pipedream(
    text: str,
    *,
    source: str = "graph.txt",
    name: str | None = None,
    device_type: str = DEFAULT_DEVICE_TYPE,
    batch_size: int | None = None,
    input_time: str = "keep",
) -> Graph:
    """Parse the text of a PipeDream `graph.txt` into a `Graph` (times in seconds); `input_time`
    `zero` drops the Input nodes' loading time, as PipeDream's optimizer does."""
    if input_time not in INPUT_TIMES:
        raise InputError(f"--input-time: {input_time!r} is unknown (allowed: {', '.join(INPUT_TIMES)})")
    if find(device_type) is None:  # the cost model projects from the profiled type's catalog figures
        raise InputError(f"--device-type {device_type!r}: not a device type hetplan knows; give the one the profile "
                         f"was taken on, of {', '.join(catalog_names())} (cpu-Nt for N threads)")
    nodes, edges = _read_lines(text, source, device_type)
    if input_time == "zero":
        # as PipeDream's optimizer: no time and nothing stashed; its output still travels if a
        # plan puts its consumers on other devices (PipeDream keeps it with them)
        nodes = [replace(n, fwd_s={t: 0.0 for t in n.fwd_s}, bwd_s={t: 0.0 for t in n.bwd_s}, act_bytes=0)
                 if n.is_input else n for n in nodes]
    if not nodes:
        raise InputError(f"{source}: no node lines; is this a PipeDream graph.txt?")
    graph_edges = _graph_edges(edges, nodes, source)
    _check_whole(nodes, graph_edges, source)
    if batch_size is None:
        batch_size = _batch_size(nodes, source)
    try:
        return Graph(
            name=name or "pipedream",
            nodes=tuple(sorted(nodes, key=_natural)),
            edges=tuple(graph_edges),
            batch_size=batch_size,
            profiled_on=device_type,
            source=f"pipedream:{source}",
        )
    except GraphError as exc:
        raise InputError(f"{source}: {exc}") from None


def _read_lines(text: str, source: str, device_type: str) -> tuple[list[Node], list[tuple[int, str, str]]]:
    """The nodes of the file, and its edges as (line number, source node, destination node)."""
    nodes: list[Node] = []
    lines_of: dict[str, int] = {}
    edges: list[tuple[int, str, str]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        where = f"{source}:{lineno}"
        if not line.strip():
            continue
        edge = _EDGE.match(line)
        if edge:
            edges.append((lineno, edge["src"], edge["dst"]))
            continue
        node = _NODE.match(line)
        if not node:
            shown = line if len(line) <= 80 else line[:77] + "..."
            raise InputError(
                f"{where}: expected 'nodeN -- Layer(...) -- forward_compute_time=..., ...' or "
                f"'<tab>nodeA -- nodeB', got {shown!r}"
            )
        if node["id"] in lines_of:
            raise InputError(f"{where}: node {node['id']!r} is already defined on line {lines_of[node['id']]}")
        lines_of[node["id"]] = lineno
        nodes.append(_node(node, where, device_type))
    return nodes, edges


def _node(node: re.Match[str], where: str, device_type: str) -> Node:
    """The node of a matched node line."""
    values = _attrs(node["attrs"], where)
    desc = node["desc"].strip()
    op_match = _OP.match(desc)
    op = op_match[0] if op_match else desc
    is_input = re.fullmatch(r"Input\d*", op) is not None
    try:
        return Node(
            id=node["id"],
            op="Input" if is_input else op,
            fwd_s={device_type: values["forward_compute_time"] / 1e3},
            bwd_s={device_type: values["backward_compute_time"] / 1e3},
            param_bytes=int(values["parameter_size"]),
            out_bytes=int(values["activation_size"]),
            act_bytes=int(values["activation_size"]),
            is_input=is_input,
        )
    except GraphError as exc:
        raise InputError(f"{where}: {exc}") from None


def _graph_edges(edges: list[tuple[int, str, str]], nodes: list[Node], source: str) -> list[Edge]:
    """The edges, each carrying its source node's output; refuses unknown nodes and repeats."""
    out_bytes = {n.id: n.out_bytes for n in nodes}
    seen: dict[tuple[str, str], int] = {}
    graph_edges: list[Edge] = []
    for lineno, src, dst in edges:
        for end in (src, dst):
            if end not in out_bytes:
                raise InputError(
                    f"{source}:{lineno}: edge {src} -- {dst} names node {end!r}, which the file does not define"
                )
        if (src, dst) in seen:
            raise InputError(f"{source}:{lineno}: edge {src} -- {dst} repeats line {seen[(src, dst)]}")
        seen[(src, dst)] = lineno
        graph_edges.append(Edge(src, dst, out_bytes[src]))
    return graph_edges


def _check_whole(nodes: list[Node], edges: list[Edge], source: str) -> None:
    """Refuse a file cut short (a copy that stopped early drops its last edge lines, and what is
    left still parses): in a whole profile one node that does work has no edge out, the last
    (the loss's input); others without one are outputs nothing reads, which cost nothing
    (GNMT's unused LSTM states)."""
    has_out = {e.src for e in edges}
    ends = [n.id for n in nodes if n.id not in has_out and sum(n.fwd_s.values()) + sum(n.bwd_s.values()) > 0]
    if len(ends) > 1:
        raise InputError(f"{source}: {len(ends)} nodes that compute ({', '.join(ends[:3])}"
                         f"{', ...' if len(ends) > 3 else ''}) have no edge out, where a whole profile has one, the "
                         "last; the file looks cut short or edited: copy the whole graph.txt the profiler wrote")


def _batch_size(nodes: list[Node], source: str) -> int:
    """The batch size read off the input nodes (ImageNet-sized image batches only)."""
    inputs = [n for n in nodes if n.is_input]
    guesses = {infer_batch_size(n.out_bytes) for n in inputs}
    if len(guesses) == 1 and None not in guesses:
        return guesses.pop()
    raise InputError(
        f"{source}: cannot tell the batch size (the input is not a batch of B x 3 x H x H fp32 images "
        f"with H one of {', '.join(map(str, IMAGE_SIDES[:4]))}, ...); pass it with --batch-size N"
    )


def _natural(node: Node) -> tuple[int, str]:
    """PipeDream lists nodes in no particular order; sort them by their number (node1, node2,
    ..., node10) so that `Graph.topo_order`, which keeps the listed order where it can,
    follows the model from input to output."""
    digits = re.sub(r"\D", "", node.id)
    return (int(digits) if digits else 0, node.id)


def import_pipedream(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    device_type: str = DEFAULT_DEVICE_TYPE,
    batch_size: int | None = None,
    input_time: str = "keep",
) -> Graph:
    """Read a PipeDream `graph.txt`. The graph is named after its folder (`resnet50`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the file ({exc})") from None
    default_name = path.parent.name if path.name == "graph.txt" and path.parent.name else path.stem
    return parse_pipedream(text, source=str(path), name=name or default_name,
                           device_type=device_type, batch_size=batch_size, input_time=input_time)
