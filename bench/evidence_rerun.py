"""The commands that failed on the GPU box (../shared/evidence/box-2026-11), run again.

Each row is one `hetplan run` (or `hetplan calibrate`) of the evidence pack's files, as a user
would type it, with the torch of the Python that runs this script (pass `--python` for another
virtual environment, e.g. one with torch 2.11). On a machine without CUDA the GPU rows run on a
stand-in cluster whose GPU device is bound to the CPU (same plan, same device ids and types, so
the same replica split), and say so; on a GPU machine they run as they are.

    .venv/bin/python bench/evidence_rerun.py [--python PY] [--steps 3] [--out out/bench/evidence]

Writes RESULTS.md (the table for BENCHMARKS.md) and one log per row under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVIDENCE = Path(os.environ.get("HETPLAN_SHARED", REPO.parent / "shared")) / "evidence" / "box-2026-11"

# (label, what failed there, plan, model, graph, cluster file)
RUNS = (
    ("gpt2-tiny, one stage on the H100", "device assert: Expected cpu, got cuda:0",
     "gpt2-tiny-hetcpu/plan-single.json", "gpt2-tiny", "gpt2-tiny-hetcpu/graph.json", "gpu1"),
    ("deep-mlp, mixed: H100 + 3 CPU workers, uniform", "(ran; float-only)",
     "deep-mlp/plan-mixed-uniform.json", "deep_mlp_model:deep_mlp", "deep-mlp/graph.json", "mixed.yaml"),
    ("deep-mlp, mixed: dp, replicas 3 + 1", "refused: replicas 3, 1",
     "deep-mlp/plan-mixed-dp.json", "deep_mlp_model:deep_mlp", "deep-mlp/graph.json", "mixed.yaml"),
    ("deep-mlp, hetcpu: dp, a stage that is only a GELU", "optimizer got an empty parameter list",
     "deep-mlp/plan-hetcpu-dp.json", "deep_mlp_model:deep_mlp", "deep-mlp/graph.json", "hetcpu.yaml"),
    ("gpt2-tiny, hetcpu: uniform, 4 stages (int64 across boundaries)", "torch 2.11: float dtype can require grad",
     "gpt2-tiny-hetcpu/plan-uniform.json", "gpt2-tiny", "gpt2-tiny-hetcpu/graph.json", "hetcpu.yaml"),
    ("gpt2-tiny, hetcpu: dp = data-parallel over 1, 2, 8, 4 threads", "equal slices (192 ms vs 125 predicted)",
     "gpt2-tiny-hetcpu/plan-dp.json", "gpt2-tiny", "gpt2-tiny-hetcpu/graph.json", "hetcpu.yaml"),
    ("gpt2, cpu4x4: dp, replicas 1 + 3", "refused: replicas 1, 3",
     "gpt2-cpu4x4/plan-dp.json", "gpt2", "gpt2-cpu4x4/graph.json", "cpu4x4.yaml"),
)


def has_cuda(python: str) -> bool:
    out = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                         text=True)
    return out.stdout.strip() == "True"


def cluster_file(name: str, cuda: bool, out: Path) -> tuple[Path, str]:
    """The evidence's cluster file, or its stand-in with GPUs bound to the CPU when there is no CUDA."""
    if name == "gpu1":
        text = "name: hetcpu\ndevices:\n  - {id: c8, type: h100-80gb, host: n0, binding: \"cuda:0\"}\n"
    else:
        text = (EVIDENCE / name).read_text()
    if cuda or "cuda" not in text:
        path = out / Path(name).with_suffix(".yaml").name
        path.write_text(text)
        return path, ""
    path = out / f"{Path(name).stem}-cpu-standin.yaml"
    path.write_text(text.replace('binding: "cuda:0"', "binding: cpu"))
    return path, "stand-in: GPU bound to the CPU"


