"""A worker: one process per device of the plan, one pipeline stage each.

Run by the local launcher (`hetplan run`) or by `torchrun`, which set RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT:

    python -m hetplan.runtime.worker RUN.json

RUN.json (`hetplan.runtime.launch.RunSpec`) names the plan, the model and the run's settings, and
for each rank its stage and device binding. Every rank builds the same model from the same seed
(so the weights agree without sending them), cuts the training step into the same pieces as the
profiler, keeps the module of its own stage, and runs it with `torch.distributed.pipelining`'s
ScheduleGPipe or Schedule1F1B over gloo; torch scales the gradients by 1 / micro-batches, so a
step's gradients equal those of the whole batch at once, and the gradients of parameters that
several stages use (tied embeddings) are summed over those stages. After every pipeline step each stage
takes an optimizer step. Workers write a heartbeat file per step (the launcher's watchdog reads
it) and rank 0 writes the result: per-step wall times (between two barriers), the last stage's
losses, and each worker's peak memory. HETPLAN_FAULT=hang:RANK:STEP or die:RANK:STEP makes a
worker hang or exit at a step, to test the launcher's handling of faults.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _batches(spec: dict, zoo_model, step: int):
    """The batch of a step: the profiled batch's shapes, fresh random values (synthetic), or a
    window of the text corpus (language models)."""
    import torch

    from hetplan.runtime.data import text_batch

    if spec.get("data") == "text":
        return text_batch(zoo_model.batch, step, seed=spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"] * 100_003 + step)
    out = {}
    for key, value in zoo_model.batch.items():
        if value.is_floating_point():
            out[key] = torch.randn(value.shape, generator=gen, dtype=value.dtype)
        else:
            high = int(value.max().item()) + 1
            out[key] = torch.randint(0, max(high, 2), value.shape, generator=gen, dtype=value.dtype)
    return out


def _all_reduce(tensor, group) -> None:
    """Sum a tensor over a process group in place; a GPU tensor goes through the CPU, because
    gloo's collectives are for CPU tensors."""
    import torch.distributed as dist

    if tensor.device.type == "cpu":
        dist.all_reduce(tensor, group=group)
        return
    host = tensor.cpu()
    dist.all_reduce(host, group=group)
    tensor.copy_(host)


