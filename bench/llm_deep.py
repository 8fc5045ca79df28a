"""Plans for models that fit nowhere whole: dp's plan for each problem against a lower bound on its step.

    .venv/bin/python bench/llm_deep.py [--only NAME ...] [--timeout-s 900] [--markdown]
        [--recompute MODE ...] [--tp-activations split|whole ...] [--sequence-parallel MODE ...]
        [--shard MODE ...] [-o bench/results/llm_deep.json]

Problems (`PROBLEMS`, a global batch of 2,048 sequences for the Llamas, 1,024 for the others):
Llama-3-8B at 8,192 tokens a sequence on 8 A100-40GB + 8 V100-16GB and on 32 A100 + 96 V100
(fp32 and bf16; 1.7 GB/s between hosts, Metis's and Sailor's setting), Llama-3-70B in bf16 at
4,096 tokens on 1,024 GPUs of three types (256 H100-80GB, 384 A100-40GB, 384 V100-16GB; 100
Gbit/s), and the peers' OPT-350M and GPT-Neo-2.7B at 2,048 tokens on 32 A100 + 96 V100 (fp32,
1.7 GB/s). Graphs are transformer chains counted from the models' shapes (`hetplan.zoo.llm`:
Adam, 1F1B; fp32 at 0.72 of each type's fp32 peak, bf16 at 0.43 of the 16-bit peak); clusters
are whole hosts of 8 GPUs of one type each, 100 GB/s inside a host (`hetplan.io.clusters.hosts_spec`).

For each problem dp runs with `PlanOptions()`'s defaults (no option asked for) in a process of
its own (`bench/dp_scale.py`'s `run_dp`: wall seconds, peak memory), within `--timeout-s`; a run
that times out, finds no plan (dp's InfeasibleError) or fails otherwise is a row saying so, with
dp's message, and the next problem runs. A plan's row: its step, stages (device type, replicas,
tensor-parallel degree, recomputation, sharding, nodes), devices used per type, micro-batches,
peak memory per type against the type's memory, planning time and memory, dp's `meta`, and two
lower bounds (`lower_bound_s`): `bound_any_s`, the forward and backward work of the whole batch
shared among every device of the cluster at its own speed, which no plan beats; `bound_plan_s`,
the same with the plan's recomputed forwards added. The gaps are the step over each. With
`--recompute MODE` (repeatable) each problem is planned once per mode instead (`hetplan plan
--recompute`: never, stage or block where needed, or both, the default's where-needed), a row each;
with `--tp-activations whole` also with a tensor-parallel group's activations counted whole on
each of its devices (every node's `act_split_share` 0), as before they were split.

Every figure is the event simulator's (the plan's `predicted`, as `make_plan` attaches it) on
counted graphs: nothing here was measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import dp_scale
from llm_plans import IB
from results_file import write_results

from hetplan.cluster import Cluster
from hetplan.cost import CostModel
from hetplan.graph import Graph
from hetplan.io import serde
from hetplan.io.clusters import cluster_from_spec, hosts_spec
from hetplan.plan import Plan
from hetplan.planners.options import RECOMPUTE_CHOICES, SEQUENCE_PARALLEL_CHOICES, SHARD_CHOICES
from hetplan.zoo.llm import transformer_chain

HERE = Path(__file__).resolve().parent
METIS = "1.7GB/s"  # between hosts in Metis's and Sailor's experiments
GIB = 2**30
A100, V100, H100 = "a100-40gb", "v100-16gb", "h100-80gb"


@dataclass(frozen=True)
class Problem:
    model: str  # a `hetplan.zoo.llm.SHAPES` name
    batch: int  # sequences a step
    seq_len: int
    precision: str
    groups: tuple[tuple[str, int, int], ...]  # (device type, hosts, GPUs a host)
    inter_host: str

    def graph(self) -> Graph:
        return transformer_chain(self.model, self.batch, self.seq_len, [t for t, _, _ in self.groups],
                                 self.precision)

    def cluster(self, name: str) -> Cluster:
        return cluster_from_spec(hosts_spec(self.groups, inter_host=self.inter_host, name=slug(name)), name)


def _llama_8k(groups: tuple[tuple[str, int, int], ...], precision: str) -> Problem:
    return Problem("llama-3-8b", 2048, 8192, precision, groups, METIS)


EIGHT_EIGHT = ((A100, 1, 8), (V100, 1, 8))
PEERS = ((A100, 4, 8), (V100, 12, 8))
PROBLEMS = {
    "llama-3-8b/s8192/8+8/fp32": _llama_8k(EIGHT_EIGHT, "fp32"),
    "llama-3-8b/s8192/8+8/bf16": _llama_8k(EIGHT_EIGHT, "bf16"),
    "llama-3-8b/s8192/32+96/fp32": _llama_8k(PEERS, "fp32"),
    "llama-3-8b/s8192/32+96/bf16": _llama_8k(PEERS, "bf16"),
    "llama-3-70b/s4096/1024/bf16": Problem("llama-3-70b", 2048, 4096, "bf16",
                                           ((H100, 32, 8), (A100, 48, 8), (V100, 48, 8)), IB),
    "opt-350m/128": Problem("opt-350m", 1024, 2048, "fp32", PEERS, METIS),
    "gpt-neo-2.7b/128": Problem("gpt-neo-2.7b", 1024, 2048, "fp32", PEERS, METIS),
}


def slug(name: str) -> str:
    return name.replace("/", "-").replace("+", "p")


def node_times_s(graph: Graph, cluster: Cluster) -> dict[str, dict[str, tuple[float, float]]]:
    """Per device type of the cluster, per node, its forward and backward time for the whole batch."""
    cost = CostModel(graph, cluster)
    public = getattr(cost, "node_times_s", None)  # the cost model's accessor, where it is public
    types = sorted({d.type for d in cluster.devices})
    if public is not None:
        return {t: dict(public(t)) for t in types}
    # a counted graph has its times on every type it was counted for
    return {t: {n.id: (n.fwd_s[t], n.bwd_s[t]) for n in graph.nodes} for t in types}


def work_s(times: Mapping[str, Mapping[str, tuple[float, float]]],
           recomputed: Iterable[str] = ()) -> dict[str, dict[str, float]]:
    """Per type, per node, what it costs one device of the type: forward and backward, and the
    forward again for the `recomputed` nodes."""
    again = set(recomputed)
    return {t: {n: f + b + (f if n in again else 0.0) for n, (f, b) in per.items()} for t, per in times.items()}


def lower_bound_s(work: Mapping[str, Mapping[str, float]], devices_per_type: Mapping[str, int]) -> float:
    """A lower bound on the time the devices take to do `work`, shared among them at will (each
    node's rows split any way), nothing else charged: no messages, sums, bubbles or fixed costs.

    Weighting each device by its speed over the whole chain, y_t = 1 / (S W_t) with W_t the
    chain's time on type t and S the sum over devices of 1 / W_t, every split of the work takes
    at least the sum over nodes of the least of y_t w_t(node) over the types (weak duality of the
    split's linear program). That is 1 / S, the whole chain over every device's speed, when every
    node takes the same share of the chain's time on every type; a little less where the shares
    differ (the embedding, bound by memory, not by FLOPs), and still a bound."""
    whole = {t: math.fsum(work[t].values()) for t in devices_per_type}
    speed = math.fsum(k / whole[t] for t, k in devices_per_type.items())
    nodes = work[next(iter(devices_per_type))]
    return math.fsum(min(work[t][n] / whole[t] for t in devices_per_type) for n in nodes) / speed


def count_types(cluster: Cluster, devices: Iterable[str]) -> dict[str, int]:
    found: dict[str, int] = {}
    for d in devices:
        found[cluster.device(d).type] = found.get(cluster.device(d).type, 0) + 1
    return found


def stage_rows(plan: Plan, cluster: Cluster) -> list[dict]:
    return [{"type": "+".join(sorted(count_types(cluster, s.all_devices))), "replicas": len(s.devices), "tp": s.tp,
             "recompute": s.recompute, "shard": s.shard, "sp": s.sequence_parallel, "nodes": len(s.nodes)}
            for s in plan.stages]


def peak_memory(plan: Plan, cluster: Cluster) -> dict[str, dict[str, int]]:
    """Per device type the plan uses, its fullest device's peak and the type's memory."""
    out: dict[str, dict[str, int]] = {}
    for d in plan.devices:
        dev, peak = cluster.device(d), plan.predicted.peak_mem_bytes.get(d, 0)
        was = out.get(dev.type, {"peak_bytes": 0, "mem_bytes": dev.mem_bytes})
        out[dev.type] = {"peak_bytes": max(was["peak_bytes"], peak), "mem_bytes": min(was["mem_bytes"], dev.mem_bytes)}
    return out


def plan_fields(plan: Plan, cluster: Cluster, times, devices_per_type: Mapping[str, int]) -> dict:
    recomputed = [n for s in plan.stages if s.recomputes for n in s.nodes]
    bound_plan = lower_bound_s(work_s(times, recomputed), devices_per_type)
    est, meta = plan.predicted, serde.plain(plan.meta)
    return {"step_s": est.step_s, "feasible": est.feasible, "violations": list(est.violations),
            "stages": stage_rows(plan, cluster), "devices_used": count_types(cluster, plan.devices),
            "microbatches": plan.microbatches, "peak_memory": peak_memory(plan, cluster),
            "bound_plan_s": bound_plan, "gap_plan": est.step_s / bound_plan,
            "bubble_fraction": est.bubble_fraction, "busy_share": busy_share(plan, cluster),
            "dp_meta": meta.get("dp"), "runtime_refusal": meta.get("runtime_refusal")}


def busy_share(plan: Plan, cluster: Cluster) -> dict[str, float]:
    """Per device type the plan uses, the mean share of the step its devices compute (the event
    simulator's busy time over the step): where the gap to the bound goes, with the unused devices."""
    shares: dict[str, list[float]] = {}
    for d in plan.devices:
        shares.setdefault(cluster.device(d).type, []).append(plan.predicted.busy_s.get(d, 0.0) / plan.predicted.step_s)
    return {t: sum(v) / len(v) for t, v in shares.items()}


def one_problem(name: str, timeout_s: float, tmp: Path, recompute: str | None = None,
                tp_activations: str = "split", sequence_parallel: str | None = None, shard: str | None = None) -> dict:
    problem = PROBLEMS[name]
    graph, cluster = problem.graph(), problem.cluster(name)
    if tp_activations == "whole":  # a group's devices each counted with every activation (an upper bound)
        graph = replace(graph, nodes=tuple(replace(n, act_split_share=0.0, act_sequence_share=0.0)
                                           for n in graph.nodes))
    devices_per_type = count_types(cluster, cluster.ids)
    times = node_times_s(graph, cluster)
    bound_any = lower_bound_s(work_s(times), devices_per_type)
    row = {"problem": name, "model": problem.model, "batch": problem.batch, "seq_len": problem.seq_len,
           "precision": problem.precision, "gpus": devices_per_type, "inter_host": problem.inter_host,
           "bound_any_s": bound_any, "recompute_option": recompute or "default", "tp_activations": tp_activations,
           "sequence_parallel_option": sequence_parallel or "default", "shard_option": shard or "default"}
    options = {**({"recompute": recompute} if recompute else {}),
               **({"sequence_parallel": sequence_parallel} if sequence_parallel else {}),
               **({"shard": shard} if shard else {})}
    graph_file = tmp / f"graph-{slug(name)}.json"  # run_dp writes the cluster to {name}.json
    serde.dump(graph, graph_file)
    began = time.perf_counter()
    try:
        dp = dp_scale.run_dp(graph_file, cluster, tmp, timeout_s, options or None)
    except subprocess.TimeoutExpired:
        return {**row, "status": "timed out", "why": f"dp ran past {timeout_s:g} s and was stopped",
                "process_s": time.perf_counter() - began}
    except dp_scale.DpFailed as exc:
        # dp's last line names the exception: an InfeasibleError is dp's answer, anything else a fault
        status = "no plan" if str(exc).startswith("hetplan.errors.InfeasibleError") else "failed"
        return {**row, "status": status, "why": str(exc), "process_s": time.perf_counter() - began}
    fields = plan_fields(dp["plan"], cluster, times, devices_per_type)
    return {**row, "status": "planned", **fields, "gap_any": fields["step_s"] / bound_any,
            "planning_s": dp["seconds"], "planning_peak_rss_mib": dp["peak_rss_mib"],
            "process_s": time.perf_counter() - began}


def short(device_type: str) -> str:
    return device_type.split("-")[0].upper()


def _zero(level) -> str:
    """A stage's sharding: ZeRO's level (`Stage.shard`; an older plan's true reads as 1), or no."""
    return f"zero-{int(level)}" if level else "no"


def stages_text(stages: list[dict]) -> str:
    """Runs of equal stages as `k x [TYPE x replicas (tp, recompute, shard)]`."""
    texts = [f"{'+'.join(map(short, s['type'].split('+')))} x {s['replicas']} "
             f"({s['tp']}{' sp' if s.get('sp') else ''}, {unit_text(s['recompute'])}, {_zero(s['shard'])})"
             for s in stages]
    runs = [(t, len(list(same))) for t, same in itertools.groupby(texts)]
    return ", ".join(t if k == 1 else f"{k} x [{t}]" for t, k in runs)


def label(r: dict) -> str:
    """A row's problem, with the --recompute and --sequence-parallel it was planned with where not
    the default."""
    option, sp = r.get("recompute_option", "default"), r.get("sequence_parallel_option", "default")
    whole = r.get("tp_activations") == "whole"
    return r["problem"] + ("" if option == "default" else f" (--recompute {option})") + (
        "" if sp == "default" else f" (--sequence-parallel {sp})") + (
        " (a group's activations whole)" if whole else "")


def unit_text(recompute) -> str:
    """A stage's recomputation as the table shows it (files of before the units: true, false)."""
    return {True: "stage", False: "no", "none": "no"}.get(recompute, recompute)


def markdown_row(r: dict) -> str:
    if r["status"] != "planned":
        why = r["why"].replace("|", "\\|")  # a cell ends at a bar
        return (f"| {label(r)} | {r['status']}: {why} | any plan >= {r['bound_any_s']:.2f} s "
                f"| - | - | - | - | {r['process_s']:.0f} (process) | - |")
    step = f"{r['step_s']:.2f} s" + ("" if r["feasible"] else " (infeasible)")
    bound = f"{r['bound_plan_s']:.2f} s ({r['gap_plan']:.2f}x)"
    if r["bound_plan_s"] > r["bound_any_s"] * (1 + 1e-6):  # the plan recomputes: say what no plan beats too
        bound += f"; any plan {r['bound_any_s']:.2f} s ({r['gap_any']:.2f}x)"
    used = " + ".join(f"{n} {short(t)}" for t, n in r["devices_used"].items())
    memory = ", ".join(f"{short(t)} {m['peak_bytes'] / GIB:.1f}/{m['mem_bytes'] / GIB:.0f} GiB"
                       for t, m in r["peak_memory"].items())
    return (f"| {label(r)} | {step} | {bound} | {stages_text(r['stages'])} | {used} | {r['microbatches']} "
            f"| {memory} | {r['planning_s']:.1f} | {r['planning_peak_rss_mib']:.0f} |")


def markdown(rows: list[dict]) -> str:
    """The rows as BENCHMARKS.md's tables have them, and where each plan's gap to the bound goes."""
    head = ("| problem | step | bound (gap) | stages: type x replicas (tp, recompute, shard) | devices used per type "
            "| micro-batches | peak memory per type / its memory | planning s | planning MiB |")
    gaps = ["| problem | devices unused | idle share of the used devices' step (fill, drain, imbalance, sums) "
            "| busy share of the step, per type used |", "|---|---|---|---|"]
    for r in rows:
        if r["status"] == "planned":
            unused = {t: n - r["devices_used"].get(t, 0) for t, n in r["gpus"].items()}
            gaps.append(f"| {label(r)} | {', '.join(f'{n} {short(t)}' for t, n in unused.items() if n) or 'none'} "
                        f"| {r['bubble_fraction']:.0%} | "
                        f"{', '.join(f'{short(t)} {v:.0%}' for t, v in r['busy_share'].items())} |")
    return "\n".join([head, "|---" * 9 + "|", *map(markdown_row, rows), "", *gaps])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=list(PROBLEMS), help="a problem (default: all)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="dp's time limit a problem")
    parser.add_argument("--markdown", action="store_true", help="print the rows as a Markdown table at the end")
    parser.add_argument("--recompute", action="append", choices=RECOMPUTE_CHOICES,
                        help="plan with this --recompute instead of the default (repeatable: a row each)")
    parser.add_argument("--tp-activations", action="append", choices=["split", "whole"],
                        help="a group's activations split as the graph says (the default) or counted whole on "
                             "each device, as before (repeatable: a row each)")
    parser.add_argument("--sequence-parallel", action="append", choices=SEQUENCE_PARALLEL_CHOICES,
                        help="plan with this --sequence-parallel instead of the default (repeatable: a row each)")
    parser.add_argument("--shard", action="append", choices=SHARD_CHOICES,
                        help="plan with this --shard instead of the default (repeatable: a row each)")
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "llm_deep.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or PROBLEMS:
            for recompute, acts, sp, shard in itertools.product(args.recompute or [None], args.tp_activations or
                                                                ["split"], args.sequence_parallel or [None],
                                                                args.shard or [None]):
                rows.append(one_problem(name, args.timeout_s, Path(tmp), recompute, acts, sp, shard))
                print(json.dumps(rows[-1], default=str), flush=True)
    statuses = [r["status"] for r in rows]
    summary = {"problems": len(rows), "planned": statuses.count("planned"),
               "feasible": sum(bool(r.get("feasible")) for r in rows), "timed_out": statuses.count("timed out"),
               "no_plan": statuses.count("no plan"), "failed": statuses.count("failed"), "timeout_s": args.timeout_s,
               "machine": f"{os.cpu_count()} cores", "figures": "event simulator on counted graphs"}
    write_results(args.output, summary, rows)
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