def run_row(python: str, label: str, plan: str | Path, model: str, graph: str, cluster: Path, steps: int,
            out: Path, warmup: int = 1) -> dict:
    """One `hetplan run` as a user types it; plan and graph relative to the evidence folder."""
    cmd = [python, "-m", "hetplan.cli", "run", str(EVIDENCE / plan), "--model", model, "--graph", str(EVIDENCE / graph),
           "--cluster", str(cluster), "--steps", str(steps), "--warmup", str(warmup), "--out", str(out), "--json",
           "--timeout-s", "300"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EVIDENCE), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    (out / "command.txt").write_text(" ".join(cmd) + "\n\n" + proc.stdout + "\n" + proc.stderr)
    if proc.returncode:
        return {"status": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}",
                "wall_s": wall}
    res = json.loads(proc.stdout)
    return {"status": "ran", "wall_s": wall, "measured_ms": res["measured_step_s"] * 1e3,
            "predicted_ms": (res["predicted_step_s"] or 0) * 1e3, "loss_first": res["loss_first"],
            "loss_last": res["loss_last"], "workers": res["workers"]}


def calibrate_row(python: str, cluster: Path, out: Path) -> dict:
    cmd = [python, "-m", "hetplan.cli", "calibrate", "--cluster", str(cluster), "-o", str(out / "calibrated.yaml"),
           "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (out / "command.txt").write_text(" ".join(cmd) + "\n\n" + proc.stdout + "\n" + proc.stderr)
    if proc.returncode:
        return {"status": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}",
                "wall_s": time.perf_counter() - t0}
    res = json.loads(proc.stdout)
    return {"status": "ran", "wall_s": time.perf_counter() - t0,
            "action_overhead_ms": res.get("action_overhead_s", 0) * 1e3}


def wanted(only: str, label: str) -> bool:
    return not only or any(part in label for part in only.split(","))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("out/bench/evidence"))
    ap.add_argument("--only", default="", help="run only rows whose label contains one of these texts (a,b,...)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch_version = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True).stdout.strip()
    cuda = has_cuda(args.python)
    lines = [f"torch {torch_version}, CUDA {'yes' if cuda else 'no'}", "",
             "| run | failed on the box with | here | measured ms | predicted ms | loss first -> last |",
             "|---|---|---|---|---|---|"]
    failed = 0
    for i, (label, before, plan, model, graph, cluster) in enumerate(RUNS):
        if not wanted(args.only, label):
            continue
        row_out = args.out / f"row{i}"
        row_out.mkdir(exist_ok=True)
        path, note = cluster_file(cluster, cuda, row_out)
        res = run_row(args.python, label, plan, model, graph, path, args.steps, row_out)
        failed += res["status"] != "ran"
        status = res["status"] + (f" ({note})" if note else "")
        meas = f"{res['measured_ms']:.1f}" if "measured_ms" in res else "-"
        pred = f"{res['predicted_ms']:.1f}" if "measured_ms" in res else "-"
        loss = f"{res['loss_first']:.3f} -> {res['loss_last']:.3f}" if res.get("loss_first") is not None else "-"
        lines.append(f"| {label} | {before} | {status} | {meas} | {pred} | {loss} |")
        print(lines[-1], flush=True)
    for name in ("cpu4x4.yaml", "hetcpu.yaml"):
        if not wanted(args.only, f"calibrate {name}"):
            continue
        row_out = args.out / f"calibrate-{Path(name).stem}"
        row_out.mkdir(exist_ok=True)
        path, _ = cluster_file(name, cuda, row_out)
        res = calibrate_row(args.python, path, row_out)
        failed += res["status"] != "ran"
        extra = f", {res['action_overhead_ms']:.2f} ms per action" if "action_overhead_ms" in res else ""
        lines.append(f"| hetplan calibrate --cluster {name} | torch 2.11: float dtype can require grad | "
                     f"{res['status']}{extra} | - | - | - |")
        print(lines[-1], flush=True)
    (args.out / "RESULTS.md").write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
