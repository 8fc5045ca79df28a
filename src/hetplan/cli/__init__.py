"""The `hetplan` command: a thin layer over the library.

Every command takes `--json` and then prints exactly one JSON object on stdout. Bad input ends
with one line on stderr and exit status 2 (see `hetplan.errors`).

`parser` builds the command line; the commands are in `describe` (info, import, catalog),
`planning` (plan, compare, simulate), `running` (run, calibrate, demo) and `profiling` (profile).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hetplan.cli._shared import load_any
from hetplan.cli.parser import DESCRIPTION, build_parser, command_named
from hetplan.errors import HetplanError
from hetplan.io import serde

__all__ = ["DESCRIPTION", "build_parser", "load_any", "main"]


def _check_outputs(args: argparse.Namespace) -> None:
    """Every file a command will write is a regular file or a new path, and none of its inputs,
    checked before any work (`serde.check_output`), so that a refused command changes nothing."""
    inputs = [getattr(args, k, None) for k in ("path", "plan", "graph", "cluster", "target")]
    inputs = [i for i in inputs if isinstance(i, str | Path) and Path(i).exists()]  # a preset is a name
    # (`run --trace` is a switch, not a file: only paths count)
    outputs = [o for o in (getattr(args, k, None) for k in ("output", "gantt", "trace")) if isinstance(o, str | Path)]
    curve = getattr(args, "curve", None)
    if curve:
        outputs += [f"{curve}.csv", f"{curve}.png"]
    for out in outputs:
        if out:
            serde.check_output(out, inputs)
            serde.check_output_dir(Path(out).parent, f"{Path(out).name}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_named(argv))
    args = parser.parse_args(argv)
    args.notes, args.warnings = [], []
    try:
        _check_outputs(args)
        code = args.func(args)
        for warning in args.warnings:
            print(f"hetplan: warning: {warning}", file=sys.stderr)
        for note in args.notes:
            print(f"hetplan: note: {note}", file=sys.stderr)
        return code
    except HetplanError as exc:
        print(f"hetplan: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file the command reads or writes, failing where no check foresaw it
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"hetplan: error: {where}{exc.strerror or exc}; check the path, its permissions and the free space",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP during a run (runtime.supervise.Stopped)
        print(f"hetplan: {exc or 'interrupted'}", file=sys.stderr)
        return 130
