"""The package's modules import each other without a cycle (`cluster.py` was
both the data model and the file loader, and `cluster <-> io.serde` went round through imports
inside functions). Every import counts, at the top or inside a function, except those under
`if TYPE_CHECKING:`, which never run."""

import ast
from pathlib import Path

import networkx as nx

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST, types: bool = False):
    """Every node but those under `if TYPE_CHECKING:` (with `types`, those too)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not types and isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(path: Path, types: bool = False) -> set[str]:
    """Modules a module imports: `from pkg import sub` imports the module pkg.sub (and pkg itself
    only for a name that is not a module of it); with `types`, for type hints alone too."""
    modules = {module_name(p) for p in SRC.rglob("*.py")}
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text()), types):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= subs & modules
            if subs - modules:
                found.add(node.module)
    return {name for name in found if name.startswith("hetplan")}


def import_graph(types: bool = False) -> nx.DiGraph:
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in imports_of(path, types):
            if target in modules and target != name:
                graph.add_edge(name, target)
    return graph


def test_no_import_cycle_among_modules():
    graph = import_graph()
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert cycles == [], cycles[:5]


def test_no_two_modules_import_each_other_even_for_types():
    """Two modules that name each other's types depend on each other as much as two that call
    each other: what one checks of the other's data belongs with that data."""
    graph = import_graph(types=True)
    pairs = {tuple(sorted((a, b))) for a, b in graph.edges if graph.has_edge(b, a)}
    assert pairs == set(), pairs


def test_the_pair_rule_sees_imports_for_types(tmp_path):
    hints = tmp_path / "hints.py"
    hints.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from hetplan.plan import Plan\n")
    assert imports_of(hints, types=True) == {"hetplan.plan"} and imports_of(hints) == set()


def test_the_cluster_model_reads_no_files():
    imports = imports_of(SRC / "hetplan" / "cluster.py")
    assert not any(name.startswith("hetplan.io") for name in imports)


# The layers, lowest first: a module imports only from its own layer or lower ones.
LAYERS = (
    "hetplan.errors hetplan.units hetplan._frozen hetplan.machine hetplan.forked hetplan.schedule hetplan.rows "
    "hetplan.sync hetplan.catalog hetplan.precision",
    "hetplan.node hetplan.graph hetplan.cluster hetplan.plan hetplan.tp hetplan.lowering",
    "hetplan.cost hetplan.io",
    # what the runtime can execute (data the planners read); timelines, which the simulator
    # predicts, the runtime records and the report draws; the step cut into pieces, which the
    # profiler times and the runtime trains
    "hetplan.sim hetplan.runtime.support hetplan.timeline hetplan.pieces",
    "hetplan.planners hetplan.zoo hetplan.profile hetplan.availability",
    "hetplan.runtime hetplan.report",
    "hetplan.demo hetplan.cli hetplan.__main__ hetplan",
)


def layer_of(module: str) -> int:
    """The layer of the longest prefix in LAYERS that names the module."""
    found = [(len(p), k) for k, names in enumerate(LAYERS) for p in names.split()
             if module == p or module.startswith(p + ".")]
    assert found, f"{module} is in no layer: add it to LAYERS"
    return max(found)[1]


def test_no_module_reaches_up_a_layer():
    up = [f"{a} -> {b}" for a, b in import_graph().edges if layer_of(b) > layer_of(a)]
    assert up == []


def test_the_layer_rule_sees_an_upward_import():
    assert layer_of("hetplan.cost.formulas") < layer_of("hetplan.sim.engine") < layer_of("hetplan.cli.parser")
    assert layer_of("hetplan.runtime.support") < layer_of("hetplan.planners.dp") < layer_of("hetplan.runtime.rank")


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def both_ways(edges) -> list[str]:
    """The pairs of packages that import each other, from module-level import edges."""
    pairs = {(package_of(a), package_of(b)) for a, b in edges if package_of(a) != package_of(b)}
    return sorted(f"{a} <-> {b}" for a, b in pairs if (b, a) in pairs and a < b)


def test_no_two_packages_import_each_other():
    """Within a layer too: what two packages share (the Gantt chart and the stage times, the cut
    and the optimizer) lives below both (`hetplan.timeline`, `hetplan.pieces`), so neither
    imports the other."""
    assert both_ways(import_graph().edges) == []


def test_the_package_rule_sees_imports_both_ways():
    old = [("hetplan.runtime.run", "hetplan.report.gantt"), ("hetplan.report.sources", "hetplan.runtime.run"),
           ("hetplan.runtime.rank", "hetplan.runtime.stages"), ("hetplan.cli", "hetplan.report.page")]
    assert both_ways(old) == ["hetplan.report <-> hetplan.runtime"]


def tracker_numbers(paths) -> list[str]:
    """Lines that name an issue by its number: the word, in the singular or plural, then a number,
    with or without "#" (`test_the_tracker_rule_sees_an_issue_named`)."""
    import re

    return [f"{p.name}:{i}" for p in paths for i, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\b[Ii]ssues? #?\d+", line)]


def test_code_names_no_tracker_numbers():
    """Comments, docstrings and test names say why, not which issue asked: the history is in git
    and the notes. The package, its tests and the benchmarks."""
    root = SRC.parent
    assert tracker_numbers(p for d in (SRC, root / "tests", root / "bench") for p in d.rglob("*.py")) == []


def test_the_tracker_rule_sees_an_issue_named(tmp_path):
    code = tmp_path / "m.py"
    word = "issue"  # not spelt with a number here, which the rule would find in this file
    code.write_text(f'"""Faithful profiles ({word}s 3 and 15)."""\nx = 1  # see {word} #4\n{word}d = 2\n')
    assert tracker_numbers([code]) == ["m.py:1", "m.py:2"]
