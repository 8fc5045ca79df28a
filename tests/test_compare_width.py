"""`hetplan compare` in a narrow terminal: every number whole, the best row marked."""

import io
import math
import re

import pytest
from rich.console import Console

from hetplan.io.clusters import load_cluster
from hetplan.planners import PLANNERS, RL_PLANNERS, PlanOptions
from hetplan.planners.compare import compare
from hetplan.report import tables
from strategies import chain

NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]\d+)?")
SCALES = (1.0, 1e-3, 1e-6, 1e-9)  # s, ms, us, ns: whichever unit the step column is in


@pytest.fixture(scope="module")
def comparison():
    """Millisecond steps, prices of about 1e-4 $ per 1,000 samples and long planner names: the cells
    that were cut at 80 columns. exact refuses (too many plans), so one row has no plan."""
    graph = chain(40, fwd=2e-5, bwd=4e-5, edge_bytes=2**20, params=2**22, acts=2**20, batch=16)
    cluster = load_cluster("hetero-4")
    names = [n for n in PLANNERS if n not in RL_PLANNERS]
    return graph, cluster, compare(graph, cluster, names, PlanOptions(max_iters=20))


def render(comparison, width: int) -> str:
    graph, cluster, result = comparison
    console = Console(width=width, record=True, file=io.StringIO())
    tables.show_comparison(console, result, graph, cluster)
    return console.export_text()


def row_of(text: str, planner: str) -> str:
    """The table line of `planner`: its name first, after the border or indent and the best-row
    marker (a wrapped note under the table starts at the margin: "dp or local-search ...")."""
    rows = [line for line in text.splitlines()
            if re.match(rf"(?:[\s│┃]+\*?|\*)\s*{re.escape(planner)}\s", line)]
    assert len(rows) == 1, (planner, rows, text)
    return rows[0]


def shows_step(row: str, step_s: float, scale: float) -> bool:
    """Some number of the row is the step time in the unit `scale`, to the 3 digits shown."""
    return any(math.isclose(float(n.replace(",", "")) * scale, step_s, rel_tol=6e-3) for n in NUMBER.findall(row))


@pytest.mark.parametrize("width", [80, 120])
def test_comparison_fits_the_terminal_with_every_number_whole(comparison, width):
    _, _, result = comparison
    text = render(comparison, width)
    assert max(len(line) for line in text.splitlines()) <= width, text
    assert "…" not in text, text
    best = result.best.planner
    assert "*" in row_of(text, best), text
    assert all("*" not in row_of(text, r.planner) for r in result.rows if r.planner != best), text
    planned = [r for r in result.rows if r.plan is not None]
    assert len(planned) >= 7 and any(r.plan is None for r in result.rows)
    scales = [s for s in SCALES if all(shows_step(row_of(text, r.planner), r.plan.predicted.step_s, s)
                                       for r in planned)]
    assert scales, text


def test_wide_terminal_keeps_every_column_and_narrow_one_says_what_it_left_out(comparison):
    wide = render(comparison, 160)
    for header in ("planning", "memory", "baselines", "stages"):
        assert header in wide, wide
    narrow = render(comparison, 80)
    assert "planning" in narrow and "--json" in narrow, narrow


def test_very_narrow_terminal_still_cuts_no_number(comparison):
    text = render(comparison, 60)
    assert max(len(line) for line in text.splitlines()) <= 60, text
    assert "…" not in text, text
