"""The workers of one `hetplan run` on this machine, started as a group (`hetplan.forked.start_group`):
one process builds the model and traces the step once, at every number of rows any worker runs,
then forks the workers, and each starts with its model and traces made (`traces.SharedTraces`, taken
as they are: a forked worker's copy is its own).

Why: `torch.export` of a model costs seconds of one core per trace, and every worker traced the
same step at the same sizes; on one machine they did it side by side on the same cores. Traced
once, a launch of n workers spends one worker's tracing instead of n.

The process that traces runs torch on one thread (no OpenMP team: a child forked after one hangs
in its first parallel region) and without a launcher-watching thread at the fork. Where building or
tracing fails there, each worker is forked without them and builds and traces its own, so that it
says what failed as it always has.
"""

from __future__ import annotations

from pathlib import Path

from hetplan.runtime.heartbeat import write_heartbeat
from hetplan.runtime.rank import traced_rows, traces_of
from hetplan.runtime.spec import RunSpec
from hetplan.runtime.supervise import launcher_watched
from hetplan.runtime.traces import SharedTraces
from hetplan.runtime.worker import rank_model


def traced_once(spec_path: str) -> SharedTraces:
    """The model and its traces for every local worker of RUN.json at `spec_path`."""
    import torch

    torch.set_num_threads(1)
    spec = RunSpec.from_json(Path(spec_path).read_text())
    shared = SharedTraces(sole=True)
    with launcher_watched():
        traces = traces_of(spec, rank_model(spec, shared), spec.plan, shared=shared)
        for rows in sorted({n for rank in range(spec.world) for n in traced_rows(spec, rank, traces)}):
            for rank in range(spec.world):
                write_heartbeat(spec, rank, f"tracing {rows} rows", -1)
            traces.stages(rows)
    return shared
