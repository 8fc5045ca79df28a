"""Planning options, defined once (`hetplan.planners.options.PlanOptions`): the flags of `plan`
and `compare` take their defaults, and the "(default: X)" of their help, from its fields, and
`cli._shared._options` turns the flags back into one; these tests fail if a planning default is
written a second time in the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace

import pytest

from hetplan.cli import _shared, parser
from hetplan.cli.parser import build_parser
from hetplan.errors import HetplanError
from hetplan.planners.options import PlanOptions

NAMES = [f.name for f in fields(PlanOptions)]
# a value for each field whose default is None, to change it to
GIVEN_FOR_NONE = {"microbatches": 4, "budget_s": 5.0, "min_samples_per_s": 1.5, "max_iters": 3, "max_replicas": 2,
                  "max_tp": 2}


def flags(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


def parsed(*argv: str) -> PlanOptions:
    return _shared._options(build_parser().parse_args(["plan", "g.json", "--cluster", "c", *argv]))


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_every_option_is_a_flag_whose_default_is_the_fields(command):
    found = flags(command)
    assert set(NAMES) <= set(found)
    for name in NAMES:
        assert found[name].default == getattr(PlanOptions(), name), name


def test_flags_not_given_give_the_options_defaults_and_given_ones_arrive():
    assert parsed() == PlanOptions()
    assert parsed("--microbatches", "auto") == PlanOptions()
    assert parsed("--microbatches", "4", "--schedule", "gpipe", "--alpha", "0.1", "--max-tp", "2", "--faithful",
                  "--objective", "cost", "--min-samples-per-s", "3") == replace(
        PlanOptions(), microbatches=4, schedule="gpipe", alpha=0.1, max_tp=2, faithful=True, objective="cost",
        min_samples_per_s=3.0)


def _another(name: str, value: object, choices) -> object:
    """A valid value of a field other than `value`."""
    if value is None:
        return GIVEN_FOR_NONE[name]
    if choices:
        return next(c for c in choices if c != value)
    if isinstance(value, bool):
        return not value
    return value / 2 if isinstance(value, float) else value + 1


def test_a_changed_default_changes_the_flags_and_their_help(monkeypatch):
    """Every default of PlanOptions changed at once: each flag follows it, in what it parses to
    and in its help, with no other edit."""
    found = flags("plan")
    changed = replace(PlanOptions(), **{n: _another(n, getattr(PlanOptions(), n), found[n].choices) for n in NAMES})
    assert all(getattr(changed, n) != getattr(PlanOptions(), n) for n in NAMES)
    monkeypatch.setattr(parser, "PLAN", changed)
    assert parsed() == changed
    found = flags("plan")
    for name in NAMES:
        value = getattr(changed, name)
        shown = f"{value:g}" if isinstance(value, float) else value
        assert isinstance(value, bool) or f"(default: {shown})" in found[name].help, name
    assert flags("simulate")["routing"].default == changed.routing


@dataclass(frozen=True)
class WholeTp(PlanOptions):
    max_tp: int = 1


@dataclass(frozen=True)
class AutoTp(PlanOptions):
    max_tp: int | None = 1


def test_max_tp_takes_auto_only_where_the_option_takes_none(monkeypatch):
    monkeypatch.setattr(_shared, "PlanOptions", AutoTp)
    assert parsed("--max-tp", "auto").max_tp is None
    assert parsed("--max-tp", "3").max_tp == 3
    assert parsed().max_tp == PlanOptions().max_tp  # the parser's default, left as it is
    with pytest.raises(HetplanError, match=r"^--max-tp: 'x' is not a whole number \(or auto\)$"):
        parsed("--max-tp", "x")
    monkeypatch.setattr(_shared, "PlanOptions", WholeTp)
    with pytest.raises(HetplanError, match="^--max-tp: auto is not allowed; give a whole number >= 1$"):
        parsed("--max-tp", "auto")
    with pytest.raises(HetplanError, match="^--max-tp: 'x' is not a whole number$"):
        parsed("--max-tp", "x")
    with pytest.raises(HetplanError, match="^--max-tp: 0 must be >= 1$"):
        parsed("--max-tp", "0")
    assert parsed("--max-tp", "2").max_tp == 2


def test_a_parser_made_for_one_command_parses_it_as_the_whole_one_does():
    """`main` makes only the options of the command it is given (`build_parser(command)`): that
    command's help, defaults and parse are the whole parser's, `hetplan --help` lists the same
    commands, and a command line naming no known command gets the whole parser."""
    def sub(p: argparse.ArgumentParser) -> argparse._SubParsersAction:
        return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))

    whole = build_parser()
    assert list(sub(whole).choices) == list(parser.COMMANDS)
    for command in parser.COMMANDS:
        alone = build_parser(command)
        assert alone.format_help() == whole.format_help()
        assert sub(alone).choices[command].format_help() == sub(whole).choices[command].format_help(), command
    argv = ["plan", "g.json", "--cluster", "c", "--microbatches", "4", "--json"]
    assert vars(build_parser(parser.command_named(argv)).parse_args(argv)) == vars(whole.parse_args(argv))
    assert parser.command_named(["--version"]) is None
    assert len(sub(build_parser("no-such-command")).choices["plan"]._actions) > 10  # the whole parser
