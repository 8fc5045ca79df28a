"""A plan's ranks as threads of this process, over `LocalHub` instead of gloo: the same set-up
(`worker.build_rank`) and the same steps (`worker.train`) as worker processes, in seconds rather
than the tens of seconds that starting processes takes. The ranks trace the step once between
them and each takes a copy bound to its own model (`traces.SharedTraces`), where worker processes
take the traces made before they were forked (`runtime.group`). For tests and quick checks;
measured runs use processes (`launch`).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from hetplan.runtime.spec import RunSpec

if TYPE_CHECKING:
    from hetplan.runtime.traces import SharedTraces


def run_threads(spec: RunSpec, timeout_s: float = 120.0, shared: SharedTraces | None = None) -> list[dict[str, Any]]:
    """Run every rank of a RUN.json spec; returns per rank its result and its stage's trained
    parameters (`weights`, by name in its stage module). The ranks trace the step once between
    them, into `shared` if given (a caller that traced the same model there too)."""
    from hetplan.runtime.traces import SharedTraces
    from hetplan.runtime.transport import LocalHub
    from hetplan.runtime.worker import build_rank, train

    world = spec.world
    shared = SharedTraces() if shared is None else shared
    # one after another: tracing is not thread-safe
    built = [build_rank(spec, rank, shared=shared) for rank in range(world)]
    hub = LocalHub(world, timeout_s)
    results: list[Any] = [None] * world

    def work(rank: int) -> None:
        zoo_model, prepared, opt = built[rank]
        try:
            out = train(spec, rank, zoo_model, prepared, opt, hub.transport(rank))
            out["weights"] = {n: p.detach().cpu().clone() for n, p in prepared.named_parameters().items()}
            out["buffers"] = {n: b.detach().cpu().clone() for mod in prepared.modules for n, b in mod.named_buffers()}
            results[rank] = out
        except BaseException as exc:  # noqa: BLE001 - re-raised below, with the rank
            results[rank] = exc
            hub.abort()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        if any(isinstance(res, BaseException) for res in results):
            break  # the others wait for the failed rank: report it now
        time.sleep(0.01)
    for rank, res in enumerate(results):
        if isinstance(res, BaseException):
            raise RuntimeError(f"rank {rank} failed: {type(res).__name__}: {res}") from res
    for rank, res in enumerate(results):
        if res is None:
            raise TimeoutError(f"rank {rank} did not finish in {timeout_s:.0f} s")
    return results
