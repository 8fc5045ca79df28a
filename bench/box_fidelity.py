"""Predicted against measured on the evidence box's own plans, with today's runtime and simulator.

The table of ../shared/evidence/box-2026-11/README.md ("Predicted against measured") was measured
with the runtime of 384b8f7 (median |error| 46% over 21 runs). This runs the same plan files of the
same graphs on the same cluster files again, each as a user types `hetplan run`, and prints
predicted, measured and the error beside the box's first measurement. Meant for the 16-core GPU
machine those files describe; on a smaller machine the workers' threads oversubscribe its cores,
and the figures say nothing of the box.

    python bench/box_fidelity.py [--steps 6] [--warmup 2] [--calibrate] [--fresh] [--out out/bench/box]

--calibrate: `hetplan calibrate` each cluster first and predict with the calibrated file.
--fresh: also plan each (graph, cluster) with today's dp and run that plan.
Writes RESULTS.md and results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from evidence_rerun import EVIDENCE, calibrate_row, cluster_file, has_cuda, run_row

DEEP = ("deep_mlp_model:deep_mlp", "deep-mlp/graph.json")
TINY = ("gpt2-tiny", "gpt2-tiny-hetcpu/graph.json")
GPT2 = ("gpt2", "gpt2-cpu4x4/graph.json")

# (model, graph, cluster file, plan file)
ROWS = (
    (*DEEP, "hetcpu.yaml", "deep-mlp/plan-hetcpu-single.json"),
    (*DEEP, "hetcpu.yaml", "deep-mlp/plan-hetcpu-uniform.json"),
    (*DEEP, "hetcpu.yaml", "deep-mlp/plan-hetcpu-balanced-time.json"),
    (*DEEP, "hetcpu.yaml", "deep-mlp/plan-hetcpu-data-parallel.json"),
    (*DEEP, "hetcpu.yaml", "deep-mlp/plan-hetcpu-dp.json"),
    (*DEEP, "cpu4x4.yaml", "deep-mlp/plan-cpu4x4-single.json"),
    (*DEEP, "cpu4x4.yaml", "deep-mlp/plan-cpu4x4-uniform.json"),
    (*DEEP, "cpu4x4.yaml", "deep-mlp/plan-cpu4x4-dp.json"),
    (*DEEP, "cpu4x4.yaml", "deep-mlp/plan-cpu4x4-data-parallel.json"),
    (*DEEP, "mixed.yaml", "deep-mlp/plan-mixed-single.json"),
    (*DEEP, "mixed.yaml", "deep-mlp/plan-mixed-uniform.json"),
    (*DEEP, "mixed.yaml", "deep-mlp/plan-mixed-dp.json"),
    (*TINY, "hetcpu.yaml", "gpt2-tiny-hetcpu/plan-single.json"),
    (*TINY, "hetcpu.yaml", "gpt2-tiny-hetcpu/plan-uniform.json"),
    (*TINY, "hetcpu.yaml", "gpt2-tiny-hetcpu/plan-dp.json"),
    (*GPT2, "cpu4x4.yaml", "gpt2-cpu4x4/plan-dp.json"),
    (*GPT2, "cpu4x4.yaml", "gpt2-cpu4x4/plan-data-parallel.json"),
)


def box_measured_ms(plan: str) -> float | None:
    """The step the box measured for this plan with the old runtime (its run-*.json), if it ran."""
    path = EVIDENCE / plan.replace("/plan-", "/run-")
    return json.loads(path.read_text())["measured_step_s"] * 1e3 if path.exists() else None


def fresh_plan(python: str, graph: str, cluster: Path, out: Path) -> Path | None:
    path = out / f"dp-{cluster.stem}-{Path(graph).parent.name}.json"
    proc = subprocess.run([python, "-m", "hetplan.cli", "plan", str(EVIDENCE / graph), "--cluster", str(cluster),
                           "--planner", "dp", "-o", str(path)], capture_output=True, text=True)
    return path if proc.returncode == 0 else None


def clusters(python: str, cuda: bool, calibrate: bool, out: Path) -> dict[str, Path]:
    found = {}
    for name in sorted({row[2] for row in ROWS}):
        folder = out / f"cluster-{Path(name).stem}"
        folder.mkdir(parents=True, exist_ok=True)
        path, _ = cluster_file(name, cuda, folder)
        if calibrate:
            res = calibrate_row(python, path, folder)
            print(f"calibrate {name}: {res['status']}", flush=True)
            path = folder / "calibrated.yaml" if res["status"] == "ran" else path
        found[name] = path
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("out/bench/box"))
    ap.add_argument("--only", default="", help="only plan files whose path contains this text")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    paths = clusters(args.python, has_cuda(args.python), args.calibrate, args.out)
    rows = [row for row in ROWS if args.only in row[3]]
    if args.fresh:
        for model, graph, cluster in sorted({(r[0], r[1], r[2]) for r in ROWS}):
            plan = fresh_plan(args.python, graph, paths[cluster], args.out)
            if plan:
                rows.append((model, graph, cluster, plan))
    lines = ["| graph | cluster | plan | predicted ms | measured ms | error | box, old runtime ms |", "|" + "---|" * 7]
    results = []
    for i, (model, graph, cluster, plan) in enumerate(rows):
        row_out = args.out / f"row{i}"
        row_out.mkdir(exist_ok=True)
        res = run_row(args.python, "", plan, model, graph, paths[cluster], args.steps, row_out, warmup=args.warmup)
        before = box_measured_ms(str(plan)) if not Path(plan).is_absolute() else None
        res.update(graph=graph, cluster=cluster, plan=Path(plan).name, box_old_ms=before)
        results.append(res)
        if res["status"] == "ran":
            err = res["measured_ms"] / res["predicted_ms"] - 1
            old = f"{before:.1f}" if before else "-"
            res["error"] = err
            lines.append(f"| {Path(graph).parent.name} | {cluster} | {Path(plan).name} | {res['predicted_ms']:.1f} | "
                         f"{res['measured_ms']:.1f} | {err:+.0%} | {old} |")
        else:
            lines.append(f"| {Path(graph).parent.name} | {cluster} | {Path(plan).name} | - | {res['status']} | - | - |")
        print(lines[-1], flush=True)
    errors = [abs(r["error"]) for r in results if "error" in r]
    if errors:
        q = statistics.quantiles(errors, n=10)[-1] if len(errors) > 1 else errors[0]
        lines.append(f"\n{len(errors)} runs: median |error| {statistics.median(errors):.0%}, 90th percentile {q:.0%}")
        print(lines[-1], flush=True)
    (args.out / "RESULTS.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
