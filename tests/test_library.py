"""The guide's "As a library" flow, run as written: load_graph, make_plan, simulate and
run_plan working together."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import readme_walk  # noqa: E402


def test_the_guide_library_block_runs(cli, tmp_path, monkeypatch):
    block = next(c.text for c in readme_walk.walk_blocks() if c.kind == "python" and "run_plan(" in c.text)
    monkeypatch.chdir(tmp_path)
    assert cli("profile", "gpt2-tiny", "--batch-size", "8", "--seq-len", "32", "--device", "cpu:1", "-o",
               "tiny.json").code == 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")}
    check = "\nassert report.measured.method == 'measured' and report.summary()['steps'] == 5\n"
    proc = subprocess.run([sys.executable, "-c", block + check], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    predicted, measured, error = map(float, proc.stdout.splitlines()[0].split())
    assert predicted > 0 and measured > 0 and error == measured / predicted - 1
    assert len(eval(proc.stdout.splitlines()[1])) == 5  # noqa: S307 - our own printed list of losses
