"""Checkpoints any plan of the model loads (`runtime.checkpoint`, `runtime.held`): gpt2-tiny (its
embedding tied to the head across the stages) trained 2 steps with Adam as 2 stages, checkpointed,
and resumed for 3 more as 1 stage, as 2 replicas, as 2 replicas sharding their state (ZeRO 1 and
3), as a 2-way tensor-parallel stage: each resumed run's losses equal those of the 2-stage run
that never stopped (pipelined training equals one process's whatever the plan, so a change of
plan at a step is a change of float order only); and what each of them wrote, resumed as 2 stages
again, too. Resumed onto the same plan, bit for bit."""

import shutil
from dataclasses import replace

import pytest
import torch

from hetplan.errors import HetplanError
from hetplan.pieces.split import split_step
from hetplan.plan import Plan, Stage
from hetplan.runtime.checkpoint import latest_step, step_dir
from hetplan.runtime.launch import launch, run_spec
from hetplan.runtime.local import run_threads
from hetplan.runtime.run import _resume_step
from hetplan.runtime.settings import RunSettings
from hetplan.runtime.traces import SharedTraces
from hetplan.zoo import load_model
from hetplan.zoo.faithful import switch_off_dropout
from test_executor import cpus

MODEL, BATCH, SEQ, STEPS, BACK = "gpt2-tiny", 8, 16, 5, 7


@pytest.fixture(scope="module")
def names():
    zm = load_model(MODEL, batch_size=BATCH, seq_len=SEQ, seed=0)
    switch_off_dropout(zm.step)
    return [p.name for p in split_step(zm.step, zm.batch, granularity="block", block_classes=zm.block_classes).pieces]


