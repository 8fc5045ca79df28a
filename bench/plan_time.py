"""Planning time and memory of dp at 8, 128 and 1,024 GPUs, with and without the default axes
(recomputation, optimizer-state sharding, tensor parallelism), before and after this work, in
one run.

    .venv/bin/python bench/plan_time.py [--only PROBLEM ...] [--versions before,after]
        [--timeout-s 600] [--before-src /work/base/src] [--markdown] [-o bench/results/plan_time.json]

`before` is the code at commit 7508f32, checked out as a git worktree
(`git worktree add /work/base 7508f32`; `--before-src` names its `src`), `after` is this
working tree's `src`. Every problem runs under four configurations (the table's columns):

- before (no axes): the old code, its defaults `{}` (no recomputation, no sharding, no tensor
  parallelism);
- before (axes on): the old code, `{"recompute": "where-needed", "shard": "replicated", "max_tp": 8}`;
- after (defaults): this tree's code, its defaults `{}` (which search the three axes);
- after (axes off): this tree's code, `{"recompute": "never", "shard": "never", "max_tp": 1}`.

Each run is `make_plan(graph, cluster, "dp", PlanOptions(**options))` in a fresh Python process
of its own (`.venv/bin/python`, `PYTHONPATH` set to that version's `src`; the child checks that
`hetplan` was imported from there and records its path). Wall seconds are the whole process
(start, imports, loading the graph, planning, the simulator's scoring); peak memory is that child's
maximum resident set (`os.wait4`'s rusage of that one process, MiB). A run past `--timeout-s` is
killed and recorded as a timeout; an error (an option the version does not know, a crash) is
recorded with the first line of its message, and the script goes on. Each graph is built once with
this tree's code and written as JSON; each child loads it with its own code (`load_graph`), so
both versions plan the same graph. Clusters are built in the child from the same description.

Problems: resnet50 (PipeDream's profile) on the preset a100+v100-8; OPT-350M (1,024 sequences of
2,048 tokens, fp32) on 4 A100-40GB + 4 V100-16GB hosts and on 4 hosts of 8 A100-40GB + 12 of
8 V100-16GB (1.7 GB/s between hosts); Llama-3-8B at 8,192 tokens (2,048 sequences) on that
128-GPU cluster; Llama-3-70B (2,048 x 4,096, bf16) on 32 hosts of 8 H100 + 48 of 8 A100-40GB +
48 of 8 V100-16GB (12.5 GB/s between hosts).

Machine caveat: the figures are from the machine the run is on, recorded in the summary (CPU
count, load average at start and end). On the 2-core VM this was written on, shared with other
work, a time is not what a bigger or quieter machine would give; compare columns of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from results_file import write_results

HERE = Path(__file__).resolve().parent
AFTER_SRC = HERE.parent / "src"
BEFORE_SRC = Path("/work/base/src")
RESNET50 = HERE.parent.parent / "shared" / "data" / "pipedream-profiles" / "resnet50" / "graph.txt"
AXES_ON = {"recompute": "where-needed", "shard": "replicated", "max_tp": 8}
AXES_OFF = {"recompute": "never", "shard": "never", "max_tp": 1}
CONFIGS = (  # (column, code version, options)
    ("before (no axes)", "before", {}),
    ("before (axes on)", "before", AXES_ON),
    ("after (defaults)", "after", {}),
    ("after (axes off)", "after", AXES_OFF),
)
LLAMA_3_70B = ("llama-3-70b", 80, 8192, 28672, 64, 128256)  # + kv_heads=8, gated=True (if SHAPES lacks it)
GPUS_128 = [("a100-40gb", 4, 8), ("v100-16gb", 12, 8)]
GPUS_1024 = [("h100-80gb", 32, 8), ("a100-40gb", 48, 8), ("v100-16gb", 48, 8)]
AV = ("a100-40gb", "v100-16gb")
PROBLEMS = {  # name: (graph: (model, batch, sequence, device types, precision) or "resnet50", cluster)
    "resnet50/8": ("resnet50", "a100+v100-8"),
    "opt-350m/8": (("opt-350m", 1024, 2048, AV, "fp32"), ([("a100-40gb", 1, 4), ("v100-16gb", 1, 4)], "1.7GB/s")),
    "opt-350m/128": (("opt-350m", 1024, 2048, AV, "fp32"), (GPUS_128, "1.7GB/s")),
    "llama-3-8b-s8192/128": (("llama-3-8b", 2048, 8192, AV, "fp32"), (GPUS_128, "1.7GB/s")),
    "llama-3-70b/1024": (("llama-3-70b", 2048, 4096, ("h100-80gb", *AV), "bf16"), (GPUS_1024, "12.5GB/s")),
}
RESULT_MARK = "plan_time child result"


# --- the child: one dp run in a process of its own -------------------------------------------------------------

def child_main(graph_file: str, cluster_json: str, options_json: str, src: str, result_file: str) -> None:
    """Plan once and write what happened to `result_file` (JSON), whatever happens."""
    result: dict = {}
    try:
        result.update(_child_run(graph_file, json.loads(cluster_json), json.loads(options_json), src, result))
    except Exception as exc:  # every failure is a row, not a crash
        result.update(status="error", error=first_line(exc), error_at=_where(exc))
    result["child_peak_rss_mib"] = _self_rss_mib()
    Path(result_file).write_text(json.dumps(result))


def _child_run(graph_file: str, cluster: dict, opts: dict, src: str, out: dict) -> dict:
    """The run's facts; `out` holds those known so far if it raises."""
    started = time.perf_counter()
    import hetplan

    where = out["hetplan_file"] = str(Path(hetplan.__file__).resolve())
    if not where.startswith(str(Path(src).resolve()) + os.sep):
        return {"status": "error", "error": f"hetplan was imported from {where}, not from {src}"}
    from hetplan.errors import HetplanError, InfeasibleError
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.io.graphs import load_graph
    from hetplan.planners import PlanOptions, make_plan

    try:
        options = PlanOptions(**opts)
    except (TypeError, HetplanError) as exc:  # an option this version does not know, or a value it refuses
        return {"status": "error", "error": f"options {opts} refused by this code: {first_line(exc)}"}
    graph = load_graph(graph_file)
    made = hetplan.load_cluster(cluster["preset"]) if "preset" in cluster else cluster_from_spec(
        cluster["spec"], cluster["name"])
    out.update(cluster_devices=len(made.devices), graph_nodes=len(graph.nodes),
               load_s=time.perf_counter() - started)
    began = time.perf_counter()
    try:
        plan = make_plan(graph, made, "dp", options)
    except InfeasibleError as exc:
        return {"status": "no plan", "error": first_line(exc), "plan_s": time.perf_counter() - began}
    return {"plan_s": time.perf_counter() - began, **plan_facts(plan)}