def run_worker(spec: dict, rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from hetplan.io.serde import from_dict
    from hetplan.profile.split import split_step
    from hetplan.runtime.stages import HostBoundary, stage_modules
    from hetplan.zoo import load_model

    out_dir = Path(spec["out_dir"])
    me = spec["ranks"][rank]
    heartbeat = out_dir / f"heartbeat.{rank}"
    _write(heartbeat, {"rank": rank, "stage": me["stage"], "phase": "starting", "step": -1, "t": time.time()})
    if os.environ.get("HETPLAN_CPUS"):  # the launcher's cores for this worker (see launch.pin_cores)
        os.sched_setaffinity(0, [int(c) for c in os.environ["HETPLAN_CPUS"].split(",")])
    torch.set_num_threads(me["threads"])
    device = torch.device(me["binding"] if me["binding"].startswith("cuda") else "cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=spec["timeout_s"]))
    plan = from_dict(spec["plan"])
    zoo_model = load_model(spec["model"], batch_size=spec["batch_size"], seq_len=spec["seq_len"], seed=spec["seed"])
    if spec.get("no_dropout"):
        for mod in zoo_model.step.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0
    m = plan.microbatches
    n = len(plan.stages)
    r = len(plan.stages[0].devices)  # pipelines side by side, one per replica
    pipe, share = me.get("pipeline", 0), spec["batch_size"] // r  # this pipeline's slice of the batch
    micro = {k: v[: share // m] for k, v in zoo_model.batch.items()}
    split = split_step(zoo_model.step, micro, granularity=spec["granularity"],
                       block_classes=spec.get("block_classes") or zoo_model.block_classes or None)
    modules = stage_modules(split, plan)
    module = own = modules[me["stage"]].to(device)  # `own`: the stage itself, for weights and checkpoints
    if device.type == "cuda":
        # gloo sends CPU tensors only: the stage takes and gives CPU tensors, and moves them to
        # and from its GPU itself (autograd carries the gradients across the moves)
        module = HostBoundary(module, device)
    # Process groups, created by every rank in the same order: one per pipeline (its stages talk
    # to each other), one per stage over its replicas (gradients are averaged), and one per set of
    # stages that share a parameter within a pipeline (see below).
    pipe_groups = [dist.new_group([p * n + k for k in range(n)]) for p in range(r)]
    replica_groups = [dist.new_group([p * n + k for p in range(r)]) for k in range(n)] if r > 1 else []
    # Give the stage its example inputs and outputs: torch would otherwise infer them by running
    # the stage on uninitialised tensors, which breaks on integer inputs such as labels (a loss
    # reading garbage class ids). Every rank holds the whole model, so it runs the stages before
    # its own on an example micro-batch, without gradients, to get them.
    with torch.no_grad():
        values = tuple(micro[k] for k in split.input_keys)
        for k in range(me["stage"]):
            out = modules[k](*values)
            values = out if isinstance(out, tuple) else (out,)
    # inputs from an earlier stage carry gradients back, and outputs that depend on weights or on
    # such inputs want gradients: the examples must say so, or torch sends no gradients
    example_in = tuple(v.requires_grad_(me["stage"] > 0 and v.is_floating_point()) for v in values)
    out = module(*example_in)
    example_out = tuple(o.detach().requires_grad_(o.requires_grad) for o in (out if isinstance(out, tuple) else (out,)))
    module.zero_grad(set_to_none=True)
    stage = PipelineStage(module, me["stage"], n, torch.device("cpu"), input_args=example_in, output_args=example_out,
                          group=pipe_groups[pipe])
    schedule_cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_cls(stage, n_microbatches=m, loss_fn=lambda out, target: out)
    # Parameters used by several stages (GPT-2 ties its embedding to its output layer) live on each
    # of them; their gradients are summed over those stages after every backward pass, so that the
    # copies get the same update, as the one tensor does in single-process training. Every rank
    # creates every group, in the same order, as torch.distributed requires.
    holders: dict[int, set[int]] = {}
    for k, mod in enumerate(modules):
        for p in mod.parameters():
            holders.setdefault(id(p), set()).add(k)
    sharing = sorted({tuple(sorted(h)) for h in holders.values() if len(h) > 1})
    groups = {(q, stages): dist.new_group([q * n + k for k in stages]) for q in range(r) for stages in sharing}
    tied = [(p, groups[(pipe, tuple(sorted(holders[id(p)])))]) for p in module.parameters()
            if len(holders[id(p)]) > 1]
    params = [p for p in module.parameters() if p.requires_grad]
    if spec["optimizer"] == "sgd":
        opt = torch.optim.SGD(params, lr=spec["lr"])
    else:
        opt = torch.optim.Adam(params, lr=spec["lr"])
    first, last = me["stage"] == 0, me["stage"] == n - 1
    times, losses = [], []
    if spec.get("resume_step"):
        from hetplan.runtime.checkpoint import load_stage

        load_stage(Path(spec["checkpoint_dir"]), me["stage"], own, opt)
    start_step = spec.get("resume_step") or 0
    fault = os.environ.get("HETPLAN_FAULT", "").split(":")  # fault injection, to test the watchdog
    for step in range(start_step, spec["steps"]):
        _write(heartbeat, {"rank": rank, "stage": me["stage"], "phase": "step", "step": step, "t": time.time()})
        if len(fault) == 3 and int(fault[1]) == rank and int(fault[2]) == step:
            if fault[0] == "hang":
                time.sleep(10**6)
            os._exit(3)
        batch = _batches(spec, zoo_model, step)
        args = tuple(batch[k][pipe * share:(pipe + 1) * share] for k in split.input_keys) if first else ()
        target = torch.zeros(share) if last else None
        step_losses: list = [] if last else None
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if last:
            schedule.step(*args, target=target, losses=step_losses, return_outputs=False)
        else:
            schedule.step(*args)
        for p, group in tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            _all_reduce(p.grad, group)
        if r > 1:  # equal slices: the batch's gradient is the mean of the replicas'
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # one all-reduce of all gradients in one flat buffer: gloo pays its latency once, not
            # once per tensor
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            _all_reduce(flat, replica_groups[me["stage"]])
            flat /= r
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if last:
            losses.append(float(sum(x.detach().float().item() for x in step_losses) / m))
        every = spec.get("checkpoint_every") or 0
        if every and (step + 1) % every == 0 and pipe == 0:  # replicas hold the same weights
            from hetplan.runtime.checkpoint import save_stage

            save_stage(Path(spec["checkpoint_dir"]), me["stage"], own, opt, step + 1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    weights = None
    if spec.get("return_weights"):
        weights = {name: p.detach().cpu() for name, p in own.named_parameters()}
    mine = {"rank": rank, "stage": me["stage"], "device": me["device"], "times_s": times, "losses": losses,
            "peak_mem_bytes": peak}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if spec.get("return_weights"):
        torch.save(weights, out_dir / f"weights.{rank}.pt")
    if rank == 0:
        _write(out_dir / "result.json", {"ranks": gathered})
    _write(heartbeat, {"rank": rank, "stage": me["stage"], "phase": "done", "step": spec["steps"], "t": time.time()})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hetplan.runtime.worker RUN.json (under hetplan run or torchrun)", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        print("hetplan worker: RANK and WORLD_SIZE are not set; start workers with hetplan run or torchrun",
              file=sys.stderr)
        return 2
    try:
        run_worker(spec, rank, world)
    except Exception as exc:  # noqa: BLE001 - the launcher reports it, naming the worker
        me = spec["ranks"][rank] if rank < len(spec["ranks"]) else {}
        (Path(spec["out_dir"]) / f"error.{rank}").write_text(
            f"worker {rank} (stage {me.get('stage')}, device {me.get('device')}): {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n{traceback.format_exc()}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
