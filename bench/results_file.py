"""Writing a benchmark's results: its summary printed, then summary and rows as JSON."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(path: Path, summary: dict, rows: list[dict], **extra) -> None:
    print(json.dumps(summary))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": summary, **extra, "rows": rows}, indent=1, default=str) + "\n")
    print(f"wrote {path}")
