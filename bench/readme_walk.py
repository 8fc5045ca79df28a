"""The README and the guide (docs/guide.md), walked as a new user walks them: every command of
their code blocks, in order (the README's, then the guide's), verbatim, in one scratch folder (a
command that crashes or depends on a file another section overwrote is a bug).

    .venv/bin/python bench/readme_walk.py            # everything this machine can run (minutes)
    .venv/bin/python bench/readme_walk.py --quick    # the README's first block and every command parsed

Shell blocks run line by line through bash with the virtual environment's `hetplan` first on
PATH; the Python block runs as a script; the YAML block whose first line is `name: lab` is saved
as lab.yaml, since the README's commands read it. The scratch folder sits beside a link to
../shared, so the README's `../shared/...` paths resolve. A command is skipped only for a reason
printed beside it (SKIP below: a GPU, a placeholder of the user's, another machine). Before
running anything, every command's flags are parsed by hetplan's own parser, and every file a
command reads must have been written by an earlier command (with the same --cluster, for plans).

Exit status: 0 when every command that ran ended with status 0.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HETPLAN_SHARED", REPO.parent / "shared"))

# (text in the command, why it is not run here)
SKIP = (
    ("make test", "the test suite is CI's own step"),
    ("--device cuda", "needs a CUDA GPU"),
    ("mypackage.models:", "a placeholder for the user's own model"),
    ("calibrate --cluster lab.yaml", "lab.yaml's GPUs and second host are the README's example machines"),
    ("torchrun ", "a two-machine example (DIR is the run folder)"),
)
# reading a file: positional arguments and these flags; writing one: these flags
READS = ("--graph", "--cluster")
WRITES = ("-o", "--output", "--curve", "--gantt", "--trace", "--checkpoint-dir")


DOCS = (REPO / "README.md", REPO / "docs" / "guide.md")  # walked in this order


@dataclass(frozen=True)
class Command:
    line: int
    kind: str  # "sh", "python" or "yaml"
    text: str
    source: str = "README"  # the file, as messages name it


def blocks(readme: Path) -> list[Command]:
    """Every command of a file's fenced blocks, in order (comments after '#' dropped)."""
    out, kind, start, body = [], None, 0, []
    source = "README" if readme.name == "README.md" else f"{readme.parent.name}/{readme.name}"
    for i, line in enumerate(readme.read_text().splitlines(), 1):
        if line.startswith("```"):
            if kind is None:
                kind, start, body = (line[3:].strip() or "sh"), i, []
                continue
            if kind == "python":
                out.append(Command(start, "python", "\n".join(body), source))
            elif kind in ("yaml", "json"):
                out.append(Command(start, kind, "\n".join(body), source))
            kind = None
        elif kind == "sh" and line.strip() and not line.startswith(("$ ", "hetplan: error")) \
                and re.match(r"^(hetplan|make|torchrun)\b", line):
            out.append(Command(i, "sh", line.split(" #")[0].strip(), source))
        elif kind in ("python", "yaml", "json"):
            body.append(line)
    return out


def walk_blocks(files=DOCS) -> list[Command]:
    """The commands of every file of the walk, in the walk's order."""
    return [c for f in files for c in blocks(f)]


def skipped(cmd: Command) -> str | None:
    return next((why for text, why in SKIP if text in cmd.text), None)


def _files(argv: list[str]) -> tuple[list[str], list[str], str | None]:
    """Files a hetplan command reads and writes (by their suffix), and its --cluster."""
    writes = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in WRITES]
    reads = [arg for arg in argv if arg.endswith((".json", ".yaml", ".txt")) and arg not in writes]
    cluster = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--cluster"), None)
    return reads, writes, cluster


