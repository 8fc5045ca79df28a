"""hetplan.cost.formulas: the array forms agree with the scalar forms, and no module outside
hetplan.cost writes a cost formula of its own (one owner per formula)."""

import ast
from pathlib import Path

import numpy as np
import pytest

from hetplan.cost import formulas

SRC = Path(__file__).resolve().parents[1] / "src" / "hetplan"
RNG_CASES = 200


@pytest.fixture
def rng():
    return np.random.default_rng(14)


def _bytes(rng, n):
    # zeros included: nothing to send, no parameters
    return np.where(rng.random(n) < 0.2, 0.0, rng.integers(1, 2**34, n).astype(float))


def test_transfer_array_equals_scalar(rng):
    nbytes, bw, lat = _bytes(rng, RNG_CASES), rng.uniform(1e6, 1e12, RNG_CASES), rng.uniform(0, 1e-3, RNG_CASES)
    batched = formulas.transfer_s_array(nbytes, bw, lat)
    for k in range(RNG_CASES):
        assert batched[k] == pytest.approx(formulas.transfer_s(nbytes[k], bw[k], lat[k]), rel=1e-15, abs=0)
    assert formulas.transfer_s(0.0, 1e9, 1e-5) == 0.0
    assert formulas.transfer_s(1e9, 1e9, 1e-5) == pytest.approx(1.0 + 1e-5)


def test_allreduce_array_equals_scalar(rng):
    nbytes, r = _bytes(rng, RNG_CASES), rng.integers(1, 17, RNG_CASES)
    bw, lat = rng.uniform(1e6, 1e12, RNG_CASES), rng.uniform(0, 1e-3, RNG_CASES)
    batched = formulas.allreduce_s_array(nbytes, r, bw, lat)
    for k in range(RNG_CASES):
        assert batched[k] == pytest.approx(formulas.allreduce_s(nbytes[k], int(r[k]), bw[k], lat[k]), rel=1e-15, abs=0)
    # closed form: 4 replicas, 2(r - 1) = 6 steps of a quarter of the bytes each
    assert formulas.allreduce_s(4e9, 4, 1e9, 0.0) == pytest.approx(6.0)
    assert formulas.allreduce_s(4e9, 1, 1e9, 0.0) == 0.0


def test_memory_array_equals_scalar(rng):
    params, acts, share = _bytes(rng, RNG_CASES), _bytes(rng, RNG_CASES), rng.random(RNG_CASES)
    batched = formulas.stage_memory_bytes_array(params, acts, share)
    for k in range(RNG_CASES):
        assert batched[k] == formulas.stage_memory_bytes(params[k], acts[k], share[k])
    assert formulas.stage_memory_bytes(100, 10, 0.5) == 4 * 100 + 5
    assert formulas.activation_room_bytes(1000, 100) == 600


def test_optimizer_and_price_arrays_equal_scalars(rng):
    params, bw = _bytes(rng, RNG_CASES), rng.uniform(1e9, 3e12)
    batched = formulas.optimizer_s(params, bw)
    for k in range(RNG_CASES):
        assert batched[k] == formulas.optimizer_s(params[k], bw)
    assert formulas.optimizer_s(1e9, 7e9) == pytest.approx(1.0)
    usd, step = rng.uniform(0, 50, RNG_CASES), rng.uniform(0, 10, RNG_CASES)
    batched = formulas.usd_per_step(usd, step)
    for k in range(RNG_CASES):
        assert batched[k] == formulas.usd_per_step(usd[k], step[k])
    assert formulas.usd_per_step(3.6, 1000.0) == pytest.approx(1.0)


def _outside_cost():
    for path in sorted(SRC.rglob("*.py")):
        if "cost" not in path.relative_to(SRC).parts[:1]:
            yield path, path.read_text()


