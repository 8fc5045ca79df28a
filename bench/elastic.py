"""`hetplan run --elastic`, measured: gpt2-tiny on 4 one-thread CPU workers (4 stages), 40 steps,
a checkpoint every 5; when every worker has begun step 17, the last stage's worker is killed
(SIGKILL, from outside, found by its heartbeat's pid). The launcher re-plans on the 3 workers
left and goes on from the last checkpoint. Per run: the seconds from the kill to the launcher
seeing it, from the kill to every worker training again (re-planning, starting the workers,
tracing the model, loading the checkpoint), the steps lost, the new plan, and that all 40 steps
ended with exit 0.

    .venv/bin/python bench/elastic.py [--runs 3] [--out out/bench/elastic]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CLUSTER = {"name": "four", "devices": [
    {"id": f"c{i}", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"} for i in range(4)]}
STEPS, KILL_AT, EVERY = 40, 17, 5


def hetplan(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetplan", *args], capture_output=True, text=True, **kw)


def _beats(out: Path) -> list[dict]:
    beats = []
    for f in out.glob("heartbeat.*"):
        with contextlib.suppress(OSError, ValueError):
            beats.append(json.loads(f.read_text()))
    return beats


def one_run(folder: Path, plan: Path, graph: Path, cluster: Path) -> dict:
    out, ck = folder / "run", folder / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "hetplan", "run", str(plan), "--model", "gpt2-tiny", "--graph",
                             str(graph), "--cluster", str(cluster), "--steps", str(STEPS), "--checkpoint-dir", str(ck),
                             "--checkpoint-every", str(EVERY), "--elastic", "--out", str(out), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed_at = None
    while proc.poll() is None and killed_at is None:
        beats = _beats(out)
        if len(beats) == 4 and all(b.get("phase") == "step" and b.get("step", -1) >= KILL_AT for b in beats):
            victim = next(b for b in beats if b.get("stage") == 3)
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at = time.time()
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=600)
    if proc.returncode != 0 or killed_at is None:
        return {"exit": proc.returncode, "killed": killed_at is not None, "stderr": stderr[-2000:]}
    result = json.loads(stdout)
    [change] = result["changes"]
    return {"exit": 0, "steps": len(result["losses"]) + change["from_step"],
            "detected_s": change["failed_epoch_s"] - killed_at,
            "kill_to_training_s": change["failed_epoch_s"] + change["restart_s"] - killed_at,
            "steps_lost": change["steps_lost"], "at_step": change["at_step"], "from_step": change["from_step"],
            "new_stages": change["stages"], "new_workers": change["workers"],
            "predicted_step_s": change["predicted_step_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("out/bench/elastic"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    graph, plan, cluster = args.out / "g.json", args.out / "p.json", args.out / "four.json"
    cluster.write_text(json.dumps(CLUSTER))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for cmd in (["profile", "gpt2-tiny", "--batch-size", "8", "--seq-len", "32", "-o", str(graph)],
                ["plan", str(graph), "--cluster", str(cluster), "--planner", "uniform", "--max-replicas", "1",
                 "-o", str(plan)]):
        done = hetplan(*cmd)
        assert done.returncode == 0, done.stderr
    rows = []
    for i in range(args.runs):
        folder = args.out / f"run{i}"
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        rows.append(one_run(folder, plan, graph, cluster))
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "elastic.json").write_text(json.dumps({"runs": rows, "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
