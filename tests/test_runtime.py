"""The runtime: pipelined training on worker processes equals single-process training."""

import json
import time

import pytest
import torch
from torch import nn

from hetplan.cluster import cluster_from_spec
from hetplan.errors import HetplanError
from hetplan.plan import Plan, Stage
from hetplan.profile.split import split_step
from hetplan.runtime.checkpoint import checkpoint_step
from hetplan.runtime.launch import WorkerFailure, launch, run_spec
from hetplan.runtime.stages import stage_modules, stage_specs
from hetplan.runtime.worker import _batches
from hetplan.zoo import load_model

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


def reference_step(zm, batch, m, lr):
    """Single process: the same micro-batches one after the other (batch norm sees micro-batches,
    as in the pipeline), mean of their losses, one SGD step."""
    opt = torch.optim.SGD(zm.step.parameters(), lr=lr)
    opt.zero_grad()
    chunks = {k: v.tensor_split(m) for k, v in batch.items()}
    for i in range(m):
        (zm.step(**{k: c[i] for k, c in chunks.items()}) / m).backward()
    opt.step()


@pytest.mark.parametrize("name,schedule,granularity", [
    ("gpt2-tiny", "gpipe", "layer"), ("gpt2-tiny", "1f1b", "layer"), ("inception-tiny", "1f1b", "layer"),
])
def test_pipelined_step_equals_single_process(tmp_path, name, schedule, granularity):
    batch_size, m, lr = 8, 4, 0.1
    zm = model(name, batch_size)
    split = split_step(zm.step, {k: v[:batch_size // m] for k, v in zm.batch.items()}, granularity=granularity)
    plan = three_stage_plan(split, m, schedule)
    specs = stage_specs(split, plan)
    if name == "inception-tiny":  # branches cross the boundaries: several tensors are relayed
        assert max(len(s.outputs) for s in specs[:-1]) >= 2
    spec = run_spec(plan, THREE_CPUS, name, batch_size=batch_size, seq_len=16, granularity=granularity, steps=1,
                    warmup=0, optimizer="sgd", lr=lr, out_dir=tmp_path, no_dropout=True, return_weights=True)
    result = launch(spec)
    assert result.steps == 1 and len(result.losses) == 1
    batch = _batches(spec, zm, 0)
    modules = stage_modules(split, plan)  # share the model's parameters
    before = {id(p): p.detach().clone() for p in zm.step.parameters()}
    reference_step(zm, batch, m, lr)
    worst, moved = 0.0, 0.0
    for k, module in enumerate(modules):
        trained = torch.load(tmp_path / f"weights.{k}.pt")
        for pname, p in module.named_parameters():
            worst = max(worst, (trained[pname] - p.detach()).abs().max().item())
            moved = max(moved, (p.detach() - before[id(p)]).abs().max().item())
    assert moved > 1e-4  # the step changed the weights...
    assert worst <= 1e-5  # ...exactly as single-process training does


def test_runtime_refuses_what_it_cannot_run(tmp_path):
    zm = model("gpt2-tiny")
    split = split_step(zm.step, {k: v[:2] for k, v in zm.batch.items()})
    plan = three_stage_plan(split, 3, "1f1b")
    with pytest.raises(HetplanError, match=r"batch \(8\) to be a multiple of micro-batches x replicas \(3 x 1\)"):
        run_spec(plan, THREE_CPUS, "gpt2-tiny", batch_size=8, seq_len=16, granularity="layer", out_dir=tmp_path)
    names = [p.name for p in split.pieces]
    replicated = Plan((Stage(tuple(names[:20]), ("c0", "c1")), Stage(tuple(names[20:]), ("c2",))), 2, "1f1b", "test")
    with pytest.raises(HetplanError, match="only when every stage has the same number of replicas"):
        run_spec(replicated, THREE_CPUS, "gpt2-tiny", batch_size=8, seq_len=16, granularity="layer",
                 out_dir=tmp_path)


def test_a_dead_worker_stops_every_worker_with_its_name(tmp_path):
    zm = model("gpt2-tiny")
    split = split_step(zm.step, {k: v[:2] for k, v in zm.batch.items()})
    plan = three_stage_plan(split, 4, "1f1b")
    spec = run_spec(plan, THREE_CPUS, "gpt2-tiny", batch_size=8, seq_len=16, granularity="layer", steps=2,
                    out_dir=tmp_path, timeout_s=30)
    spec["model"] = "no-such-model"  # every worker fails while building its stage
    with pytest.raises(WorkerFailure, match=r"worker \d \(stage \d, device c\d\): HetplanError: unknown model"):
        launch(spec)
    assert json.loads((tmp_path / "run.json").read_text())["model"] == "no-such-model"


def two_stage(tmp_path, steps, **kw):
    zm = model("gpt2-tiny")
    split = split_step(zm.step, {k: v[:2] for k, v in zm.batch.items()})
    names = [p.name for p in split.pieces]
    half = len(names) // 2
    plan = Plan((Stage(tuple(names[:half]), ("c0",)), Stage(tuple(names[half:]), ("c1",))), 4, "1f1b", "test")
    return run_spec(plan, THREE_CPUS, "gpt2-tiny", batch_size=8, seq_len=16, granularity="layer", steps=steps,
                    out_dir=tmp_path, **kw)


@pytest.mark.parametrize("fault", ["hang", "die"])
def test_a_hung_or_dead_worker_stops_everyone_in_time(tmp_path, monkeypatch, fault):
    spec = two_stage(tmp_path / "run", 4, timeout_s=8, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1)
    monkeypatch.setenv("HETPLAN_FAULT", f"{fault}:1:2")
    t = time.time()
    with pytest.raises(WorkerFailure, match="worker 1 \\(stage 1, device c1\\)") as err:
        launch(spec)
    assert time.time() - t < 60
    if fault == "hang":
        assert "no worker made progress for 8 s" in str(err.value) and "c1) at step 2" in str(err.value)
    # the checkpoint of step 2, written before the fault, is whole and loads
    assert checkpoint_step(tmp_path / "ckpt", 2) == 2


def test_loss_falls_on_text_and_resume_continues_the_same_run(tmp_path):
    full = launch(two_stage(tmp_path / "full", 20, data="text", lr=3e-3))
    assert len(full.losses) == 20
    assert sum(full.losses[-5:]) / 5 < sum(full.losses[:5]) / 5 - 0.2  # byte-level loss starts near ln 256
    ckpt = tmp_path / "ckpt"
    launch(two_stage(tmp_path / "a", 6, data="text", lr=3e-3, checkpoint_dir=ckpt, checkpoint_every=3))
    assert checkpoint_step(ckpt, 2) == 6
    resumed = launch(two_stage(tmp_path / "b", 20, data="text", lr=3e-3, checkpoint_dir=ckpt, resume_step=6))
    assert resumed.losses == pytest.approx(full.losses[6:], abs=1e-5)


def test_torchrun_two_nodes_on_loopback(tmp_path):
    """The worker entry point under torchrun: two "machines" (two torchrun agents on this host)
    with one worker each, as the commands `hetplan run --dry-run` prints."""
    import subprocess
    import sys
    from pathlib import Path

    from hetplan.runtime.launch import torchrun_commands, write_spec

    two_hosts = cluster_from_spec({"name": "two", "devices": [
        {"id": "a", "type": "cpu", "threads": 1, "binding": "cpu", "host": "m0"},
        {"id": "b", "type": "cpu", "threads": 1, "binding": "cpu", "host": "m1"}]}, "two")
    zm = model("gpt2-tiny")
    split = split_step(zm.step, {k: v[:2] for k, v in zm.batch.items()})
    names = [p.name for p in split.pieces]
    plan = Plan((Stage(tuple(names[:20]), ("a",)), Stage(tuple(names[20:]), ("b",))), 4, "gpipe", "test")
    spec = run_spec(plan, two_hosts, "gpt2-tiny", batch_size=8, seq_len=16, granularity="layer", steps=2,
                    warmup=0, out_dir=tmp_path)
    path = write_spec(spec)
    port = 29500 + (abs(hash(str(tmp_path))) % 1000)
    commands = torchrun_commands(path, spec, master_port=port)
    assert len(commands) == 2 and "--node-rank 1" in commands[1]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    procs = [subprocess.Popen([torchrun, *cmd.split()[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for cmd in commands]
    outs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    result = json.loads((tmp_path / "result.json").read_text())
    assert [r["device"] for r in result["ranks"]] == ["a", "b"] and len(result["ranks"][1]["losses"]) == 2


def test_replicated_stages_equal_single_process(tmp_path):
    """Two pipelines of two stages side by side (each stage replicated on two workers), each on
    half the batch: after one step the weights equal those of single-process training."""
    four = cluster_from_spec({"name": "four", "devices": [
        {"id": f"c{i}", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"} for i in range(4)]}, "four")
    batch_size, m, lr = 8, 2, 0.1
    zm = model("gpt2-tiny", batch_size)
    split = split_step(zm.step, {k: v[:batch_size // (2 * m)] for k, v in zm.batch.items()})
    names = [p.name for p in split.pieces]
    plan = Plan((Stage(tuple(names[:20]), ("c0", "c2")), Stage(tuple(names[20:]), ("c1", "c3"))), m, "1f1b", "test")
    spec = run_spec(plan, four, "gpt2-tiny", batch_size=batch_size, seq_len=16, granularity="layer", steps=1,
                    warmup=0, optimizer="sgd", lr=lr, out_dir=tmp_path, no_dropout=True, return_weights=True)
    assert [(r["stage"], r["pipeline"], r["device"]) for r in spec["ranks"]] == [
        (0, 0, "c0"), (1, 0, "c1"), (0, 1, "c2"), (1, 1, "c3")]
    launch(spec)
    batch = _batches(spec, zm, 0)
    modules = stage_modules(split, plan)
    opt = torch.optim.SGD(zm.step.parameters(), lr=lr)
    opt.zero_grad()
    zm.step(**batch).backward()  # the whole batch at once: gpt2 has no batch norm
    opt.step()
    for rank, k in ((0, 0), (1, 1), (2, 0), (3, 1)):
        trained = torch.load(tmp_path / f"weights.{rank}.pt")
        worst = max((trained[n] - p.detach()).abs().max().item() for n, p in modules[k].named_parameters())
        assert worst <= 1e-5, (rank, worst)


def test_runtime_runs_only_bound_cpu_devices(tmp_path):
    from hetplan.cluster import load_cluster

    zm = model("gpt2-tiny")
    split = split_step(zm.step, {k: v[:2] for k, v in zm.batch.items()})
    names = tuple(p.name for p in split.pieces)
    with pytest.raises(HetplanError, match="device a0 of cluster 'hetero-4' has no binding, so it can only be"):
        run_spec(Plan((Stage(names, ("a0",)),), 4, "1f1b", "test"), load_cluster("hetero-4"), "gpt2-tiny",
                 batch_size=8, seq_len=16, granularity="layer", out_dir=tmp_path)
    gpu = cluster_from_spec({"devices": [{"id": "g", "type": "a100-40gb", "binding": "cuda:0"}]}, "gpu")
    spec = run_spec(Plan((Stage(names, ("g",)),), 4, "1f1b", "test"), gpu, "gpt2-tiny",
                    batch_size=8, seq_len=16, granularity="layer", out_dir=tmp_path)
    assert spec["ranks"][0]["binding"] == "cuda:0"  # a spec for torchrun on a GPU machine is fine
    if not torch.cuda.is_available():
        with pytest.raises(HetplanError, match="bound to cuda:0, but this machine has no CUDA GPUs: bind it to cpu"):
            launch(spec)


def test_runtime_refuses_1f1b_with_fewer_microbatches_than_stages(tmp_path):
    zm = model("gpt2-tiny")
    split = split_step(zm.step, {k: v[:2] for k, v in zm.batch.items()})
    plan = three_stage_plan(split, 2, "1f1b")
    with pytest.raises(HetplanError, match="needs at least as many micro-batches as stages .* --microbatches 3"):
        run_spec(plan, THREE_CPUS, "gpt2-tiny", batch_size=8, seq_len=16,
                 granularity="layer", out_dir=tmp_path)


def test_host_boundary_passes_values_and_gradients_through():
    """What a GPU stage does around its module, checked on the CPU: same outputs, same input and
    weight gradients, CPU tensors out (the move to a GPU itself needs a GPU machine)."""
    from hetplan.runtime.stages import HostBoundary

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    x = torch.randn(5, 4, requires_grad=True)
    ref = inner(x)
    ref.sum().backward()
    gx, gw = x.grad.clone(), inner[0].weight.grad.clone()
    x.grad, inner[0].weight.grad = None, None
    out = HostBoundary(inner, torch.device("cpu"))(x)
    assert out.device.type == "cpu" and torch.equal(out, ref)
    out.sum().backward()
    assert torch.equal(x.grad, gx) and torch.equal(inner[0].weight.grad, gw)


def test_local_cpu_workers_get_their_own_cores(monkeypatch):
    import os

    from hetplan.runtime.launch import pin_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 8, 9, 10, 11})
    assert pin_cores([1, 2, 4]) == [[4], [5, 6], [7, 8, 9, 10]]
    assert pin_cores([4, 0, 4]) == [[4, 5, 6, 7], [], [8, 9, 10, 11]]  # a GPU worker takes no core
    assert pin_cores([4, 4, 1]) == [[], [], []]  # more threads than cores: the OS decides