def plan_facts(plan) -> dict:
    """What the table and the rows say of a plan."""
    stages = plan.stages
    return {"status": "ok" if plan.predicted.feasible else "no plan", "step_s": plan.predicted.step_s,
            "stages": len(stages), "devices_used": len(plan.devices), "microbatches": plan.microbatches,
            "schedule": plan.schedule, "replicas": [len(s.devices) for s in stages],
            "recompute": any(getattr(s, "recompute", False) not in (False, "none") for s in stages),
            "shard": any(getattr(s, "shard", False) for s in stages),
            "tp": any(getattr(s, "tp", 1) > 1 for s in stages), "max_tp": max(getattr(s, "tp", 1) for s in stages),
            "planning_s": plan.meta.get("planning_s")}


def _where(exc: BaseException) -> str | None:
    """file:line of the innermost frame an exception came from."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _self_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def first_line(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else ": ".join(x for x in (type(exc).__name__, str(exc)) if x)
    return (text.strip().splitlines() or [""])[0]


# --- the parent: graphs once, a child per run ------------------------------------------------------------------

def build_graph(what):
    """A problem's graph, with this tree's code."""
    from hetplan.io.pipedream import import_pipedream
    from hetplan.zoo import llm

    if what == "resnet50":
        return import_pipedream(RESNET50)
    model, batch, seq, types, precision = what
    if model not in llm.SHAPES and model == LLAMA_3_70B[0]:
        model = llm.TransformerShape(*LLAMA_3_70B, kv_heads=8, gated=True)
    return llm.transformer_chain(model, batch, seq, list(types), precision=precision)


def cluster_description(name: str, what) -> dict:
    """What the child builds the cluster from: a preset's name, or a description of hosts."""
    if isinstance(what, str):
        return {"preset": what}
    from hetplan.io.clusters import hosts_spec

    groups, between = what
    label = name.replace("/", "-")
    return {"spec": hosts_spec(groups, inter_host=between, name=label), "name": label}


def write_graphs(names: list[str], tmp: Path) -> dict[str, dict]:
    """Each distinct graph built and written once; per problem: its file and facts."""
    from hetplan.io import serde

    files: dict[str, Path] = {}
    out = {}
    for name in names:
        what = PROBLEMS[name][0]
        key = json.dumps(what)
        if key not in files:
            began = time.perf_counter()
            graph = build_graph(what)
            files[key] = tmp / f"graph-{len(files)}.json"
            serde.dump(graph, files[key])
            print(json.dumps({"graph": graph.name, "nodes": len(graph.nodes), "build_s": time.perf_counter() - began,
                              "file": str(files[key])}), flush=True)
        out[name] = {"file": files[key]}
    return out


def wait_child(proc: subprocess.Popen, timeout_s: float) -> tuple[int, object, bool]:
    """Wait for the child alone (`os.wait4`: its own rusage), killing its process group past the
    timeout: (wait status, rusage, timed out)."""
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # Ctrl-C: the child is in a session of its own and would go on
        os.killpg(proc.pid, signal.SIGKILL)
        os.wait4(proc.pid, 0)
        raise
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return status, usage, killed.is_set()


