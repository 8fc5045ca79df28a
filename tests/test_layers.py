"""The package's modules import each other without a cycle (issue 14, item 5: `cluster.py` was
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


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(path: Path) -> set[str]:
    """Modules a module imports: `from pkg import sub` imports the module pkg.sub (and pkg itself
    only for a name that is not a module of it)."""
    modules = {module_name(p) for p in SRC.rglob("*.py")}
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= subs & modules
            if subs - modules:
                found.add(node.module)
    return {name for name in found if name.startswith("hetplan")}


def import_graph() -> nx.DiGraph:
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in imports_of(path):
            if target in modules and target != name:
                graph.add_edge(name, target)
    return graph


def test_no_import_cycle_among_modules():
    graph = import_graph()
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert cycles == [], cycles[:5]


def test_the_cluster_model_reads_no_files():
    imports = imports_of(SRC / "hetplan" / "cluster.py")
    assert not any(name.startswith("hetplan.io") for name in imports)


# The layers, lowest first (issue 14): a module imports only from its own layer or lower ones.
LAYERS = (
    "hetplan.errors hetplan.units hetplan._frozen hetplan.machine hetplan.schedule hetplan.rows hetplan.catalog",
    "hetplan.graph hetplan.cluster hetplan.plan",
    "hetplan.cost hetplan.io",
    "hetplan.sim hetplan.runtime.support",  # what the runtime can execute: data the planners read
    # the optimizer, which the profiler times, and the host allocator, which it measures with
    "hetplan.planners hetplan.zoo hetplan.profile hetplan.runtime.optim hetplan.runtime.hostmem",
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
