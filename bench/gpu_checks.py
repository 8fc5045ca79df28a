"""The runtime's GPU checks in one command, for a machine with one CUDA GPU (the machine lent to
this project: 16 cores and one GPU, never two). Prints a table and writes one JSON of results.

    .venv/bin/python bench/gpu_checks.py [--out out/bench/gpu] [--steps 6] [--skip-tests]

1. `tests/test_gpu.py` (pytest): every zoo model and transformers family with a GPU stage beside
   a CPU stage, in threads, equal to one process; bf16 and fp16 (its loss scaler) on the GPU.
2. The transport: gpt2-tiny in two stages, a GPU worker then a CPU worker, trained by
   `run_plan` with `--backend auto` and with `--backend gloo`: the backend each worker used (auto
   is torch's "cpu:gloo,cuda:nccl" where torch has NCCL; the message between the two workers
   goes through the host either way, since a CPU takes part) and the losses, which must agree.
3. GPU memory: the GPU worker's peak (`torch.cuda.max_memory_allocated`) against the predicted
   peak for its stage (the graph profiled on the GPU and on the CPU workers' type).
4. `--backend nccl` with a CPU worker: refused in one line before any worker starts.
5. `hetplan calibrate`'s probe of a GPU's copies to and from the host (what a message between a
   GPU worker and a CPU one crosses besides gloo, `cost.network.gpu_links`): its bandwidth
   and latency.

Not checkable on one GPU: NCCL between two GPU workers (NCCL refuses two ranks on one GPU); its
code path is the one the CPU suite runs on gloo (the same lists, channels and groups; only the
buffers' device differs, `Transport.wire`). Without CUDA the GPU rows say so and the rest run
with the GPU worker bound to the CPU, so that the script itself is checked here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]


def pytest_row(skip: str) -> dict:
    """tests/test_gpu.py: its summary line; `skip`: why not to run it ("": run it)."""
    if skip:
        return {"check": "tests/test_gpu.py", "ok": None, "why": skip}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"],
                          cwd=ROOT, capture_output=True, text=True)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return {"check": "tests/test_gpu.py", "ok": done.returncode in (0, 5), "summary": last,
            "seconds": round(time.perf_counter() - began, 1)}


def _setup(gpu: str, out: Path):
    """gpt2-tiny's graph profiled on the GPU (or its stand-in) and a CPU thread, a 2-device
    cluster, and the plan: the first half of the pieces on the GPU, the rest on the CPU."""
    from hetplan.io.clusters import cluster_from_spec
    from hetplan.io.graphs import load_graph
    from hetplan.plan import Plan, Stage

    graph_path = out / "gpt2-tiny.json"
    devices = (["--device", gpu] if gpu != "cpu" else []) + ["--device", "cpu:1"]
    subprocess.run([sys.executable, "-m", "hetplan", "profile", "gpt2-tiny", *devices, "--batch-size", "8",
                    "-o", str(graph_path)], check=True, cwd=ROOT, capture_output=True)
    graph = load_graph(graph_path)
    gpu_device = ({"id": "g0", "type": "h200-141gb", "binding": gpu} if gpu != "cpu"
                  else {"id": "g0", "type": "cpu", "threads": 1, "binding": "cpu"})
    cluster = cluster_from_spec({"name": "gpu+cpu", "devices": [
        {**gpu_device, "host": "here"}, {"id": "c0", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"}]},
        "gpu+cpu")
    names = [n.id for n in graph.nodes]
    half = len(names) // 2
    plan = Plan((Stage(tuple(names[:half]), ("g0",)), Stage(tuple(names[half:]), ("c0",))), 2, "1f1b", "gpu-checks")
    return graph, cluster, plan


def run_rows(gpu: str, out: Path, steps: int) -> list[dict]:
    """Checks 2-4."""
    from hetplan.errors import HetplanError
    from hetplan.runtime.run import run_plan
    from hetplan.runtime.settings import RunSettings

    graph, cluster, plan = _setup(gpu, out)
    rows, losses = [], {}
    for backend in ("auto", "gloo"):
        settings = RunSettings(steps=steps, warmup=2, batch_size=8, seq_len=32, optimizer="sgd", lr=0.1, seed=0,
                               no_dropout=True, out_dir=out / f"run-{backend}", backend=backend)
        summary = run_plan(plan, cluster, "gpt2-tiny", graph, settings).summary()
        losses[backend] = summary["losses"]
        gpu_key = next(k for k in summary["peak_mem_bytes"] if k.endswith(":g0"))
        predicted = (summary["predicted_peak_mem_bytes"] or {}).get("g0")
        rows.append({"check": f"run, --backend {backend}", "ok": True, "backend": summary["backend"],
                     "measured_step_s": summary["measured_step_s"], "predicted_step_s": summary["predicted_step_s"],
                     "gpu_peak_bytes": summary["peak_mem_bytes"][gpu_key], "gpu_predicted_peak_bytes": predicted,
                     "peak_error": (summary["peak_mem_bytes"][gpu_key] / predicted - 1) if predicted else None})
    worst = max(abs(a - b) for a, b in zip(losses["auto"], losses["gloo"], strict=True))
    rows.append({"check": "losses, auto against gloo", "ok": worst <= 1e-5 * max(1.0, abs(losses["gloo"][0])),
                 "worst_difference": worst})
    try:
        run_plan(plan, cluster, "gpt2-tiny", graph, RunSettings(steps=1, warmup=0, batch_size=8, seq_len=32,
                                                                out_dir=out / "run-nccl", backend="nccl"))
        rows.append({"check": "--backend nccl beside a CPU worker", "ok": False, "why": "it ran"})
    except HetplanError as exc:
        rows.append({"check": "--backend nccl beside a CPU worker", "ok": "\n" not in str(exc), "said": str(exc)})
    return rows


def copies_row(gpu: str) -> dict:
    """Check 5."""
    from hetplan.runtime.calibrate import calibrate_copies

    (link,) = calibrate_copies([gpu], repeats=5).values()
    return {"check": f"copies, host and {gpu}", "ok": link.bandwidth_Bps > 0, "bandwidth_Bps": link.bandwidth_Bps,
            "latency_s": link.latency_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "bench" / "gpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-tests", action="store_true", help="leave out tests/test_gpu.py")
    args = parser.parse_args()
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    machine = {"torch": torch.__version__, "cuda": cuda,
               "gpu": torch.cuda.get_device_name(0) if cuda else None, "cores": os.cpu_count()}
    rows = [pytest_row("--skip-tests" if args.skip_tests else "" if cuda else "no CUDA here")]
    rows += run_rows("cuda:0" if cuda else "cpu", args.out, args.steps)
    rows.append(copies_row("cuda:0" if cuda else "cpu"))
    if not cuda:
        rows.append({"check": "GPU rows", "ok": None, "why": "no CUDA here: the GPU worker was bound to the CPU"})
    (args.out / "gpu_checks.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    for row in rows:
        print(f"{row['check']:<40} {row['ok']!s:<5} " + ", ".join(f"{k}={v}" for k, v in row.items()
                                                              if k not in ("check", "ok")))
    print(f"wrote {args.out / 'gpu_checks.json'}")


if __name__ == "__main__":
    main()