def run_one(name: str, config: tuple, graph_file: Path, cluster: dict, args, tmp: Path) -> dict:
    column, version, options = config
    src = str(args.before_src if version == "before" else AFTER_SRC)
    result_file = tmp / "result.json"
    result_file.unlink(missing_ok=True)
    stderr_file = tmp / "stderr.txt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(graph_file), json.dumps(cluster),
           json.dumps(options), src, str(result_file)]
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1"}
    began = time.perf_counter()
    with open(stderr_file, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tmp,
                                start_new_session=True)
        status, usage, timed_out = wait_child(proc, args.timeout_s)
    row = {"problem": name, "column": column, "version": version, "options": options, "src": src,
           "wall_s": time.perf_counter() - began, "peak_rss_mib": usage.ru_maxrss / 1024}
    if timed_out:
        return {**row, "status": "timeout", "error": f"no plan in {args.timeout_s:g} s; killed"}
    if result_file.exists():
        return {**row, **json.loads(result_file.read_text())}
    return {**row, "status": "error", "error": _crash(status, stderr_file)}


def _crash(status: int, stderr_file: Path) -> str:
    """Why a child that wrote no result ended: its last line on stderr, or its exit status."""
    lines = [x for x in stderr_file.read_text(errors="replace").splitlines() if x.strip()]
    code = os.waitstatus_to_exitcode(status)
    what = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
    return f"{what}: {lines[-1].strip()}" if lines else what


# --- the report -------------------------------------------------------------------------------------------------

def fmt_step(step_s: float | None) -> str:
    if step_s is None:
        return "-"
    return f"{step_s * 1e3:.1f} ms" if step_s < 10 else f"{step_s:.2f} s"


def cell(row: dict | None) -> str:
    """A table cell: seconds / MiB / step, or what happened instead."""
    if row is None:
        return "not run"
    status, spent = row["status"], f"{row['wall_s']:.1f} s / {row['peak_rss_mib']:.0f} MiB"
    text = {"ok": f"{spent} / {fmt_step(row.get('step_s'))}", "no plan": f"no plan ({spent})",
            "timeout": f"timeout ({row['wall_s']:.0f} s)"}.get(status, f"{status}: {row.get('error', '')}")
    if status == "error" and row.get("error_at"):
        text += f" ({Path(row['error_at'].split(':')[0]).name}:{row['error_at'].rsplit(':', 1)[-1]})"
    return (text if len(text) <= 120 else text[:117] + "...").replace("|", "\\|")


def markdown(rows: list[dict], names: list[str], summary: dict) -> str:
    columns = [c for c, v, _ in CONFIGS if v in summary["versions"]]
    found = {(r["problem"], r["column"]): r for r in rows}
    lines = ["| problem | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {n} | " + " | ".join(cell(found.get((n, c))) for c in columns) + " |" for n in names]
    m = summary["machine"]
    lines.append(f"\nEach cell: wall seconds of the planning process / its peak RSS / the plan's predicted step. "
                 f"{m['cpus']} CPUs; load average {m['loadavg_start']} at the start, {m['loadavg_end']} at the "
                 f"end; timeout {summary['timeout_s']:g} s.")
    return "\n".join(lines)


def git_state(src: Path) -> dict:
    """The commit a source tree is at and how many of its files differ from it (read-only git)."""
    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", "--no-optional-locks", "-C", str(src), *cmd], capture_output=True,
                                  text=True, timeout=60, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    changed = git("status", "--porcelain", "--", ".")
    return {"src": str(src), "commit": git("rev-parse", "HEAD"),
            "changed_files": None if changed is None else len(changed.splitlines())}


# --- main -------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=list(PROBLEMS), help="a problem (repeatable; default: all)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run (default 600)")
    parser.add_argument("--versions", default="before,after", help="before, after or both (default before,after)")
    parser.add_argument("--before-src", type=Path, default=BEFORE_SRC, help="the src of commit 7508f32's worktree")
    parser.add_argument("--markdown", action="store_true", help="print the table")
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "plan_time.json")
    args = parser.parse_args(argv)
    args.versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    if not args.versions or set(args.versions) - {"before", "after"}:
        parser.error(f"--versions: {','.join(args.versions)!r}: give before, after or before,after")
    if args.timeout_s <= 0:
        parser.error("--timeout-s must be > 0")
    return args


def main() -> None:
    args = parse_args()
    names = list(dict.fromkeys(args.only or PROBLEMS))
    load_start, began = os.getloadavg(), time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan_time-") as tmp:
        graphs = write_graphs(names, Path(tmp))
        for name in names:
            cluster = cluster_description(name, PROBLEMS[name][1])
            for config in (c for c in CONFIGS if c[1] in args.versions):
                row = run_one(name, config, graphs[name]["file"], cluster, args, Path(tmp))
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary = {"problems": names, "versions": args.versions, "timeout_s": args.timeout_s, "runs": len(rows),
               "by_status": {s: sum(r["status"] == s for r in rows) for s in dict.fromkeys(r["status"] for r in rows)},
               "total_s": time.perf_counter() - began,
               "machine": {"cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load_start],
                           "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
               "before": git_state(args.before_src), "after": git_state(AFTER_SRC)}
    table = markdown(rows, names, summary)
    write_results(args.output, summary, rows, markdown=table)
    if args.markdown:
        print(table)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(*sys.argv[2:7])
    else:
        main()
