"""How workers talk: point-to-point messages and sums over groups of ranks.

`GlooTransport` is torch.distributed between processes (and machines under torchrun) on the
run's backend (`backend_of`): gloo alone, whose messages and sums are host tensors; or, where
workers sit on GPUs and torch has NCCL, torch's "cpu:gloo,cuda:nccl", which carries a tensor by
the backend of its device: what travels only between GPU workers stays on the GPU and goes by
NCCL, what a CPU worker takes part in goes through the host by gloo (`wire`: where a message or
a sum among given ranks lives, the one place that decides host staging). `LocalHub` runs the
same protocol between threads of one process (always on the host), so that the tests can run a
pipeline of many stages quickly and check it against single-process training; the executor
cannot tell them apart.

Messages between two ranks pair up by their order on one of two channels, activations and
gradients, as the step's lowered lists say (`hetplan.lowering`, whose dry run checks that they
pair). Each channel is its own process group, and every pipeline message has tag 0: NCCL pairs
messages by their order on a communicator alone, and one communicator for both would make a
gradient wait behind an activation sent before it (ZB-V needs it first); gloo takes the same
path, so the CPU tests run what NCCL would. A sharded stage's reduce-scatter and all-gather
(`runtime.sharding`, `runtime.zero`) are the backend's collectives where NCCL carries them
(`collectives`: among GPU workers); where gloo does, rings over point-to-point messages on the
host with tags of their own (gloo's reduce-scatter is an all-reduce of everything: twice the
bytes), which only gloo pairs by tag. The tests run NCCL's path on the CPU: the threads' hub runs
either (`LocalTransport.collectives_on`), and gloo runs the collectives too where
$HETPLAN_GLOO_COLLECTIVES is 1 (worker processes of a CPU run). A rank holding two
neighbouring stages (ZB-V's V: stages n - 1 and n on the last rank) sends to itself: no backend
has a pair from a rank to itself, so both transports keep such a message in the rank's own
mailbox (`_Own`), and the threads' hub refuses a message to oneself as gloo does.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import torch

from hetplan.lowering import ACTIVATIONS, GRADIENTS
from hetplan.runtime.backend import MIXED, init_method

GLOO_COLLECTIVES = "HETPLAN_GLOO_COLLECTIVES"  # "1": gloo runs sharded stages' collectives too (tests)
CHANNELS = (ACTIVATIONS, GRADIENTS)  # a pipeline message's tag names its channel (`lowering.channel`)

# gloo's words when the rank at the other end of a message is gone or silent (it raises a plain
# RuntimeError): a worker failing so is the consequence of another's failure, not its cause
_PEER_LOST = ("closed by peer", "reset by peer", "Timed out waiting", "Broken pipe", "Connection refused")


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` says that a peer of this rank failed or fell silent, not this rank."""
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in _PEER_LOST)


class Sent(Protocol):
    def wait(self) -> object: ...


class Transport(Protocol):
    rank: int

    def wire(self, ranks: tuple[int, ...]) -> torch.device:
        """Where a message or a sum among `ranks` (this one among them) travels."""
        ...

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Sent: ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None: ...

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None: ...

    def collectives(self, ranks: tuple[int, ...]) -> bool:
        """Whether a reduce-scatter and an all-gather among `ranks` run as the backend's own."""
        ...

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        """`output`: this rank's chunk (its place in `ranks`) of `tensor` summed over `ranks`."""
        ...

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        """`output`: every rank's `tensor`, end to end in the order of `ranks`."""
        ...

    def barrier(self) -> None: ...


class _Done:
    def wait(self) -> bool:
        return True


