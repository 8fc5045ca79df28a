"""`hetplan plan --explain`: dp's winner and its runners-up as a table (`report.tables.show_explanation`),
one line for the planners that record no explanation, nothing new in `--json`; the report page's section."""

import io
import re

import pytest
from rich.console import Console

from hetplan.io import serde
from hetplan.plan import Estimate, Plan, Stage
from hetplan.report.tables import show_explanation
from hetplan.units import fmt_seconds
from strategies import chain

# every reason `planners.candidates.Candidates.why_lost` gives
LOST = re.compile(r"(time|cost|mdpe|throughput): \+\d+\.\d%|memory: needs .+ on .+, which has .+|runtime: .+"
                  r"|below the throughput floor|infeasible")


def table_rows(out: str) -> list[tuple[str, ...]]:
    """The body rows of the last rich table in `out`, each cell's wrapped lines joined again (a
    row's first line is the one with its rank)."""
    body = out[out.rindex("┡"):].splitlines()[1:]
    rows: list[list[str]] = []
    for line in body:
        if not line.startswith("│"):
            break
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells[0]:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
    return [tuple(r) for r in rows]


def secs(x) -> str:
    return "-" if x is None else fmt_seconds(x)


def expected(explain: dict) -> list[tuple[str, ...]]:
    def row(rank, c, why):
        return (rank, c["source"], c["shape"], str(c["microbatches"]), secs(c["model_s"]), secs(c["fast_s"]),
                secs(c["sim_s"]), why)

    return [row("winner", explain["winner"], "chosen"),
            *(row(str(k), c, c["lost"]) for k, c in enumerate(explain["runners_up"], 1))]


@pytest.fixture
def graph(tmp_path):
    """Eight layers of 1 GiB of weights: dp's winner is polished (it has no fast-path time)."""
    path = tmp_path / "chain.json"
    serde.dump(chain(8, edge_bytes=1 << 20, params=1 << 30, acts=1 << 28), path)
    return path


def test_dp_explains_its_winner_and_why_each_runner_up_lost(cli, graph, tmp_path):
    plan = tmp_path / "plan.json"
    r = cli("plan", graph, "--cluster", "hetero-4", "--explain", "-o", plan)
    assert r.code == 0, r.err
    explain = serde.read_json(plan)["meta"]["dp"]["explain"]
    lines = r.out.splitlines()
    headline = f"dp compared {explain['candidates']} candidates, simulated {explain['simulated']}"
    assert lines[lines.index(headline) + 1].strip() == "why this plan"
    assert lines.index(headline) > lines.index("  feasible: yes (fits in memory)")  # after the plan's table
    rows = table_rows(r.out)
    assert rows == expected(explain)
    assert rows[0][:2] == ("winner", "label program, then polished") and rows[0][-1] == "chosen"
    assert rows[0][5] == "-"  # the polished plan was never on the fast path
    assert len(rows) == 6 and [row[0] for row in rows[1:]] == ["1", "2", "3", "4", "5"]
    for row in rows[1:]:
        assert LOST.fullmatch(row[-1]), row
    assert r.out.rstrip().endswith(f"wrote {plan}")


def test_a_planner_without_an_explanation_says_so_in_one_line(cli, graph):
    r = cli("plan", graph, "--cluster", "hetero-4", "--planner", "uniform", "--explain")
    assert r.code == 0, r.err
    assert r.out.splitlines()[-1] == "the uniform planner records no explanation; dp does"
    assert "why this plan" not in r.out


@pytest.mark.parametrize("planner", ["dp", "uniform"])
def test_with_json_explain_prints_the_plan_alone(cli, graph, planner):
    r = cli("plan", graph, "--cluster", "hetero-4", "--planner", planner, "--explain", "--json")
    assert r.code == 0, r.err
    meta = r.json()["meta"]  # one JSON object, nothing printed after it
    assert ("explain" in meta.get("dp", {})) == (planner == "dp")


def made_plan(step_s: float) -> Plan:
    """A plan whose meta holds a made-up explanation: a winner of the per-type program with no
    model of its own, and one runner-up that ran out of memory."""
    winner = {"source": "per-type program", "shape": "2 x [v100-16gb x8 rc zero1]", "microbatches": 16,
              "model_s": None, "fast_s": 1.2013, "sim_s": 0.9319, "feasible": True}
    loser = {"source": "baseline data-parallel", "shape": "v100-16gb x16", "microbatches": 1, "model_s": 0.5,
             "fast_s": 0.61, "sim_s": 0.0012, "feasible": False,
             "lost": "memory: needs 40.5 GiB on v0, which has 16.0 GiB"}
    est = Estimate(step_s, 1.0, {}, {}, 0.0, {}, 0.0, True)
    return Plan((Stage(("n0",), ("v0",)),), 1, "1f1b", "dp", predicted=est,
                meta={"dp": {"explain": {"winner": winner, "runners_up": [loser], "candidates": 10, "simulated": 12}}})


