"""What hetplan's runtime can execute, in one place. Pure Python (no torch): the planners, the
launcher and the CLI read it.

The runtime (`hetplan.runtime.executor`) runs the schedule's own per-device action order over
point-to-point messages, so it runs every plan that `hetplan.plan.validate_plan` accepts: any
chain of stages in pipeline order, each on one device or on replicas of any number and speed
(each micro-batch split by `hetplan.rows`), stages without parameters, every schedule of
`hetplan.schedule` (GPipe, 1F1B, zero bubble, interleaved 1F1B, ZB-V) with any number of
micro-batches up to the batch's rows that the schedule takes, several stages on one device
(`shared_devices`: one worker per stage; an interleaved schedule: one worker holding them
all), stages that recompute their activations. What it needs beyond a valid plan is about the
cluster: every device of the plan must say where it runs (`binding: cpu` with `threads`, or
`binding: cuda:K`), and a tensor-parallel group on GPUs needs a GPU per worker (its collectives
go by NCCL; `hetplan run` also refuses one where the run's backend has no NCCL).

It passes tensors only between neighbouring stages (`ROUTING`): a value that skips stages is
relayed through the ones between, which is how the simulator scores plans by default.
"""

from __future__ import annotations

from collections.abc import Sequence

from hetplan.cluster import Cluster
from hetplan.plan import Plan
from hetplan.schedule import SCHEDULE_NAMES
from hetplan.schedule import SCHEDULES as REGISTRY

ROUTING = "relay"
SCHEDULES = SCHEDULE_NAMES  # every one of them (the registry, `hetplan.schedule.SCHEDULES`, at import)
BINDINGS = ("cpu", "cuda")


def runtime_refusal(plan: Plan, cluster: Cluster) -> str | None:
    """Why the runtime cannot run this (valid) plan on this cluster, in one line; None if it can."""
    if plan.schedule not in REGISTRY:
        return f"the runtime runs the schedules {', '.join(REGISTRY)}, not {plan.schedule!r}"
    for d in plan.devices:
        binding = cluster.device(d).binding
        if binding is None:
            return (f"device {d} of cluster {cluster.name!r} has no binding, so it can only be simulated; run on a "
                    "cluster whose devices say where they run (binding: cpu, with threads, or cuda:K), such as the "
                    "preset local")
        if binding.split(":", 1)[0] not in BINDINGS:
            return f"device {d} is bound to {binding!r}; the runtime runs on {', '.join(BINDINGS)}"
    for group in gpu_tp_groups(plan, cluster):
        bindings = [cluster.device(d).binding or "" for d in group]
        if not all(b.startswith("cuda") for b in bindings):
            return (f"the tensor-parallel group {', '.join(group)} mixes CPU and GPU workers, and its collectives "
                    "run on one backend: give it devices of one kind, or plan with --max-tp 1")
        if shared_gpu(bindings) is not None:
            return (f"the tensor-parallel group {', '.join(group)} shares a GPU, and its collectives need NCCL, which "
                    "runs one worker per GPU: bind its devices to different GPUs, or plan with --max-tp 1")
    return None


def shared_gpu(bindings: Sequence[str]) -> tuple[int, int] | None:
    """The first two workers bound to one GPU (NCCL refuses a communicator with two ranks on one
    device), or None."""
    seen: dict[str, int] = {}
    for i, b in enumerate(bindings):
        if b.startswith("cuda"):
            gpu = b if ":" in b else "cuda:0"
            if gpu in seen:
                return seen[gpu], i
            seen[gpu] = i
    return None


def gpu_tp_groups(plan: Plan, cluster: Cluster) -> list[tuple[str, ...]]:
    """The plan's tensor-parallel groups that a GPU worker is in: their collectives (DTensor's)
    run on their GPUs by NCCL (`runtime.backend`), one worker per GPU."""
    return [tuple(g) for s in plan.stages for g in s.tp_devices
            if any(cluster.device(d).binding != "cpu" for d in g)]
