"""`hetplan report`: the page of a plan, run, comparison or demo (`hetplan.report.page`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetplan.cli._shared import _console, _emit_json
from hetplan.io import serde


def default_output(path: Path) -> Path:
    """report.html inside a folder, else the file's name with .html."""
    return path / "report.html" if path.is_dir() else path.with_suffix(".html")


def cmd_report(args: argparse.Namespace) -> int:
    from hetplan.report.page import write_page
    from hetplan.report.sources import load_report

    path = Path(args.path)
    out = args.output or default_output(path)
    serde.check_output(out, [path])
    data = load_report(path, args.graph, args.cluster)
    write_page(data, out)
    size = out.stat().st_size
    if args.json:
        _emit_json({"kind": "report", "of": data.kind, "output": str(out), "bytes": size})
        return 0
    _console().print(f"wrote {out} ({size / 1e6:.1f} MB): the {data.kind} page of {path}; open it in a browser "
                     "(it needs no network)")
    return 0
