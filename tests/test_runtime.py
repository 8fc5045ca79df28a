"""The runtime: pipelined training on worker processes equals single-process training."""

import json
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.graph import Edge, Graph, Node
from hetplan.io.clusters import cluster_from_spec
from hetplan.pieces.split import split_step
from hetplan.plan import Plan, Stage
from hetplan.rows import step_rows
from hetplan.runtime.checkpoint import latest_step
from hetplan.runtime.launch import WorkerFailure, launch, run_spec
from hetplan.runtime.settings import RunSettings
from hetplan.runtime.stages import stage_modules
from hetplan.runtime.worker import _batches
from hetplan.schedule import schedule_order
from hetplan.zoo import load_model
from slowness import limit_s
from test_executor import chain_plan, interleaved_plan, reference_step

THREE_CPUS = cluster_from_spec({"name": "three", "devices": [
    {"id": f"c{i}", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"} for i in range(3)]}, "three")


def model(name, batch=8, seq=16):
    zm = load_model(name, batch_size=batch, seq_len=seq, seed=0)
    for mod in zm.step.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    return zm


def three_stage_plan(split, m, schedule, cuts=None):
    names = [p.name for p in split.pieces]
    a, b = cuts or (len(names) // 3, 2 * len(names) // 3)
    return Plan((Stage(tuple(names[:a]), ("c0",)), Stage(tuple(names[a:b]), ("c1",)),
                 Stage(tuple(names[b:]), ("c2",))), m, schedule, "test")


def graph_of(split, batch_size, device_type="cpu-1t"):
    """A graph of the split's pieces with equal times on one CPU type (others are projected)."""
    nodes = [Node(p.name, p.op, {device_type: 1e-3}, {device_type: 2e-3}, flops=1e6) for p in split.pieces]
    made = {v: p.name for p in split.pieces for v in p.outputs}
    edges = {(made[v], p.name) for p in split.pieces for v in p.inputs if v in made and made[v] != p.name}
    return Graph("g", tuple(nodes), tuple(Edge(a, b, 1) for a, b in sorted(edges)), batch_size, device_type)


def run_and_compare(tmp_path, name, replicas, threads, m, schedule, batch_size=10, cuts=None):
    """Launch worker processes (gloo) for one SGD step and compare every rank's weights with
    single-process training; returns the spec and the result."""
    zm = model(name, batch_size)
    split = split_step(zm.step, zm.batch)
    names = [p.name for p in split.pieces]
    plan = chain_plan(names, replicas, m, schedule, cuts=cuts)
    devices = [{"id": f"c{i}", "type": "cpu", "threads": t, "binding": "cpu", "host": "here"}
               for i, t in enumerate(threads)]
    cluster = cluster_from_spec({"name": "mixed", "devices": devices}, "mixed")
    spec = run_spec(plan, cluster, name, RunSettings(batch_size=batch_size, seq_len=16, granularity="layer", steps=1,
                    warmup=0, optimizer="sgd", lr=0.1, out_dir=tmp_path, no_dropout=True, return_weights=True),
                    graph=graph_of(split, batch_size))
    result = launch(spec)
    ref_loss = reference_step(zm, _batches(spec, zm, 0), m, 0.1)
    assert result.losses[0] == pytest.approx(ref_loss, rel=1e-5)
    modules = stage_modules(split, plan)
    for rank, me in enumerate(spec.ranks):
        trained = torch.load(tmp_path / f"weights.{rank}.pt")
        worst = max(((trained[n] - p.detach()).abs().max().item() for n, p in modules[me.stage].named_parameters()),
                    default=0.0)  # a stage without parameters has none to compare
        assert worst <= 1e-5, (rank, worst)
    return spec, result


@pytest.mark.parametrize("replicas,threads,schedule", [
    ([3, 1], [1, 2, 1, 1], "gpipe"),  # 3 + 1: replicas of 1, 2 and 1 threads, then one worker
    # [1, 2, 1] under 1F1B: in threads (tests/test_executor.py), with replicas of different speeds
])
def test_uneven_replicas_of_different_thread_counts_equal_single_process(tmp_path, replicas, threads, schedule):
    spec, result = run_and_compare(tmp_path, "mlp", replicas, threads, 3, schedule)
    weights = spec.replica_weights[0 if replicas[0] > 1 else 1]
    assert weights[1] > weights[0]  # the 2-thread replica is faster: it gets more rows
    rows = step_rows(10, 3, spec.replica_weights)
    orders = schedule_order(schedule, len(replicas), 3)
    for r in result.ranks:  # each worker ran the simulator's order (less slices with no row)
        assert r["actions"] == [str(a) for a in orders[r["stage"]] if rows.rows(r["stage"], a.microbatch,
                                                                                 r["replica"]) > 0]


def test_a_stage_without_parameters_passes_integers_across_two_boundaries(tmp_path):
    """gpt2-tiny in three worker processes, the middle stage a lone dropout (no parameters, no
    optimizer), so token ids and labels (int64) cross two boundaries, on torch >= 2.11. One
    schedule: what crosses a boundary does not depend on it (the executor's test in threads
    runs 1F1B with more and fewer micro-batches than stages)."""
    schedule = "gpipe"
    names = [p.name for p in split_step(model("gpt2-tiny").step, model("gpt2-tiny").batch).pieces]
    middle = names.index("transformer.drop")
    run_and_compare(tmp_path, "gpt2-tiny", [1, 1, 1], [1, 1, 1], 4, schedule, batch_size=8,
                    cuts=[middle, middle + 1])


def test_zbv_sends_between_the_two_stages_of_one_worker_process(tmp_path):
    """ZB-V in two worker processes over gloo: the last worker holds stages 1 and 2, so it sends
    to itself, which gloo cannot (it has no pair from a rank to itself: "Pair is not connected"),
    so the message goes through the worker's own mailbox; the weights after one step equal one
    process's, stages 0 and 3 (the tied embedding's two ends) on worker 0. `--backend gloo` set
    (the other process runs here take the default, auto): ZB-V takes a gradient before an
    activation sent earlier, which only holds with each channel on its own group."""
    zm = model("gpt2-tiny", 8)
    split = split_step(zm.step, zm.batch, "layer", zm.block_classes)
    plan = interleaved_plan([p.name for p in split.pieces], [1, 1], 2, 4, "zb-v")
    assert plan.rank_stages == ((0, 3), (1, 2))
    cluster = cluster_from_spec({"name": "two", "devices": [
        {"id": f"c{i}", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"} for i in range(2)]}, "two")
    spec = run_spec(plan, cluster, "gpt2-tiny", RunSettings(batch_size=8, seq_len=16, granularity="layer", steps=1,
                    warmup=0, optimizer="sgd", lr=0.1, out_dir=tmp_path, no_dropout=True, return_weights=True,
                    backend="gloo"), graph=graph_of(split, 8))
    result = launch(spec)
    assert {r["backend"] for r in result.ranks} == {"gloo"}
    assert result.losses[0] == pytest.approx(reference_step(zm, _batches(spec, zm, 0), 4, 0.1), rel=1e-5)
    modules = stage_modules(split, plan)
    for rank, held in enumerate(plan.rank_stages):
        trained = torch.load(tmp_path / f"weights.{rank}.pt")
        assert set(trained) == {n for k in held for n, _ in modules[k].named_parameters()}
        for k in held:
            for n, p in modules[k].named_parameters():
                assert (trained[n] - p.detach()).abs().max().item() <= 1e-5, (rank, n)


def test_a_dead_worker_stops_every_worker_with_its_name(tmp_path):
    zm = model("gpt2-tiny")
    split = split_step(zm.step, {k: v[:2] for k, v in zm.batch.items()})
    plan = three_stage_plan(split, 4, "1f1b")
    spec = run_spec(plan, THREE_CPUS, "gpt2-tiny", RunSettings(batch_size=8, seq_len=16, granularity="layer", steps=2,
                    out_dir=tmp_path, timeout_s=30))
    spec = replace(spec, model="no-such-model")  # every worker fails while building its stage
    with pytest.raises(WorkerFailure, match=r"worker \d \(stage \d, device c\d\): HetplanError: unknown model"):
        launch(spec)
    assert json.loads((tmp_path / "run.json").read_text())["model"] == "no-such-model"


def two_stage(tmp_path, steps, name="gpt2-tiny", **kw):
    zm = model(name)
    split = split_step(zm.step, {k: v[:2] for k, v in zm.batch.items()})
    names = [p.name for p in split.pieces]
    half = len(names) // 2
    plan = Plan((Stage(tuple(names[:half]), ("c0",)), Stage(tuple(names[half:]), ("c1",))), 4, "1f1b", "test")
    return run_spec(plan, THREE_CPUS, name, RunSettings(batch_size=8, seq_len=16, granularity="layer",
                    steps=steps, out_dir=tmp_path, **kw))


@pytest.mark.parametrize("fault", ["hang", "die"])
def test_a_hung_or_dead_worker_stops_everyone_in_time(tmp_path, monkeypatch, fault):
    spec = two_stage(tmp_path / "run", 4, "mlp", timeout_s=8, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1)
    monkeypatch.setenv("HETPLAN_FAULT", f"{fault}:1:2")
    t = time.time()
    with pytest.raises(WorkerFailure, match="worker 1 \\(stage 1, device c1\\)") as err:
        launch(spec)
    assert time.time() - t < limit_s(60)
    if fault == "hang":  # worker 1 stops inside step 2: worker 0 waits for its gradients, and says so
        assert "no worker made progress for 8 s" in str(err.value) and "c1) at step 2;" in str(err.value)
        assert ("worker 0 (stage 0, device c0) at step 2, waiting at 0RECV_B0<-1 for micro-batch 0's gradients "
                "from worker 1;") in str(err.value)
    # the checkpoint of step 2, written before the fault, is whole and loads
    assert latest_step(tmp_path / "ckpt") == 2


def test_loss_falls_on_text_and_resume_continues_the_same_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    full = launch(two_stage(tmp_path / "full", 10, data="text", lr=3e-3, checkpoint_dir=ckpt, checkpoint_every=7))
    assert len(full.losses) == 10
    assert sum(full.losses[-5:]) / 5 < sum(full.losses[:5]) / 5 - 0.2  # byte-level loss starts near ln 256
    assert latest_step(ckpt) == 10  # steps 7 and 10 kept
    resumed = launch(two_stage(tmp_path / "b", 11, data="text", lr=3e-3, checkpoint_dir=ckpt, resume_step=7))
    # the same run, steps 7-9 (the optimizer's state too: step 7's update shows in step 8's loss)
    assert resumed.losses[:3] == pytest.approx(full.losses[7:10], abs=1e-5)
    assert len(resumed.losses) == 4
    assert latest_step(ckpt) == 11  # without --checkpoint-every, the last step is saved


def run_torchrun_agents(commands):
    """The `hetplan run --dry-run` commands, each a torchrun agent on this machine; all must end well."""
    import subprocess
    import sys
    from pathlib import Path

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    procs = [subprocess.Popen([torchrun, *cmd.split()[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for cmd in commands]
    outs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


def test_runtime_runs_only_bound_cpu_devices(tmp_path):
    from hetplan.io.clusters import load_cluster

    zm = model("gpt2-tiny")
    split = split_step(zm.step, {k: v[:2] for k, v in zm.batch.items()})
    names = tuple(p.name for p in split.pieces)
    with pytest.raises(HetplanError, match="device a0 of cluster 'hetero-4' has no binding, so it can only be"):
        run_spec(Plan((Stage(names, ("a0",)),), 4, "1f1b", "test"), load_cluster("hetero-4"), "gpt2-tiny",
                 RunSettings(batch_size=8, seq_len=16, granularity="layer", out_dir=tmp_path))
    gpu = cluster_from_spec({"devices": [{"id": "g", "type": "a100-40gb", "binding": "cuda:0"}]}, "gpu")
    spec = run_spec(Plan((Stage(names, ("g",)),), 4, "1f1b", "test"), gpu, "gpt2-tiny", RunSettings(batch_size=8,
                    seq_len=16, granularity="layer", out_dir=tmp_path))
    assert spec.ranks[0].binding == "cuda:0"  # a spec for torchrun on a GPU machine is fine
    if not torch.cuda.is_available():
        with pytest.raises(HetplanError, match="bound to cuda:0, but this machine has no CUDA GPUs: bind it to cpu"):
            launch(spec)


def test_local_cpu_workers_get_their_own_cores(monkeypatch):
    import os

    from hetplan.runtime.launch import pin_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 8, 9, 10, 11})
    assert pin_cores([1, 2, 4]) == [[4], [5, 6], [7, 8, 9, 10]]
    assert pin_cores([4, 0, 4]) == [[4, 5, 6, 7], [], [8, 9, 10, 11]]  # a GPU worker takes no core
    assert pin_cores([4, 4, 1]) == [[], [], []]  # more threads than cores: the OS decides


def test_torchrun_three_hosts_with_replicas_across_hosts_equals_one_process(tmp_path):
    """The worker entry point under torchrun, as the commands `hetplan run --dry-run` prints:
    three "hosts" (three torchrun agents on this machine), stage 0's replicas on m0 and m1, stage
    1's on m0 and m2, so the plan goes back and forth between hosts. RUN.json lists the ranks host
    by host, as torchrun numbers them; the weights equal one process's. At the end rank 0 says
    what it measured against the prediction and leaves the folder `hetplan report` draws."""
    from hetplan.cli import main
    from hetplan.runtime.launch import torchrun_commands
    from hetplan.runtime.run import write_for_elsewhere

    hosts = {"a": "m0", "b": "m1", "c": "m0", "d": "m2"}
    cluster = cluster_from_spec({"name": "three-hosts", "devices": [
        {"id": d, "type": "cpu", "threads": 1, "binding": "cpu", "host": h} for d, h in hosts.items()]}, "three")
    zm = model("mlp", batch=8)
    split = split_step(zm.step, zm.batch)
    names = [p.name for p in split.pieces]
    half = len(names) // 2
    plan = Plan((Stage(tuple(names[:half]), ("a", "b")), Stage(tuple(names[half:]), ("c", "d"))), 2, "1f1b", "test")
    spec = run_spec(plan, cluster, "mlp", RunSettings(batch_size=8, seq_len=16, granularity="layer", steps=1,
                    warmup=0, optimizer="sgd", lr=0.1, out_dir=tmp_path, no_dropout=True, return_weights=True),
                    graph=graph_of(split, 8))
    assert [r.device for r in spec.ranks] == ["a", "c", "b", "d"]  # m0's two, then m1's, then m2's
    path = write_for_elsewhere(spec, graph_of(split, 8), cluster)
    port = 29500 + (abs(hash(str(tmp_path)) + 7) % 1000)
    commands = torchrun_commands(path, spec, master_port=port)
    assert [c.split("--nproc-per-node ")[1].split()[0] for c in commands] == ["2", "1", "1"]
    assert [c.split("--node-rank ")[1].split()[0] for c in commands] == ["0", "1", "2"]
    outs = run_torchrun_agents(commands)
    finished = [line for out in outs for line in out.splitlines() if "hetplan: run finished:" in line]
    assert len(finished) == 1 and "ms a step measured (predicted" in finished[0] and "1 step, loss" in finished[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["predicted_step_s"] > 0
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "page.html")]) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert [r["device"] for r in sorted(result["ranks"], key=lambda r: r["rank"])] == ["a", "c", "b", "d"]
    losses = [r["losses"][0] for r in result["ranks"] if r["stage"] == 1]
    assert sum(losses) == pytest.approx(reference_step(zm, _batches(spec, zm, 0), 2, 0.1), rel=1e-5)
    modules = stage_modules(split, plan)
    for rank, me in enumerate(spec.ranks):
        trained = torch.load(tmp_path / f"weights.{rank}.pt")
        worst = max((trained[n] - p.detach()).abs().max().item() for n, p in modules[me.stage].named_parameters())
        assert worst <= 1e-5, (rank, me.device, worst)
