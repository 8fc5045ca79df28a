"""Replicas of ctr-dnn's embedding tables: their gradients summed as the looked-up rows against
as whole tables, measured and predicted, side by side in one run.

    .venv/bin/python bench/sparse_sync.py [--batch 512] [--repeats 10] [-o bench/results/sparse_sync.json]

Two local processes joined by gloo (one thread each), each with ctr-dnn (26 tables, the Kaggle
sizes capped at 1M rows: 5.57M rows of 16 floats, 356 MB) and its half of one batch, make their
gradients with one backward pass and then sum them, `--repeats` times each way (the median):

- tables: every gradient made dense and one all-reduce of them all, the tables whole (what
  hetplan's runtime did before the rows exchange; the timing includes making them dense, as it
  did);
- rows: `hetplan.runtime.gradients.reduce_gradients`: the row counts, the indices, then the dense
  gradients and the union's rows in one buffer.

Both sums are checked equal. Each is set beside the cost model's prediction on `local` (two
single-threaded workers of this machine) calibrated first in the same run (`hetplan calibrate`;
written beside the output as `sparse_sync-cluster.json`), from a profile of the same step
(`Node.updated_bytes`, `Node.sparse_rows`): `allreduce_s` of the tables' bytes, and
`stage_sync_s`, the exchange of the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORLD = 2


def _half(batch: dict, rank: int) -> dict:
    return {k: v[rank::WORLD] for k, v in batch.items()}


def _rank(rank: int, meet: str, batch_size: int, repeats: int, out: str) -> None:
    import torch.distributed as dist

    from hetplan.pieces.hostmem import keep_freed_memory
    from hetplan.runtime.backend import RENDEZVOUS_ENV
    from hetplan.runtime.gradients import reduce_gradients, sparse_parameter_ids
    from hetplan.runtime.transport import GlooTransport
    from hetplan.zoo import load_model

    torch.set_num_threads(1)
    keep_freed_memory()  # as the runtime's workers
    os.environ[RENDEZVOUS_ENV] = meet  # the file the two ranks meet at (`backend.init_method`)
    transport = GlooTransport(rank, WORLD, [(0, 1)], timeout_s=600.0)
    zm = load_model("ctr-dnn", batch_size=batch_size)
    zm.step(**_half(zm.batch, rank)).backward()
    named = sorted((n, p) for n, p in zm.step.named_parameters() if p.requires_grad)
    params = [p for _, p in named]
    made = [p.grad.clone() for p in params]

    def tables() -> torch.Tensor:
        flat = torch.cat([g.to_dense().reshape(-1) for g in made])
        dist.all_reduce(flat)
        return flat

    sparse = sparse_parameter_ids(zm.step)

    def rows() -> None:
        reduce_gradients([((0, 1), params)], transport, sparse)

    times = {"tables": [], "rows": []}
    for _ in range(repeats):
        for way, run in (("tables", tables), ("rows", rows)):
            for p, g in zip(params, made, strict=True):
                p.grad = g.clone()
            dist.barrier()
            began = time.perf_counter()
            summed = run()
            times[way].append(time.perf_counter() - began)
            if way == "tables":
                reference = summed
            else:  # checked outside the timing: densifying 356 MB is not part of the exchange
                summed = torch.cat([p.grad.to_dense().reshape(-1) for p in params])
                assert torch.allclose(summed, reference, atol=1e-6), "the two sums differ"
    if rank == 0:
        Path(out).write_text(json.dumps({w: statistics.median(t) for w, t in times.items()}))
    transport.close()


def _predicted(batch_size: int, cluster_file: Path) -> dict:
    from hetplan.cost import CostModel
    from hetplan.io.clusters import load_cluster
    from hetplan.profile import profile_step
    from hetplan.zoo import load_model

    zm = load_model("ctr-dnn", batch_size=batch_size)
    graph = profile_step(zm.step, zm.batch, name="ctr-dnn", devices=["cpu:1"], repeats=1, fixed=False).graph
    cluster = load_cluster(str(cluster_file))
    cm, pair, nodes = CostModel(graph, cluster), tuple(cluster.ids[:2]), graph.topo_order
    params = graph.param_bytes_total
    return {"param_bytes": params, "updated_bytes": cm._optimizer_bytes(nodes), "index_bytes": cm._index_bytes(nodes),
            "sparse_rows": sum(n.sparse_rows for n in graph.nodes),
            "predicted_tables_s": cm._allreduce_s(params, pair), "predicted_rows_s": cm._stage_sync_s(nodes, pair)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "sparse_sync.json")
    args = parser.parse_args()
    from hetplan.io import serde
    from hetplan.io.clusters import load_cluster
    from hetplan.runtime.calibrate import calibrate_cluster

    cluster_file = args.output.with_name(args.output.stem + "-cluster.json")
    serde.dump(calibrate_cluster(load_cluster("local"), say=print)[0], cluster_file)
    out = args.output.with_suffix(".rank0.json")
    with tempfile.TemporaryDirectory() as meet:
        rendezvous = str(Path(meet) / "rendezvous")
        torch.multiprocessing.start_processes(_rank, (rendezvous, args.batch, args.repeats, str(out)), nprocs=WORLD,
                                              start_method="spawn")
    measured = json.loads(out.read_text())
    out.unlink()
    result = {"batch": args.batch, "repeats": args.repeats, "cpus": os.cpu_count(),
              **_predicted(args.batch, cluster_file), **{f"measured_{w}_s": t for w, t in measured.items()}}
    for way in ("tables", "rows"):
        print(f"{way:>6}: measured {result[f'measured_{way}_s'] * 1e3:8.1f} ms, "
              f"predicted {result[f'predicted_{way}_s'] * 1e3:8.1f} ms")
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
