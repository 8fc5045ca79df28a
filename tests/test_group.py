"""A launch's workers start from one trace (`runtime.group`): the process that forks them builds
the model and traces the step at every number of rows any of them runs, and each worker takes its
stage from those traces without tracing, holding that model's own parameters (its copy by the fork)."""

import copy
import json
import os
from dataclasses import replace

import pytest
import torch

from hetplan.pieces.split import split_step
from hetplan.plan import Plan, Stage
from hetplan.runtime.group import traced_once
from hetplan.runtime.launch import TRACING_LOG, WorkerFailure, group_make, launch, run_spec, write_spec
from hetplan.runtime.rank import traced_rows, traces_of
from hetplan.runtime.settings import RunSettings
from hetplan.runtime.worker import build_rank
from test_runtime import THREE_CPUS, model


def _never(*args, **kwargs):
    raise AssertionError("a worker traced the step again")


def test_the_workers_take_their_stages_from_one_trace(tmp_path, monkeypatch):
    zm = model("mlp")
    names = [p.name for p in split_step(zm.step, zm.batch).pieces]
    half = len(names) // 2
    # the second stage's replicas at speeds 1 and 2: slices of several sizes, each traced once
    plan = Plan((Stage(tuple(names[:half]), ("c0",)), Stage(tuple(names[half:]), ("c1", "c2"))), 2, "gpipe", "test")
    spec = run_spec(plan, THREE_CPUS, "mlp", RunSettings(batch_size=8, granularity="layer", steps=1,
                                                         out_dir=tmp_path), weights=((1.0,), (1.0, 2.0)))
    threads = torch.get_num_threads()
    try:
        shared = traced_once(str(write_spec(spec)))
        assert torch.get_num_threads() == 1  # no OpenMP team to fork after
    finally:
        torch.set_num_threads(threads)
    wanted = {n for r in range(spec.world) for n in traced_rows(spec, r, traces_of(spec, zm, plan))}
    assert sorted(key[2][0][1][0] for key in shared.made) == sorted(wanted) and len(wanted) >= 3
    beats = [json.loads((tmp_path / f"heartbeat.{r}").read_text()) for r in range(spec.world)]
    assert all(b["phase"] == f"tracing {max(wanted)} rows" for b in beats)
    monkeypatch.setattr("hetplan.runtime.traces.split_step", _never)
    for rank in range(spec.world):
        # what the fork gives each worker: its own copy of it all, less the exports the cuts were
        # made from (torch's pytree specs in them warn when deep-copied; a fork copies nothing)
        mine = copy.deepcopy(replace(shared, exports={}))
        zoo_model, prepared, _ = build_rank(spec, rank, shared=mine)
        built = next(iter(mine.built.values()))
        assert zoo_model is built
        held = {id(p) for p in built.step.parameters()}
        assert prepared.parameters() and all(id(p) in held for p in prepared.parameters())


def test_a_model_that_cannot_be_built_fails_in_each_worker_as_alone(tmp_path):
    """Where the tracing process fails, the group forks the workers without its traces
    (`forked.start_group`): each builds its own and says what fails, as it would have alone; the
    tracing process's own account stays in the run folder."""
    zm = model("mlp")
    names = [p.name for p in split_step(zm.step, zm.batch).pieces]
    plan = Plan((Stage(tuple(names), ("c0",)),), 1, "gpipe", "test")
    spec = run_spec(plan, THREE_CPUS, "mlp", RunSettings(batch_size=8, granularity="layer", steps=1,
                                                         out_dir=tmp_path / "run"))
    with pytest.raises(WorkerFailure, match=r"worker 0 \(stage 0, device c0\): HetplanError: .*no-such-model"):
        launch(replace(spec, model="no-such-model"))
    said = (tmp_path / "run" / TRACING_LOG).read_text()
    assert "no-such-model" in said and "each member makes what it needs itself" in said


def test_the_launcher_is_watched_while_tracing_and_no_thread_is_left_to_fork_with(monkeypatch):
    import threading

    from hetplan.runtime.supervise import LAUNCHER_PID, launcher_watched

    monkeypatch.setenv(LAUNCHER_PID, str(os.getpid()))
    monkeypatch.setattr("hetplan.forked.die_with_parent", lambda: True)  # not this test process
    watching = lambda: [t for t in threading.enumerate() if t.name == "launcher-watch"]  # noqa: E731
    before = len(watching())
    with launcher_watched():
        assert len(watching()) == before + 1
    assert len(watching()) == before


def test_workers_on_a_gpu_build_and_trace_their_own():
    """A process that has initialised CUDA cannot pass it to a child it forks; until a GPU run
    checks the tracing process, a plan with a GPU worker forks its workers without traces."""
    from hetplan.io.clusters import cluster_from_spec

    mixed = cluster_from_spec({"name": "mixed", "devices": [
        {"id": "c0", "type": "cpu", "threads": 1, "binding": "cpu", "host": "here"},
        {"id": "g0", "type": "a100-40gb", "binding": "cuda:0", "host": "here"}]}, "mixed")
    zm = model("mlp")
    names = [p.name for p in split_step(zm.step, zm.batch).pieces]
    settings = RunSettings(batch_size=8, granularity="layer", steps=1)
    on = {d: run_spec(Plan((Stage(tuple(names), (d,)),), 1, "gpipe", "test"), mixed, "mlp", settings)
          for d in ("c0", "g0")}
    assert group_make(on["c0"]) == "hetplan.runtime.group:traced_once"
    assert group_make(on["g0"]) is None


def _dies(spec_path: str) -> None:
    print("the tracing process is going")
    os._exit(7)


def test_a_tracing_process_that_dies_before_the_workers_start_is_named_not_a_worker(tmp_path, monkeypatch):
    """Killed while tracing (memory) or dying of a crash, the process that forks the workers is
    what the launcher names, with what it said last; no worker's log, this run's or an earlier
    one's, is read as the cause."""
    zm = model("mlp")
    names = [p.name for p in split_step(zm.step, zm.batch).pieces]
    plan = Plan((Stage(tuple(names), ("c0",)),), 1, "gpipe", "test")
    out = tmp_path / "run"
    spec = run_spec(plan, THREE_CPUS, "mlp", RunSettings(batch_size=8, granularity="layer", steps=1, out_dir=out))
    out.mkdir()
    (out / "worker.0.log").write_text("an earlier run's failure\n")
    monkeypatch.setattr("hetplan.runtime.launch.group_make", lambda spec: "test_group:_dies")
    with pytest.raises(WorkerFailure, match=r"^the process that builds the model and traces it for the workers ended "
                                            r"with status 7 before it started them: the tracing process is going; "
                                            r"no worker ran$"):
        launch(spec)
    assert not (out / "worker.0.log").exists()