def shown(plan: Plan) -> list[str]:
    out = io.StringIO()
    show_explanation(Console(file=out, width=140, highlight=False), plan)
    return [line.rstrip() for line in out.getvalue().splitlines()]


def test_the_table_reads_exactly_so():
    """Shapes keep their brackets (not rich markup); a time the candidate lacks is "-"."""
    assert shown(made_plan(0.9319)) == [
        "dp compared 10 candidates, simulated 12",
        "why this plan",
        "┏━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━┳━━━━━━━━┳━━━━━━━━━━━"
        "┳━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┓",
        "┃        ┃                        ┃                             ┃  micro- ┃        ┃   fast ┃           "
        "┃                                  ┃",
        "┃ rank   ┃ source                 ┃ shape                       ┃ batches ┃  model ┃   path ┃ simulated "
        "┃ why it lost                      ┃",
        "┡━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━╇━━━━━━━━╇━━━━━━━━━━━"
        "╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩",
        "│ winner │ per-type program       │ 2 x [v100-16gb x8 rc zero1] │      16 │      - │  1.2 s │    932 ms "
        "│ chosen                           │",
        "│ 1      │ baseline data-parallel │ v100-16gb x16               │       1 │ 500 ms │ 610 ms │    1.2 ms "
        "│ memory: needs 40.5 GiB on v0,    │",
        "│        │                        │                             │         │        │        │           "
        "│ which has 16.0 GiB               │",
        "└────────┴────────────────────────┴─────────────────────────────┴─────────┴────────┴────────┴───────────"
        "┴──────────────────────────────────┘",
    ]


def test_a_winner_changed_after_dp_chose_it_is_said_below_the_table():
    assert shown(made_plan(0.8))[-1] == ("the schedule, recomputation or sharding asked for changed the winner "
                                         "after dp chose it: 800 ms a step, not 932 ms")
    assert shown(made_plan(0.9319))[-1].startswith("└")


def test_the_pages_section_has_the_same_rows_sortable_by_their_values():
    from hetplan.report.page import explain_section

    section = explain_section(made_plan(0.8))
    assert section.startswith('<section id="section-explain"><h2>Why this plan</h2>'
                              "<p>dp compared 10 candidates, simulated 12</p><p>the schedule, recomputation or "
                              "sharding asked for changed the winner after dp chose it: 800 ms a step, not 932 ms</p>")
    assert ('<tr class=""><td data-value="1">1</td><td class="text">baseline data-parallel</td>'
            '<td class="text">v100-16gb x16</td><td data-value="1">1</td><td data-value="0.5">500 ms</td>'
            '<td data-value="0.61">610 ms</td><td data-value="0.0012">1.2 ms</td>'
            '<td class="text">memory: needs 40.5 GiB on v0, which has 16.0 GiB</td></tr>') in section
    assert '<tr class="chosen"><td data-value="0">winner</td>' in section and "<td>-</td>" in section


def test_an_explanation_without_what_the_table_reads_is_left_out():
    """A plan file edited by hand still loads and draws, without the section."""
    from dataclasses import replace

    from hetplan.report.page import explain_section

    good = made_plan(0.9319)
    explain = dict(good.meta["dp"]["explain"])
    for broken in ({"winner": 1}, {**explain, "runners_up": [{"source": "x"}]}, {**explain, "winner": None}, "x"):
        plan = replace(good, meta={"dp": {"explain": broken}})
        assert explain_section(plan) == ""


def test_the_simulators_budget_counts_past_the_best_two():
    """dp simulates its best two candidates by the fast path whatever they take, then others
    within a budget of events (`candidates.EVENTS`): two deep plans that spend more than the
    budget between them leave the budget whole for a third (it was spent, and a 1,024-GPU
    problem's third never simulated)."""
    import numpy as np

    from hetplan.planners.candidates import EVENTS, Candidates
    from hetplan.planners.scoring import Scorer

    class Ranked:  # the fast path's order as given, every plan fitting
        def fast_keys(self, plans):
            return np.arange(len(plans), dtype=float), np.arange(len(plans))

        def fits(self, plan):
            return True

    deep = EVENTS // 4 + 1  # micro-batches of a one-device plan past the budget alone
    plans = [Plan((Stage(("n0",), (f"v{k}",)),), m, "1f1b", "dp") for k, m in enumerate([deep, deep, 2, deep])]
    assert Scorer.events(plans[0]) > EVENTS
    found = Candidates(Ranked())
    found.add(plans, "test")
    assert found.simulated() == plans[:3]
