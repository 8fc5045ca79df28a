"""Price per 1,000 samples of HeterPS's workload (`ctr-dnn`) at a throughput floor: heterps, dp
(objective cost), the cheapest all-one-type configuration and data parallelism, side by side.

    .venv/bin/python bench/ctr_price.py [--floors 50000,150000,200000]
        [--local-floors 5000,13000,13500] [--steps 20] [--no-runs] [--graph G]
        [-o bench/results/ctr_price.json]

`ctr-dnn` (batch 256, the default 356 MB of tables) is profiled here on one thread (`cpu:1`,
block granularity: input, parser, six embedding shards, MLP; saved beside the output as
`ctr_price_graph.json`, and `--graph` takes it back). Every other device type is
projected: the parser at its measured time (it runs on the host, `Node.runs_on_host`), the
rest by the roofline model.

Part 1, predicted, on the `cloud-ctr` preset (eight 4-thread CPU workers on two servers at
$0.16/h, two T4s at $0.35/h, an A100 at $1.50/h), at each of `--floors`: the plan of each
method, its predicted throughput and price per 1,000 samples. "cheapest all-one-type" is every
device type provisioned as heterps does (`all_one_type`: the whole model one stage, replicated
until it reaches the floor), the cheapest that reaches the floor (else the fastest). "cheapest
one-type dp" is a stronger one-type baseline: dp (objective cost) on the devices of one type
alone, pipelines allowed, the cheapest over the types. "data parallelism" is the
`data-parallel` baseline (every device a replica).

Part 2, measured, on `local` (this machine's two single-thread CPU workers, $0.04/h each): the
same methods at `--local-floors` (below and above what one worker does), and each distinct plan
run twice with `hetplan.runtime` (median step after 3 warm-up steps; the faster run counts, both
are in the rows): measured price per 1,000 samples beside the predicted one. With one
device type here, heterps and dp can only pipeline or replicate; the GPU plans of part 1 need a
GPU machine.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from results_file import write_results

from hetplan.cost import usd_per_step
from hetplan.errors import HetplanError
from hetplan.io import serde
from hetplan.io.clusters import load_cluster
from hetplan.planners import PlanOptions, make_plan
from hetplan.planners.rl.heterps import all_one_type
from hetplan.profile import profile_step
from hetplan.runtime.launch import launch, run_spec
from hetplan.runtime.settings import RunSettings
from hetplan.sim import simulate
from hetplan.zoo import load_model

HERE = Path(__file__).resolve().parent
BATCH = 256
METHODS = ("heterps", "dp", "cheapest all-one-type", "cheapest one-type dp", "data parallelism")


def measured_per_1k(est, cluster, plan, step_s: float) -> float:
    """The predicted estimate with the measured step: its price per 1,000 samples."""
    return replace(est, step_s=step_s, samples_per_s=BATCH / step_s,
                   usd_per_step=usd_per_step(cluster, plan.devices, step_s)).usd_per_1k_samples


def cheapest_one_type(graph, cluster, options):
    """The cheapest all-one-type plan that reaches the floor (else the fastest), and its type."""
    best = None
    for dtype in sorted({d.type for d in cluster.devices}):
        plan = all_one_type(graph, cluster, options, dtype)
        if plan is None:
            continue
        est = simulate(graph, cluster, plan, timeline=False).estimate
        ok = est.feasible and est.samples_per_s >= options.min_samples_per_s * (1 - 1e-9)
        key = (not ok, est.usd_per_step if ok else -est.samples_per_s)
        if best is None or key < best[0]:
            best = (key, plan, dtype)
    return best[1], best[2]


def cheapest_one_type_dp(graph, cluster, options):
    """dp (objective cost) on the devices of one type, the cheapest over the types."""
    best = None
    for dtype in sorted({d.type for d in cluster.devices}):
        sub = cluster.subset([d.id for d in cluster.devices if d.type == dtype])
        try:
            plan = make_plan(graph, sub, "dp", options)
        except HetplanError:
            continue
        if best is None or plan.predicted.usd_per_step < best[0].predicted.usd_per_step:
            best = (plan, dtype)
    if best is None:
        raise HetplanError(f"no one-type plan reaches {options.min_samples_per_s:.0f} samples/s")
    return best


def method_plan(method: str, graph, cluster, floor: float, seed: int):
    options = PlanOptions(objective="cost", min_samples_per_s=floor, seed=seed)
    if method in ("heterps", "dp"):
        return make_plan(graph, cluster, method, options), method
    if method == "data parallelism":
        return make_plan(graph, cluster, "data-parallel"), "all devices replicas"
    if method == "cheapest one-type dp":
        plan, dtype = cheapest_one_type_dp(graph, cluster, options)
        return plan, f"dp on the {dtype} devices"
    plan, dtype = cheapest_one_type(graph, cluster, options)
    return plan, f"all {dtype}"


def describe(plan) -> str:
    return " | ".join(f"{st.nodes[0]}..{st.nodes[-1]} on {','.join(st.devices)}" for st in plan.stages)


def row_for(method, graph, cluster, floor, seed, cluster_name):
    try:
        plan, how = method_plan(method, graph, cluster, floor, seed)
    except HetplanError as exc:
        return {"cluster": cluster_name, "floor": floor, "method": method, "error": str(exc)}, None
    est = simulate(graph, cluster, plan, timeline=False).estimate
    row = {"cluster": cluster_name, "floor": floor, "method": method, "how": how, "plan": describe(plan),
           "devices": len(plan.devices), "usd_per_hour": sum(cluster.device(d).usd_per_hour for d in plan.devices),
           "predicted_samples_per_s": est.samples_per_s, "meets_floor": bool(est.samples_per_s >= floor * (1 - 1e-9)),
           "feasible": est.feasible, "predicted_usd_per_1k": est.usd_per_1k_samples}
    return row, plan


def measure(plan, cluster, steps: int, tmp: Path, k: int) -> list[float]:
    """The median step of two runs of the plan (this machine's speed drifts between runs)."""
    out = []
    for run in range(2):
        spec = run_spec(plan, cluster, "ctr-dnn", RunSettings(batch_size=BATCH, seq_len=None, granularity="block",
                        steps=steps, warmup=3, out_dir=tmp / f"run-{k}-{run}"))
        out.append(launch(spec).measured_step_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--floors", default="50000,150000,200000")
    ap.add_argument("--local-floors", default="5000,13000,13500")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-runs", action="store_true", help="predicted only")
    ap.add_argument("--graph", type=Path, help="a saved profile of ctr-dnn instead of profiling again")
    ap.add_argument("-o", "--out", type=Path, default=HERE / "results" / "ctr_price.json")
    args = ap.parse_args()

    graph_path = args.out.with_name(args.out.stem + "_graph.json")
    if args.graph:
        graph = serde.load(args.graph, expect="graph")
    else:
        zm = load_model("ctr-dnn", batch_size=BATCH)
        graph = profile_step(zm.step, zm.batch, name="ctr-dnn", devices=["cpu:1"], granularity="block",
                             block_classes=zm.block_classes, repeats=5).graph
        serde.dump(graph, graph_path)  # the profile the plans were made from: `hetplan plan` it again
    rows = []
    cloud = load_cluster("cloud-ctr")
    for floor in (float(f) for f in args.floors.split(",")):
        for method in METHODS:
            row, _ = row_for(method, graph, cloud, floor, args.seed, "cloud-ctr")
            rows.append(row)
            print(row)
    local = load_cluster("local")
    measured: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for floor in (float(f) for f in args.local_floors.split(",")):
            for method in METHODS:
                row, plan = row_for(method, graph, local, floor, args.seed, "local")
                if plan is not None and not args.no_runs:
                    key = f"{describe(plan)} m={plan.microbatches} {plan.schedule}"
                    if key not in measured:
                        measured[key] = measure(plan, local, args.steps, Path(tmp), len(measured))
                    step_s = min(measured[key])  # the run least disturbed
                    row["measured_steps_s"] = measured[key]
                    row["measured_samples_per_s"] = BATCH / step_s
                    row["measured_usd_per_1k"] = measured_per_1k(
                        simulate(graph, local, plan, timeline=False).estimate, local, plan, step_s)
                    row["measured_meets_floor"] = bool(BATCH / step_s >= floor)
                rows.append(row)
                print(row)
    summary = {}
    for floor in sorted({r["floor"] for r in rows if r["cluster"] == "cloud-ctr"}):
        by = {r["method"]: r for r in rows if r["cluster"] == "cloud-ctr" and r["floor"] == floor}
        het = by.get("heterps", {})
        for base in ("cheapest all-one-type", "cheapest one-type dp"):
            if by.get(base, {}).get("meets_floor") and het.get("meets_floor"):
                summary[f"cloud-ctr {floor:.0f}/s: {base} / heterps price"] = (
                    by[base]["predicted_usd_per_1k"] / het["predicted_usd_per_1k"])
    write_results(args.out, summary, rows, graph=str(args.graph or graph_path.name))


if __name__ == "__main__":
    main()