class _Own:
    """Messages a rank sends to itself, first in first out per tag, as between two ranks: its list
    of actions runs the sender before the receiver, so a receive finds its message or the order
    is broken."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._box: dict[int, deque[torch.Tensor]] = {}

    def put(self, tensor: torch.Tensor, tag: int) -> Sent:
        self._box.setdefault(tag, deque()).append(tensor.clone())
        return _Done()

    def take(self, tensor: torch.Tensor, tag: int) -> None:
        if not self._box.get(tag):
            raise RuntimeError(f"rank {self.rank} receives a message on channel {tag} from itself before sending it")
        tensor.copy_(self._box[tag].popleft())


class GlooTransport:
    """torch.distributed on `backend` (`backend_of`: gloo, or `MIXED`), each worker on
    `devices[rank]`. Every rank creates the same groups, in the same order, as torch.distributed
    requires: the channels, then `groups`, all the rank sets that will sum together."""

    def __init__(self, rank: int, world: int, groups: Sequence[tuple[int, ...]], timeout_s: float,
                 devices: Sequence[str] | None = None, backend: str = "gloo") -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = rank
        self.backend = backend
        self._devices = [torch.device(d) for d in devices] if devices else [torch.device("cpu")] * world
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method(), rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        # activations on the default group, gradients on one of their own
        self._channels = [None, dist.new_group(list(range(world)))]
        self._groups = {g: dist.new_group(list(g)) for g in groups}
        self._own = _Own(rank)

    def wire(self, ranks: tuple[int, ...]) -> torch.device:
        if self.backend == MIXED and all(self._devices[r].type == "cuda" for r in ranks):
            return self._devices[self.rank]
        return torch.device("cpu")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Sent:
        if dst == self.rank:
            return self._own.put(tensor, tag)
        if tag in CHANNELS:  # a pipeline message: by its order on its channel's group
            return self._dist.isend(tensor, dst, group=self._channels[tag], tag=0)
        return self._dist.isend(tensor, dst, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        if src == self.rank:
            return self._own.take(tensor, tag)
        if tag in CHANNELS:
            self._dist.recv(tensor, src, group=self._channels[tag], tag=0)
        else:
            self._dist.recv(tensor, src, tag=tag)

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        self._dist.all_reduce(tensor, group=self._groups[ranks])

    def collectives(self, ranks: tuple[int, ...]) -> bool:
        # NCCL's; gloo's reduce-scatter is an all-reduce, so gloo runs them only for the tests
        # (`GLOO_COLLECTIVES`), which run NCCL's path between CPU workers so
        return self.wire(ranks).type == "cuda" or os.environ.get(GLOO_COLLECTIVES) == "1"

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        # torch 2.13 names them reduce_scatter_single and all_gather_single (the older names warn);
        # versions without those have the older ones
        run = getattr(self._dist, "reduce_scatter_single", None) or self._dist.reduce_scatter_tensor
        run(output, tensor, group=self._groups[ranks])

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        run = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        run(output, tensor, group=self._groups[ranks])

    def barrier(self) -> None:
        self._dist.barrier()

    def group(self, ranks: tuple[int, ...]):
        """The process group of `ranks` (one of `groups`)."""
        return self._groups[ranks]

    def gather_objects(self, obj: object, world: int) -> list:
        out: list = [None] * world
        self._dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        self._dist.destroy_process_group()


class LocalHub:
    """The meeting point of `world` ranks running as threads of one process."""

    def __init__(self, world: int, timeout_s: float = 60.0) -> None:
        self.world, self.timeout_s = world, timeout_s
        self._boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self._lock = threading.Lock()
        self._sums: dict[tuple[tuple[int, ...], int], dict] = {}
        self._cond = threading.Condition()
        self._barrier = threading.Barrier(world, timeout=timeout_s)

    def box(self, src: int, dst: int, tag: int) -> queue.Queue:
        if src == dst:  # as gloo: no pair from a rank to itself
            raise RuntimeError(f"rank {src} cannot send to itself through the hub (tag {tag})")
        with self._lock:
            return self._boxes.setdefault((src, dst, tag), queue.Queue())

    def transport(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)

    def abort(self) -> None:
        """Wake the ranks waiting at a barrier (one rank failed)."""
        self._barrier.abort()


class LocalTransport:
    collectives_on = False  # the tests switch it on to run sharded stages' collective path (NCCL's)

    def __init__(self, hub: LocalHub, rank: int) -> None:
        self.hub, self.rank = hub, rank
        self._rounds: dict[tuple[int, ...], int] = {}
        self._own = _Own(rank)

    def wire(self, ranks: tuple[int, ...]) -> torch.device:
        return torch.device("cpu")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Sent:
        if dst == self.rank:
            return self._own.put(tensor, tag)
        self.hub.box(self.rank, dst, tag).put(tensor.clone())
        return _Done()

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        if src == self.rank:
            return self._own.take(tensor, tag)
        got = self.hub.box(src, self.rank, tag).get(timeout=self.hub.timeout_s)
        tensor.copy_(got)

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        n = self._rounds[ranks] = self._rounds.get(ranks, 0) + 1
        key = (ranks, n)
        hub = self.hub
        with hub._cond:
            entry = hub._sums.setdefault(key, {"parts": [], "sum": None, "read": 0})
            entry["parts"].append((self.rank, tensor.clone()))
            if len(entry["parts"]) == len(ranks):  # summed in rank order: the same result every run
                entry["sum"] = torch.stack([t for _, t in sorted(entry["parts"], key=lambda x: x[0])]).sum(0)
                hub._cond.notify_all()
            if not hub._cond.wait_for(lambda: entry["sum"] is not None, timeout=hub.timeout_s):
                raise TimeoutError(f"rank {self.rank}: all-reduce over {ranks} timed out")
            tensor.copy_(entry["sum"])
            entry["read"] += 1
            if entry["read"] == len(ranks):
                del hub._sums[key]

    def collectives(self, ranks: tuple[int, ...]) -> bool:
        return self.collectives_on

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        whole = tensor.clone()
        self.all_reduce(whole, ranks)
        output.copy_(whole.chunk(len(ranks))[ranks.index(self.rank)])

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        whole = torch.zeros_like(output)
        whole.chunk(len(ranks))[ranks.index(self.rank)].copy_(tensor)
        self.all_reduce(whole, ranks)
        output.copy_(whole)

    def barrier(self) -> None:
        self.hub._barrier.wait()
