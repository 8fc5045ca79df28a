"""Run settings, defined once (`hetplan.runtime.settings.RunSettings`): the CLI's flags, the
library's `run_plan`, RUN.json and the workers all go through it; these tests fail if a setting
is defined a second time somewhere else."""

import argparse
import inspect
from dataclasses import fields
from pathlib import Path

from hetplan.cli.parser import build_parser
from hetplan.runtime.launch import run_spec
from hetplan.runtime.settings import DEFAULTS, FLAG_FIELDS, LIBRARY_ONLY, RunSettings
from hetplan.runtime.spec import RunSpec

NAMES = [f.name for f in fields(RunSettings)]


def run_flags() -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["run"]._actions}


def test_every_setting_is_a_flag_of_hetplan_run_with_no_default_of_its_own():
    flags = run_flags()
    by_field = {FLAG_FIELDS.get(dest, dest): a for dest, a in flags.items()}
    assert set(NAMES) - set(LIBRARY_ONLY) <= set(by_field)
    for name in set(NAMES) - set(LIBRARY_ONLY):
        default = by_field[name].default
        # a flag's default is None (then RunSettings' applies), or RunSettings' own
        assert default in (None, False) or default == getattr(DEFAULTS, name), name


def test_flags_not_given_take_the_settings_defaults_and_given_ones_arrive():
    parser = build_parser()
    args = parser.parse_args(["run", "p.json", "--model", "mlp"])
    assert RunSettings.from_args(args) == DEFAULTS
    args = parser.parse_args(["run", "p.json", "--model", "mlp", "--steps", "3", "--block-class", "Block", "--out",
                              "elsewhere", "--checkpoint-dir", "ck", "--resume", "--lr", "0.5"])
    assert RunSettings.from_args(args) == RunSettings(steps=3, block_classes=("Block",), out_dir=Path("elsewhere"),
                                                      checkpoint_dir=Path("ck"), resume=True, lr=0.5)


def test_the_spec_and_the_launcher_hold_settings_only_in_run_settings():
    """RUN.json keeps the settings in one object, and neither `RunSpec` nor `run_spec` takes a
    setting of its own (a second definition of it)."""
    assert not set(NAMES) & {f.name for f in fields(RunSpec)}
    assert not set(NAMES) & set(inspect.signature(run_spec).parameters)
    changed = RunSettings(steps=3, batch_size=8, granularity="layer", block_classes=["B"], out_dir="o",
                          checkpoint_dir="c", resume_step=2)
    assert RunSettings.from_dict(changed.to_dict()) == changed
    assert RunSettings.from_dict({"steps": None, "unknown": 1}) == DEFAULTS


def test_settings_out_of_range_are_refused_when_made_not_when_a_worker_reads_them():
    """The library's callers and the CLI alike: a run whose settings cannot train is refused
    when the settings are made, before any worker starts (each value once; the defaults pass)."""
    import math

    import pytest

    from hetplan.errors import HetplanError

    for bad in ({"steps": 0}, {"steps": -3}, {"warmup": -1}, {"lr": math.nan}, {"lr": -1.0}, {"lr": 0},
                {"lr": math.inf}, {"timeout_s": 0.0}, {"timeout_s": math.nan}, {"checkpoint_every": -1},
                {"steps": 2.5}, {"seed": 1.5}, {"lr": True}):
        with pytest.raises(HetplanError, match="--"):
            RunSettings(**bad)
    assert RunSettings(steps=1, warmup=0, lr=1e-9, timeout_s=1e-3).problem() is None
