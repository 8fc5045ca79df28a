"""A worker's part of the run's checkpoints (`runtime.checkpoint`): reading one where the run
resumes, writing its part when one is due, and an elastic run's stop, which every worker agrees on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from hetplan.runtime.supervise import stop_step

if TYPE_CHECKING:
    from hetplan.runtime.spec import RunSpec


def resume(spec: RunSpec, runner, prepared, opt, transport, zoo_model, scaler=None) -> None:
    """The stages' sharded units on the transport, and the checkpoint read where the run resumes
    (written by any plan of the model: `runtime.held`), fp16's loss scale with it; each worker's
    random state too where the plan that wrote it is this one."""
    for units in prepared.units:
        units.transport = transport
        units.reduced = runner.read_memory
        runner.runners[units.stage].backward_done = units.finish
    if spec.settings.resume_step:
        import torch

        from hetplan.io.serde import to_dict
        from hetplan.runtime import held
        from hetplan.runtime.checkpoint import Reader

        reader = Reader(Path(spec.settings.checkpoint_dir), spec.settings.resume_step)
        with whole_params(prepared, loaded=True):
            held.load(reader, prepared, opt, held.names_of(zoo_model.step))
        same = json.loads(json.dumps(to_dict(spec.plan)))
        if reader.meta.get("plan") == same and reader.meta.get("world") == spec.world:
            torch.set_rng_state(reader.rng(prepared.role.rank))
        said = reader.extra(0).get("loss_scale")
        if scaler is not None and said is not None:  # the same on every worker (`precision.agreed_step`)
            scaler.scale, scaler.good_steps = float(said[0]), int(said[1])


def save_when_due(spec: RunSpec, prepared, opt, step: int, zoo_model, transport, scaler=None) -> bool:
    """The worker's part of the checkpoint after `step` where one is due (with a checkpoint
    folder, the last step is always saved, a resumed run's too, and the one the launcher asked the
    run to stop at: `supervise.stop_step`): what it holds, by the model's names (`runtime.held`),
    rank 0 with what the run trains (`checkpoint`), fp16's loss scale. Returns whether the run stops here."""
    every = spec.settings.checkpoint_every
    stopping = agreed_stop(spec, step, transport)
    due = (every and (step + 1) % every == 0) or step + 1 == spec.settings.steps or stopping
    if spec.settings.checkpoint_dir is None or not due:
        return False
    from hetplan.runtime import held
    from hetplan.runtime.checkpoint import save

    rank = prepared.role.rank
    save(spec.settings.checkpoint_dir, step + 1, rank, held.entries(prepared, opt, held.names_of(zoo_model.step)),
         checkpoint_meta(spec) if rank == 0 else None,
         {"loss_scale": [scaler.scale, scaler.good_steps]} if scaler is not None else {})
    return stopping


def agreed_stop(spec: RunSpec, step: int, transport) -> bool:
    """Whether the launcher asked an elastic run to stop after `step` (or an earlier step: a
    request that landed after every worker had read at that step's end): every worker says
    whether it read so, and all stop if one did (it may land while some have read and some not)."""
    if not spec.settings.elastic or spec.settings.checkpoint_dir is None:
        return False
    import torch

    asked = stop_step(spec.settings.out_dir)
    said = torch.tensor([1.0 if asked is not None and asked <= step + 1 else 0.0])
    if spec.world > 1:
        transport.all_reduce(said, tuple(range(spec.world)))
    return bool(said.item() > 0)


def checkpoint_meta(spec: RunSpec) -> dict:
    """What a checkpoint says of its run: the training a resumed run must share
    (`checkpoint.SAME_TRAINING`), the plan that wrote it and its number of workers."""
    from hetplan.io.serde import to_dict

    s = spec.settings
    return {"model": spec.model, "optimizer": s.optimizer, "batch_size": s.batch_size, "seq_len": s.seq_len,
            "seed": s.seed, "data": s.data, "world": spec.world, "plan": to_dict(spec.plan)}


def whole_params(prepared, loaded: bool = False):
    """Its stages' parameters whole while a checkpoint is saved or loaded (`zero.ShardedUnits.whole`)."""
    import contextlib

    stack = contextlib.ExitStack()
    for units in prepared.units:
        stack.enter_context(units.whole(loaded))
    return stack
