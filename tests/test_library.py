"""The guide's "As a library" flow, run as written: load_graph, make_plan, simulate and
run_plan working together."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import readme_walk  # noqa: E402


def test_the_guide_library_block_runs(cli, tmp_path, monkeypatch, capsys):
    """The block as written, in this process (whose worker server has torch and transformers
    imported already: a fresh process's start, and a script's, are tests/test_forked.py's)."""
    block = next(c.text for c in readme_walk.walk_blocks() if c.kind == "python" and "run_plan(" in c.text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli("profile", "gpt2-tiny", "--batch-size", "8", "--seq-len", "32", "--device", "cpu:1", "-o",
               "tiny.json").code == 0
    names: dict = {"__name__": "guide"}
    exec(compile(block, "docs/guide.md", "exec"), names)  # noqa: S102 - the guide's own block
    report = names["report"]
    assert report.measured.method == "measured" and report.summary()["steps"] == 5
    printed = capsys.readouterr().out.splitlines()
    predicted, measured, error = map(float, printed[0].split())
    assert predicted > 0 and measured > 0 and error == measured / predicted - 1
    assert len(eval(printed[1])) == 5  # noqa: S307 - our own printed list of losses