def check(commands: list[Command]) -> list[str]:
    """Every hetplan command parses, and reads only files written before it (plans with the
    cluster they were made for). Returns the problems, one line each."""
    sys.path.insert(0, str(REPO / "src"))
    from hetplan.cli import build_parser

    parser, problems = build_parser(), []
    made: dict[str, str | None] = {}
    aliases: dict[str, str] = {}  # a calibrated cluster file stands for the cluster it calibrated
    for cmd in commands:
        if cmd.kind == "yaml" and cmd.text.startswith("name: lab"):
            made["lab.yaml"] = None
        if cmd.kind == "json" and '"horizon_s"' in cmd.text:  # the guide's availability trace, saved as day.json
            made["day.json"] = None
        if cmd.kind != "sh" or skipped(cmd) or not cmd.text.startswith("hetplan "):
            continue
        argv = shlex.split(cmd.text)
        redirected = argv[argv.index(">") + 1:argv.index(">") + 2] if ">" in argv else []  # `--json > F` writes F
        argv = argv[:argv.index(">")] if ">" in argv else argv
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            problems.append(f"{cmd.source} line {cmd.line}: hetplan does not accept: {cmd.text}")
            continue
        reads, writes, cluster = _files(argv)
        for path in reads:
            if path.startswith("../shared/"):
                continue
            if path not in made:
                problems.append(f"{cmd.source} line {cmd.line}: reads {path}, which no earlier command wrote")
            elif made[path] and cluster and made[path] != aliases.get(cluster, cluster):
                problems.append(f"{cmd.source} line {cmd.line}: {path} was planned for {made[path]}, "
                                f"used with {cluster}")
        for path in writes + redirected:
            made[path] = cluster if argv[1] == "plan" else None
            if argv[1] == "calibrate" and cluster:
                aliases[path] = cluster
    return problems


def run(commands: list[Command], folder: Path, quick: bool) -> int:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")}
    failed = 0
    for cmd in commands:
        if quick and (cmd.source != "README" or cmd.line > quick_end(commands)):
            break
        why = skipped(cmd)
        if quick and cmd.text.startswith("make "):
            why = "the quick walk leaves make to itself"
        if cmd.kind == "yaml":
            if cmd.text.startswith("name: lab"):
                (folder / "lab.yaml").write_text(cmd.text + "\n")
            continue
        if why:
            print(f"SKIP  {cmd.source}:{cmd.line:<4}  {cmd.text.splitlines()[0]}    ({why})", flush=True)
            continue
        argv = ["bash", "-c", cmd.text] if cmd.kind == "sh" else [sys.executable, "-c", cmd.text]
        if cmd.text.startswith("make "):
            argv = ["bash", "-c", f"cd {shlex.quote(str(REPO))} && {cmd.text}"]
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True)
        took = time.perf_counter() - t0
        status = "ok  " if proc.returncode == 0 else f"FAIL {proc.returncode}"
        failed += proc.returncode != 0
        first = cmd.text.splitlines()[0] if cmd.kind == "sh" else "(the Python example)"
        print(f"{status}  {cmd.source}:{cmd.line:<4}  {first}    [{took:.1f} s]", flush=True)
        if proc.returncode:
            print("      " + "\n      ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:]), flush=True)
    return failed


def quick_end(commands: list[Command]) -> int:
    """The quick walk ends with the README's first run of consecutive hetplan lines."""
    lines = [c.line for c in commands if c.text.startswith("hetplan ") and c.source == "README"]
    end = lines[0]
    while end + 1 in lines:
        end += 1
    return end


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="check every command; run only the quick start")
    ap.add_argument("--file", type=Path, action="append", help="walk these files instead (in order)")
    args = ap.parse_args(argv)
    commands = walk_blocks(args.file or DOCS)
    problems = check(commands)
    for problem in problems:
        print(problem)
    with tempfile.TemporaryDirectory(prefix="readme-walk-") as tmp:
        (Path(tmp) / "shared").symlink_to(SHARED.resolve())
        folder = Path(tmp) / "walk"
        folder.mkdir()
        failed = run(commands, folder, args.quick)
    print(f"{len(problems)} problems in the README's commands, {failed} commands failed")  # and the guide's
    return 1 if problems or failed else 0


if __name__ == "__main__":
    sys.exit(main())
