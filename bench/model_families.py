"""Every model family the tests cover, at layer and block granularity, in 2, 3 and 4 stages.

For each family (the zoo's models, less the 124M-parameter `gpt2`, which is gpt2-tiny's code at
full size, and the transformers families of `tests/hf_families.py` as `hf_families:NAME`) and
each granularity (layer, block), it records:

- profiles: `hetplan.profile.profile_step` on the model at batch 4, sequence 16 (repeats=1),
  and the number of nodes of its graph, or the error's first line;
- 2, 3, 4 stages: one SGD step (lr 0.1, 2 micro-batches, 1F1B) of a chain of that many stages,
  one replica each, the pieces cut evenly between them, the ranks as threads
  (`tests/test_executor.py`'s `pipelined_vs_single`, with `hetplan run --no-dropout`'s switch),
  against one process's step on the whole batch: the largest weight difference after the step,
  `=` when it is at most 1e-5; "warned" where it is more and `hetplan run` says why before the
  run (`hetplan.zoo.faithful.pipeline_warnings` for this split: batch norm, a loss that is not a
  mean); "differs" where it is more and nothing was said, a silent difference (a defect); "too
  few blocks" where the model splits into fewer pieces than stages.

Every cell catches its own exceptions (recorded as `type: first line`) and carries its wall
time. Run from the repository root:

    HF_HUB_OFFLINE=1 .venv/bin/python bench/model_families.py [--out bench/results/model_families.json]

Writes the rows as JSON to --out and the markdown table beside it (.md), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from hetplan.pieces.split import split_step  # noqa: E402
from hetplan.profile import profile_step  # noqa: E402
from hetplan.rows import step_rows  # noqa: E402
from hetplan.zoo import ZOO, load_model  # noqa: E402
from hetplan.zoo.faithful import loss_parts, pipeline_warnings, switch_off_dropout  # noqa: E402
from hf_families import FAMILIES  # noqa: E402
from test_executor import pipelined_vs_single  # noqa: E402

GRANULARITIES = ("layer", "block")
STAGES = (2, 3, 4)
MICRO_BATCHES, SCHEDULE, BATCH, SEQ, TOL = 2, "1f1b", 4, 16, 1e-5
SKIPPED = {"gpt2": "skipped: gpt2-tiny's code at 124M parameters"}


def error_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def timed(fn):
    """Run fn() -> dict; the dict, or the error, with the wall time."""
    start = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - every cell records its failure and the table goes on
        out = {"status": "fails", "error": error_line(exc)}
    return {**out, "wall_s": round(time.perf_counter() - start, 2)}


def profile_cell(ref: str, granularity: str) -> dict:
    zm = load_model(ref, batch_size=BATCH, seq_len=SEQ, seed=0)
    report = profile_step(zm.step, zm.batch, granularity=granularity, block_classes=zm.block_classes or None,
                          repeats=1)
    return {"status": "ok", "nodes": len(report.graph.nodes)}


def count_pieces(ref: str, granularity: str) -> dict:
    zm = load_model(ref, batch_size=BATCH, seq_len=SEQ, seed=0)
    return {"status": "ok", "pieces": len(split_step(zm.step, zm.batch, granularity, zm.block_classes).pieces)}


def stage_cell(ref: str, granularity: str, n: int) -> dict:
    worst, moved, loss, ref_loss, *_ = pipelined_vs_single(ref, [1] * n, MICRO_BATCHES, SCHEDULE, batch=BATCH,
                                                           seq=SEQ, granularity=granularity, ref_m=1)
    said = warned(ref, n)
    status = "equal" if worst <= TOL else "warned" if said else "differs"
    return {"status": status, "worst": worst, "moved": moved, "loss": loss, "ref_loss": ref_loss, "warnings": said}


def warned(ref: str, n: int) -> list[str]:
    """What `hetplan run --no-dropout` says before a run of this split."""
    zm = load_model(ref, batch_size=BATCH, seq_len=SEQ, seed=0)
    switch_off_dropout(zm.step)
    return pipeline_warnings(zm.step, zm.batch, loss_parts(step_rows(BATCH, MICRO_BATCHES, [[1.0]] * n)))


def stage_cells(ref: str, granularity: str, pieces: dict) -> dict:
    cells = {}
    for n in STAGES:
        if pieces.get("status") == "ok" and pieces["pieces"] < n:
            cells[str(n)] = {"status": "too few blocks", "pieces": pieces["pieces"], "wall_s": 0.0}
        else:
            cells[str(n)] = timed(lambda n=n: stage_cell(ref, granularity, n))
        print(f"  {ref} {granularity} {n} stages: {cells[str(n)]}", file=sys.stderr, flush=True)
    return cells


def row(ref: str, granularity: str) -> dict:
    profile = timed(lambda: profile_cell(ref, granularity))
    print(f"  {ref} {granularity} profile: {profile}", file=sys.stderr, flush=True)
    pieces = timed(lambda: count_pieces(ref, granularity))
    return {"model": ref, "granularity": granularity, "profile": profile, "pieces": pieces,
            "stages": stage_cells(ref, granularity, pieces)}


def models() -> list[str]:
    return [name for name in ZOO if name not in SKIPPED] + [f"hf_families:{f}" for f in FAMILIES]


def short(text: str, limit: int = 90) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def number(x: float) -> str:
    return "0" if x == 0 else f"{x:.0e}"


def stage_text(cell: dict) -> str:
    status = cell["status"]
    if status == "fails":
        return f"fails: {short(cell['error'])}"
    if status == "too few blocks":
        return f"too few blocks ({cell['pieces']})"
    unmoved = "" if cell["moved"] > 1e-4 else ", weights unmoved"
    if status == "equal":
        return f"= ({number(cell['worst'])}{unmoved})"
    if status == "warned":
        return f"warned: {number(cell['worst'])} ({short(cell['warnings'][0], 40)})"
    return f"differs {number(cell['worst'])}{unmoved}, silently"


def profile_text(cell: dict) -> str:
    return str(cell["nodes"]) if cell["status"] == "ok" else f"fails: {short(cell['error'])}"


def table(rows: list[dict]) -> str:
    lines = ["| model | granularity | profiles (nodes) | 2 stages | 3 stages | 4 stages |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [stage_text(r["stages"][str(n)]) for n in STAGES]
        lines.append(f"| {r['model']} | {r['granularity']} | {profile_text(r['profile'])} | {' | '.join(cells)} |")
    for name, why in SKIPPED.items():
        if name in ZOO:
            lines.append(f"| {name} | - | {why} | - | - | - |")
    return "\n".join(lines)


def notes(total_s: float) -> str:
    return (f"`=`: the largest weight difference after one step (in parentheses) from one process's step on the "
            f"whole batch is at most {TOL:g}; `warned`: more, and `hetplan run` says so (and why) before the run; "
            f"SGD lr 0.1, batch {BATCH}, sequence {SEQ}, {MICRO_BATCHES} micro-batches, {SCHEDULE}, one replica "
            f"per stage, ranks as threads. Total {total_s:.0f} s on {os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, {platform.platform()}.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/model_families.json"))
    parser.add_argument("--models", help="a comma-separated subset (default: all)")
    parser.add_argument("--update", action="store_true",
                        help="run only --models again, keeping the other rows of --out (total_s adds up)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    chosen = [m for m in models() if not args.models or m in args.models.split(",")]
    fresh = {(r["model"], r["granularity"]): r for r in (row(ref, g) for ref in chosen for g in GRANULARITIES)}
    total_s = time.perf_counter() - start
    rows = list(fresh.values())
    if args.update:
        old = json.loads(args.out.read_text())
        total_s += old["summary"]["total_s"]
        rows = [fresh.pop((r["model"], r["granularity"]), r) for r in old["rows"]] + list(fresh.values())
    md = table(rows) + "\n\n" + notes(total_s) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"tolerance": TOL, "micro_batches": MICRO_BATCHES, "schedule": SCHEDULE, "batch": BATCH, "seq": SEQ,
               "total_s": round(total_s, 1), "cpus": os.cpu_count(), "torch": torch.__version__,
               "platform": platform.platform(), "skipped": SKIPPED}
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1, default=str) + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