def plan_of(names, stages, m=2, schedule="1f1b"):
    """A chain cut evenly into len(stages) stages, stage k on stages[k] = (replicas, tp, shard)."""
    n, devices, built = len(stages), iter(f"c{i}" for i in range(64)), []
    bounds = [len(names) * i // n for i in range(n + 1)]
    for k, (replicas, tp, shard) in enumerate(stages):
        groups = [tuple(next(devices) for _ in range(tp)) for _ in range(replicas)]
        built.append(Stage(tuple(names[bounds[k]:bounds[k + 1]]), tuple(g[0] for g in groups), tp=tp,
                           tp_devices=tuple(groups) if tp > 1 else (), shard=shard))
    return Plan(tuple(built), m, schedule, "test")


def settings(tmp_path, steps, **more):
    return RunSettings(batch_size=BATCH, seq_len=SEQ, granularity="block", steps=steps, warmup=0, optimizer="adam",
                       lr=3e-3, out_dir=tmp_path / "out", no_dropout=True, **more)


# the model built and its step traced once per model for the module's threads runs (each rank
# takes copies: `traces.SharedTraces`); every run of one model here has the same dropout setting
TRACES: dict[tuple, SharedTraces] = {}


def threads(spec):
    return run_threads(spec, shared=TRACES.setdefault((spec.model, spec.settings.no_dropout), SharedTraces()))


def run(plan, s, processes=False):
    """Every rank's results (threads, or worker processes: tensor parallelism needs torch.distributed)."""
    spec = run_spec(plan, cpus(len(plan.devices)), MODEL, s)
    if processes:
        return launch(spec).ranks, spec
    return threads(spec), spec


def losses(results, spec):
    last = len(spec.plan.stages) - 1
    per_rank = [res["losses"] for rank, res in enumerate(results) if spec.ranks[rank].stage == last
                and spec.ranks[rank].tp == 0]
    return [sum(step) for step in zip(*per_rank, strict=True)]


@pytest.fixture(scope="module")
def written(tmp_path_factory, names):
    """The 2-stage run of BACK steps, and its first 2 steps with their checkpoint."""
    tmp = tmp_path_factory.mktemp("written")
    two = plan_of(names, [(1, 1, 0), (1, 1, 0)])
    whole, spec = run(two, settings(tmp, BACK))
    ckpt = tmp / "ckpt"
    run(two, settings(tmp, 2, checkpoint_dir=ckpt))
    return two, losses(whole, spec), whole, ckpt


def copied(ckpt, tmp_path):
    """The checkpoint in a folder of the test's own (a resumed run writes its own there)."""
    shutil.copytree(ckpt, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("stages,processes", [
    ([(1, 1, 0)], False),  # one stage
    ([(2, 1, 0)], False),  # two replicas
    ([(2, 1, 1)], False),  # two replicas sharding Adam's state
    ([(2, 1, 3), (1, 1, 0)], False),  # sharding weights, gradients and state, then a stage
    ([(1, 2, 0)], True),  # a 2-way tensor-parallel stage
], ids=["one-stage", "replicas", "zero-1", "zero-3", "tensor-parallel"])
def test_a_checkpoint_resumes_onto_another_plan_as_the_run_that_never_stopped(tmp_path, names, written, stages,
                                                                              processes):
    two, expected, _, written_to = written
    other = plan_of(names, stages)
    ckpt = copied(written_to, tmp_path)
    s = settings(tmp_path, STEPS, checkpoint_dir=ckpt, resume=True)
    first = _resume_step(other, s, MODEL, BATCH, SEQ)
    assert first == 2
    results, spec = run(other, replace(s, resume_step=first), processes)
    assert losses(results, spec) == pytest.approx(expected[2:STEPS], rel=1e-5)
    assert latest_step(ckpt) == STEPS  # what it wrote, the 2-stage plan takes back
    results, spec = run(two, settings(tmp_path, BACK, checkpoint_dir=ckpt, resume_step=STEPS))
    assert losses(results, spec) == pytest.approx(expected[STEPS:], rel=1e-5)


def test_resumed_onto_the_same_plan_it_is_bit_for_bit_the_run_that_never_stopped(tmp_path, written):
    two, expected, whole, written_to = written
    ckpt = copied(written_to, tmp_path)
    results, spec = run(two, settings(tmp_path, BACK, checkpoint_dir=ckpt, resume_step=2))
    assert losses(results, spec) == expected[2:]
    for a, b in zip(whole, results, strict=True):
        for name, w in a["weights"].items():
            assert torch.equal(w, b["weights"][name]), name
    assert latest_step(ckpt) == BACK and sorted(p.name for p in ckpt.iterdir()) == ["step-00000002",
                                                                                     "step-00000007"]


def test_a_checkpoint_of_another_training_or_format_is_refused_in_one_line(tmp_path, names, written):
    two, _, _, ckpt = written
    s = settings(tmp_path, STEPS, checkpoint_dir=ckpt, resume=True)
    with pytest.raises(HetplanError, match="trained with batch_size 8 and this run has 16"):
        _resume_step(two, s, MODEL, 16, SEQ)
    with pytest.raises(HetplanError, match="trained with optimizer 'adam' and this run has 'sgd'"):
        _resume_step(two, replace(s, optimizer="sgd"), MODEL, BATCH, SEQ)
    old = tmp_path / "old"
    old.mkdir()
    torch.save({"step": 3}, old / "stage0.pt")
    with pytest.raises(HetplanError, match="an earlier hetplan"):
        _resume_step(two, replace(s, checkpoint_dir=old), MODEL, BATCH, SEQ)
    assert (step_dir(ckpt, 2) / "rank1.pt").exists()


def test_batch_norm_statistics_go_with_the_weights_onto_another_plan(tmp_path):
    """Batch norm's running means and variances (inception-tiny's) are buffers the checkpoint
    holds by name too: 2 stages for 2 steps, resumed as 1 stage for a third, end with the losses
    and the statistics of the 2-stage run that never stopped (training's forward reads the batch's
    own statistics, so only the buffers themselves show fresh ones)."""
    from hetplan.runtime.checkpoint import Reader
    from test_executor import chain_plan

    name = "inception-tiny"
    zm = load_model(name, batch_size=BATCH, seed=0)
    nodes = [p.name for p in split_step(zm.step, zm.batch, "layer").pieces]

    def go(plan, steps, **more):
        spec = run_spec(plan, cpus(len(plan.devices)), name, RunSettings(
            batch_size=BATCH, granularity="layer", steps=steps, warmup=0, optimizer="adam", lr=1e-3,
            out_dir=tmp_path / "out", **more))
        return losses(threads(spec), spec)

    two, one = chain_plan(nodes, [1, 1], 2, "1f1b"), chain_plan(nodes, [1], 2, "1f1b")
    whole = go(two, 3, checkpoint_dir=tmp_path / "whole")
    go(two, 2, checkpoint_dir=tmp_path / "ck")
    assert go(one, 3, checkpoint_dir=tmp_path / "ck", resume_step=2) == pytest.approx(whole[2:], rel=1e-5)
    ends = Reader(tmp_path / "whole", 3), Reader(tmp_path / "ck", 3)
    buffers = [n for n, what in ends[0].index if what == "buffer" and "running" in n]
    assert buffers and sorted(buffers) == sorted(n for n, what in ends[1].index if what == "buffer" and "running" in n)
    for n in buffers:
        torch.testing.assert_close(ends[1].whole(n, "buffer"), ends[0].whole(n, "buffer"), rtol=1e-5, atol=1e-6)


def test_fp16s_loss_scale_goes_with_the_checkpoint(tmp_path):
    """Every worker's file holds the run's loss scale and its count of good steps (the same on
    every worker); a resumed fp16 run goes on from them, not from a fresh scale."""
    from hetplan.runtime.checkpoint import Reader, step_dir
    from test_executor import chain_plan

    zm = load_model("mlp", batch_size=BATCH, seed=0)
    nodes = [p.name for p in split_step(zm.step, zm.batch, "layer").pieces]
    plan = replace(chain_plan(nodes, [1, 1], 2, "1f1b"), precision="fp16")

    def go(steps, **more):
        return threads(run_spec(plan, cpus(2), "mlp", RunSettings(
            batch_size=BATCH, granularity="layer", steps=steps, warmup=0, optimizer="sgd", lr=0.1,
            out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ck", **more)))

    go(2)
    assert [Reader(tmp_path / "ck", 2).extra(r)["loss_scale"] for r in range(2)] == [[2.0**16, 2]] * 2
    for r in range(2):  # as if the run had backed off to 2**10 and counted 5 good steps since
        path = step_dir(tmp_path / "ck", 2) / f"rank{r}.pt"
        data = torch.load(path, weights_only=True)
        torch.save({**data, "extra": {"loss_scale": [2.0**10, 5]}}, path)
    resumed = go(3, resume_step=2)
    assert {res["loss_scale"] for res in resumed} == {2.0**10}
    assert Reader(tmp_path / "ck", 3).extra(0)["loss_scale"] == [2.0**10, 6]
