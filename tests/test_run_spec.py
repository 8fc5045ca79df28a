"""RUN.json as a typed spec (`hetplan.runtime.spec`): what `run_spec` makes goes through JSON and
comes back equal, field for field, and the file the launcher writes is that JSON."""

import json
from dataclasses import replace
from pathlib import Path

from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import cluster_from_spec
from hetplan.plan import Estimate, Plan, Stage
from hetplan.runtime.launch import run_spec, torchrun_commands, write_spec
from hetplan.runtime.settings import RunSettings
from hetplan.runtime.spec import RankSpec, RunSpec

RUN_JSON_KEYS = ["plan", "model", "settings", "replica_weights", "ranks"]
SETTINGS_KEYS = ["steps", "warmup", "batch_size", "seq_len", "granularity", "block_classes", "seed", "optimizer",
                 "lr", "data", "out_dir", "timeout_s", "backend", "checkpoint_dir", "checkpoint_every", "resume",
                 "elastic", "no_dropout", "trace", "return_weights", "resume_step"]


def graph(n=6, batch=12):
    nodes = tuple(Node(f"n{i}", "Linear", {"cpu-1t": 1e-3 * (i + 1)}, {"cpu-1t": 2e-3 * (i + 1)}, flops=1e7 * (i + 1),
                       param_bytes=4000 * i, act_bytes=1000) for i in range(n))
    return Graph("g", nodes, tuple(Edge(f"n{i}", f"n{i + 1}", 4096) for i in range(n - 1)), batch, "cpu-1t")


def realistic(tmp_path: Path) -> RunSpec:
    """Three stages over two hosts: two CPU replicas of different speeds, a 4-thread CPU worker
    and a GPU, a plan with its prediction and a planner's settings, every setting off its default."""
    cluster = cluster_from_spec({"name": "mixed", "devices": [
        {"id": "c0", "type": "cpu", "threads": 1, "binding": "cpu", "host": "m0"},
        {"id": "c1", "type": "cpu", "threads": 2, "binding": "cpu", "host": "m0"},
        {"id": "c2", "type": "cpu", "threads": 4, "binding": "cpu", "host": "m0"},
        {"id": "g0", "type": "a100-40gb", "binding": "cuda:0", "host": "m1"}]}, "mixed")
    predicted = Estimate(step_s=0.0123, samples_per_s=975.6, busy_s={"c0": 0.004, "c1": 0.0035, "c2": 0.006},
                         peak_mem_bytes={"c0": 123456, "c1": 123456, "c2": 654321, "g0": 99}, bubble_fraction=0.25,
                         link_bytes={"c1->c2": 4096, "c2->g0": 8192}, usd_per_step=1.5e-7, feasible=True,
                         link_busy_s={"c1->c2": 1e-5})
    plan = Plan((Stage(("n0", "n1"), ("c0", "c1")), Stage(("n2", "n3"), ("c2",)), Stage(("n4", "n5"), ("g0",))),
                4, "1f1b", "dp", graph="g", cluster="mixed", predicted=predicted,
                meta={"seed": 3, "planning_s": 0.25, "search": {"iters": [1, 2, 3]}})
    return run_spec(plan, cluster, "gpt2-tiny", RunSettings(batch_size=12, seq_len=16, granularity="block",
                    block_classes=("GPT2Block",), steps=20, warmup=3, seed=7, optimizer="sgd", lr=3e-3, data="text",
                    out_dir=tmp_path / "run", timeout_s=45.5, no_dropout=True, return_weights=True,
                    checkpoint_dir=tmp_path / "ckpt", checkpoint_every=5, trace=True, resume=True, resume_step=10),
                    graph=graph())


def test_a_realistic_spec_round_trips_through_json(tmp_path):
    spec = realistic(tmp_path)
    assert RunSpec.from_json(spec.to_json()) == spec
    weights = spec.replica_weights
    assert len(weights) == 3 and weights[0][1] > weights[0][0]  # the 2-thread replica is faster
    assert spec.ranks == (RankSpec(0, 0, "c0", "m0", "cpu", 1), RankSpec(0, 1, "c1", "m0", "cpu", 2),
                          RankSpec(1, 0, "c2", "m0", "cpu", 4), RankSpec(2, 0, "g0", "m1", "cuda:0", 1))
    assert spec.world == 4 and spec.ranks[3].on_cuda and not spec.ranks[0].on_cuda
    # the file the launcher writes and every worker reads
    path = write_spec(spec)
    assert path == tmp_path / "run" / "run.json"
    assert RunSpec.from_json(path.read_text()) == spec
    data = json.loads(path.read_text())
    assert list(data) == RUN_JSON_KEYS and list(data["settings"]) == SETTINGS_KEYS
    assert data["settings"]["out_dir"] == str(tmp_path / "run")
    assert data["settings"]["checkpoint_dir"] == str(tmp_path / "ckpt")
    assert data["ranks"][3] == {"stage": 2, "replica": 0, "device": "g0", "host": "m1", "binding": "cuda:0",
                                "threads": 1, "tp": 0}
    assert len(torchrun_commands(path, spec)) == 2  # one per host


def test_defaults_round_trip_and_optional_settings_may_be_left_out(tmp_path):
    spec = realistic(tmp_path)
    spec = replace(spec, settings=replace(spec.settings, seq_len=None, checkpoint_dir=None, block_classes=(),
                                          resume_step=0))
    assert RunSpec.from_json(spec.to_json()) == spec
    data = spec.to_dict()
    for key in ("block_classes", "no_dropout", "return_weights", "checkpoint_dir", "checkpoint_every", "resume_step",
                "data"):
        del data["settings"][key]
    bare = RunSpec.from_dict(data)
    assert bare == replace(spec, settings=replace(spec.settings, no_dropout=False, return_weights=False,
                                                  checkpoint_every=0, data="synthetic"))


def test_lists_and_text_paths_become_tuples_and_paths(tmp_path):
    spec = realistic(tmp_path)
    spec = replace(spec, replica_weights=[[1.0, 2.0], [1.0], [1.0]],
                   settings=replace(spec.settings, out_dir=str(tmp_path / "x"), block_classes=["Block"]))
    assert spec.replica_weights == ((1.0, 2.0), (1.0,), (1.0,)) and spec.settings.out_dir == tmp_path / "x"
    assert spec.settings.block_classes == ("Block",)
    assert hash(spec) == hash(RunSpec.from_json(spec.to_json()))
