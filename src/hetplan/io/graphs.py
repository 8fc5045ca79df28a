"""Reading a graph file (hetplan's JSON) for the library and the CLI alike."""

from __future__ import annotations

import os
from pathlib import Path

from hetplan.errors import InputError
from hetplan.graph import Graph
from hetplan.io import serde


def refuse_pipedream_text(path: Path) -> None:
    """A PipeDream profile given where a graph is wanted: say how to import it."""
    if path.suffix == ".txt" and path.is_file():
        raise InputError(f"{path}: looks like a PipeDream profile; import it first with "
                         f"'hetplan import pipedream {path} -o graph.json'")


def load_graph(ref: str | os.PathLike) -> Graph:
    """A graph from a file written by `hetplan profile` or `hetplan import` (or `serde.dump`)."""
    path = Path(ref)
    refuse_pipedream_text(path)
    return serde.load(path, expect="graph")
