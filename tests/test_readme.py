"""The commands of the README and the guide (docs/guide.md), walked in that order: each parses,
none reads a file that no earlier command wrote or a plan made for another cluster (a section
that overwrites plan.json with a plan for another cluster breaks every later command that reads
it), and the README's first block runs. The whole walk is `bench/readme_walk.py`
(minutes). The README stays a page a newcomer reads: at most 200 lines."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import readme_walk  # noqa: E402

from hetplan import load_cluster, load_graph  # noqa: E402
from hetplan.cli._shared import graph_at_batch  # noqa: E402


def test_every_readme_command_parses_and_reads_only_what_an_earlier_one_wrote():
    commands = readme_walk.walk_blocks()
    assert {c.source for c in commands} == {"README", "docs/guide.md"}
    assert readme_walk.check(commands) == []


def test_the_readme_is_short_and_links_every_page_of_the_docs():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for page in (REPO / "docs").glob("*.md"):
        assert f"docs/{page.name}" in text, page.name


def test_the_walk_finds_a_plan_used_with_another_cluster(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("```\nhetplan plan g.json --cluster hetero-4 -o plan.json\n```\n"
                      "```\nhetplan import pipedream ../shared/x.txt -o g.json\n"
                      "hetplan plan g.json --cluster a100+v100-8 -o plan.json\n"
                      "hetplan simulate plan.json --graph g.json --cluster hetero-4\n```\n")
    assert readme_walk.check(readme_walk.blocks(readme)) == [
        "README line 2: reads g.json, which no earlier command wrote",
        "README line 7: plan.json was planned for a100+v100-8, used with hetero-4"]


def test_the_quick_start_runs():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "readme_walk.py"), "--quick"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 problems in the README's commands, 0 commands failed" in proc.stdout


def test_the_language_model_section_runs(tmp_path):
    """Its five commands, verbatim: a counted OPT-350M planned on 128 mixed GPUs at a batch of 1,024.
    dp uses the big mixed cluster: at least 96 of its GPUs (its device program alone once put 4
    replicas a stage on 40 of them, 21.1 s a step), within 1.6 times the bound of the whole
    batch's work over every GPU's speed."""
    text = (REPO / "docs" / "guide.md").read_text().splitlines()
    start = text.index("## Planning a language model on a big mixed cluster") + 1
    end = next(i for i in range(start, len(text)) if text[i].startswith("## ")) + 1
    commands = [c for c in readme_walk.blocks(REPO / "docs" / "guide.md") if start < c.line < end]
    assert len(commands) == 5 and readme_walk.check(commands) == []
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    for cmd in commands:
        proc = subprocess.run(["bash", "-c", cmd.text], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, cmd.text + "\n" + proc.stderr
    assert "feasible: yes" in proc.stdout  # the simulation, at the plan's batch
    plan = json.loads((tmp_path / "opt-plan.json").read_text())
    assert plan["meta"]["batch_size"] == 1024 and plan["microbatches"] > 1
    assert sum(len(stage["devices"]) for stage in plan["stages"]) >= 96
    graph = graph_at_batch(load_graph(tmp_path / "opt.json"), 1024)
    cluster = load_cluster("a100x32+v100x96")
    whole = {t: graph.fwd_s_total(t) + graph.bwd_s_total(t) for t in ("a100-40gb", "v100-16gb")}
    lower = 1.0 / sum(1.0 / whole[cluster.device(d).type] for d in cluster.ids)  # the work over every GPU
    assert plan["predicted"]["feasible"] and lower < plan["predicted"]["step_s"] < min(1.6 * lower, 8.0)