def _formula_lines(path: Path, text: str) -> list[str]:
    """Places that write a cost formula: a division by a bandwidth, overheads or a co-running
    factor added or multiplied in (`formulas.replica_passes_s` does that), the weight-copies or
    optimizer-passes constants, seconds per hour."""
    found = []
    segment, name = _segments(text), path.relative_to(SRC)
    for node in ast.walk(ast.parse(text)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right = segment(node.right) or ""
            if any(k in right.lower() for k in ("bandwidth", "_bw", "bps")):
                found.append(f"{where}: bytes / bandwidth: {segment(node)}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult) and not any(
                isinstance(x, ast.Constant | ast.JoinedStr) for x in (node.left, node.right)):  # not text or units
            sides = [segment(x) or "" for x in (node.left, node.right)]
            if any("overhead" in side.lower() or "corun" in side.lower() or side in ("slow",) for side in sides):
                found.append(f"{where}: the runtime's overheads or co-running applied: "
                             f"{segment(node)}")
        if isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in ("WEIGHT_COPIES", "OPTIMIZER_PASSES", "OPTIMIZER_STATE_COPIES", "inflight_microbatches"):
                found.append(f"{where}: {name}")
        if isinstance(node, ast.Constant) and node.value in (3600, 3600.0) and not isinstance(node.value, bool):
            found.append(f"{where}: seconds per hour")
    return found


def _segments(text: str):
    """`ast.get_source_segment` of `text` for any node, the lines split once (it splits the whole
    text again at each call: minutes over the package's every sum and product)."""
    lines = [line.encode() for line in text.splitlines(keepends=True)]

    def segment(node: ast.AST) -> str:
        if getattr(node, "end_lineno", None) is None:
            return ""
        first, last = node.lineno - 1, node.end_lineno - 1
        if first == last:
            return lines[first][node.col_offset:node.end_col_offset].decode()
        parts = [lines[first][node.col_offset:], *lines[first + 1:last], lines[last][:node.end_col_offset]]
        return b"".join(parts).decode()

    return segment


def test_no_cost_formula_outside_the_cost_package():
    found = [line for path, text in _outside_cost() for line in _formula_lines(path, text)]
    # the schedule module owns the count of micro-batches in flight; the cost package uses it
    found = [f for f in found if not f.startswith("schedule.py") or "inflight_microbatches" not in f]
    assert found == []


def test_the_rule_finds_a_formula():
    text = "def f(link, n):\n    return link.latency_s + n / link.bandwidth_Bps + 4 * WEIGHT_COPIES / 3600\n"
    found = _formula_lines(SRC / "x.py", text)
    assert len(found) == 3
    text = "def g(fwd, slow, dev):\n    return fwd * slow + dev.action_overhead_s\n"
    assert len(_formula_lines(SRC / "x.py", text)) == 2  # co-running, then the overhead added


def test_a_replicas_passes_array_equals_scalar(rng):
    """The simulator's replicas (scalars) and the fast path (arrays) take their passes from one
    formula: slowed by co-running, the runtime's cost per action on the fixed parts."""
    whole = rng.uniform(0, 1, (2, RNG_CASES))
    fixed = whole * rng.random((2, RNG_CASES))
    slow, extra = rng.uniform(1, 2, RNG_CASES), rng.uniform(0, 1e-3, RNG_CASES)
    batched = formulas.replica_passes_s(whole[0], whole[1], fixed[0], fixed[1], slow, extra)
    for k in range(RNG_CASES):
        one = formulas.replica_passes_s(whole[0, k], whole[1, k], fixed[0, k], fixed[1, k], slow[k], extra[k])
        assert [b[k] for b in batched] == list(one)
    assert formulas.replica_passes_s(3.0, 5.0, 1.0, 1.0, 2.0, 0.5) == (4.0, 8.0, 2.5, 2.5)
    assert formulas.replica_tail_s(2.0, 1.5, 0.1) == pytest.approx(3.1)


# The simulators put the lowered table (`hetplan.cost.table`: `StepCosts` for the event
# simulator, its array form `ChainCosts` for the fast path) together into a timeline or a step;
# no module of the simulator package computes a cost: of the cost package they import the table,
# the `CostModel` that makes it (whose methods compute) and how a batch splits into micro-batches,
# never a formula.
SIMULATORS = tuple(sorted(str(p.relative_to(SRC)) for p in (SRC / "sim").glob("*.py")))
ALLOWED = ("CostModel", "microbatch_fractions")
TABLES = ("hetplan.cost.table", "hetplan.cost.stage_table")  # the step's table; the table of stage options


def _cost_imports(text: str, tables: tuple[str, ...] = TABLES) -> list[str]:
    """The cost package's modules (and names) a module imports, but the tables and `ALLOWED`."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetplan.cost"):
            if node.module not in tables:
                found += [f"{node.module}.{a.name}" for a in node.names if a.name not in ALLOWED]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("hetplan.cost") and a.name not in tables]
    return found


def test_the_simulators_compute_no_cost_of_their_own():
    assert {"sim/engine.py", "sim/fast.py", "sim/chains.py"} <= set(SIMULATORS)
    found = {name: _cost_imports((SRC / name).read_text()) for name in SIMULATORS}
    assert found == {name: [] for name in SIMULATORS}


def test_the_import_rule_sees_a_formula_imported():
    assert _cost_imports("from hetplan.cost.formulas import transfer_s\nfrom hetplan.cost.table import StepCosts\n"
                         "from hetplan.cost import CostModel, formulas\n") == [
        "hetplan.cost.formulas.transfer_s", "hetplan.cost.formulas"]


# A planner reads a stage's figures from the table of stage options (`hetplan.cost.stage_table`:
# its time, memory, gradient sums, optimizer step, cuts), and a whole plan's from `CostModel`'s
# public methods (a plan's memory per device, its steady state, its rows, its price); the
# per-piece methods of `CostModel` are private to the cost package, and no planner imports a
# formula, the step's table (the simulator's) or another module of the cost package.
PLANNERS = tuple(sorted(str(p.relative_to(SRC)) for p in (SRC / "planners").rglob("*.py")))


def _private_cost_methods() -> set[str]:
    from hetplan.cost import CostModel

    return {name for name in vars(CostModel) if name.startswith("_") and not name.startswith("__")
            and callable(getattr(CostModel, name, None))}


def _planner_violations(path: str, text: str, private: set[str]) -> list[str]:
    found = [f"{path}: imports {name}" for name in _cost_imports(text, ("hetplan.cost.stage_table",))]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"{path}:{node.lineno}: calls CostModel.{node.attr}")
    return found


def test_no_planner_works_out_a_stage_cost_outside_the_table():
    private = _private_cost_methods()
    assert {"_node_times_s", "_gradient_sync_s", "_routed_cut_s", "_optimizer_s"} <= private
    assert {"planners/dp_program.py", "planners/scale.py", "planners/milp.py", "planners/exact.py",
            "planners/rl/heterps.py", "planners/rl/env.py"} <= set(PLANNERS)
    found = [v for name in PLANNERS for v in _planner_violations(name, (SRC / name).read_text(), private)]
    assert found == []


def test_the_planner_rule_fails_on_a_deliberate_violation():
    """A stage's time from the node times, a memory formula, the simulator's table: all found."""
    text = ("from hetplan.cost.formulas import stage_memory_bytes\nfrom hetplan.cost.table import step_costs\n"
            "from hetplan.cost.stage_table import StageTable\nfrom hetplan.cost import CostModel\n"
            "def t(cm, nodes):\n    return sum(cm._node_times_s('a100-40gb')[n][0] for n in nodes)\n")
    found = _planner_violations("planners/x.py", text, _private_cost_methods())
    assert found == ["planners/x.py: imports hetplan.cost.formulas.stage_memory_bytes",
                     "planners/x.py: imports hetplan.cost.table.step_costs",
                     "planners/x.py:6: calls CostModel._node_times_s"]
