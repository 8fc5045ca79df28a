"""Tensor-parallel block times: hetplan's projection from a block's 1-way time against published
measurements at degrees 2 and 4.

    .venv/bin/python bench/tp_projection.py [-o bench/results/tp_projection.json] [--sailor-mirror DIR]

Measurements (`PUBLISHED`, copied here so that the benchmark runs without the network): the Sailor
planner's per-layer profiles (github.com/eth-easl/sailor, commit SAILOR_COMMIT), files
`sailor/Planner/sailor_planner/profiles/{OPT-350,GPT-Neo-2.7}/{A100-40,V100-16}/profile.json`,
laid out `profile[micro-batch][tp degree][layer] = [forward s, backward s, optimizer step s]`
(`sailor/profiling/gather_profs.py`). We take layer "2", the second transformer layer, which
Sailor's profiler copies to every later layer (`third_party/Megatron-DeepSpeed/megatron/training.py`:
`time_fwd_avg["4"]`), forward and backward, every micro-batch size that has a TP-1 time, degrees
1, 2 and 4. They were taken by Megatron-DeepSpeed (`profile_all.py`: 2 of the layers, sequence
2,048, fp32 activations: 4 bytes an element in `sailor/Planner/llm_info.json`), each layer timed with
CUDA events around its module's forward and backward hooks (`sailor/profiling/profile_utils.py`),
so a layer's time includes Megatron's all-reduces inside it. `--sailor-mirror DIR` (or the
environment variable SAILOR_MIRROR: a git directory of that repository, as `fetch` leaves it)
checks the copied numbers against the files first.

Projection: per model, GPU type and micro-batch size, hetplan's counted chain
(`zoo.llm.transformer_chain`, fp32, sequence 2,048, batch = the micro-batch, so tp_units,
act_split_share, out_bytes and the fixed part of each pass are the chain's) with one block's forward
and backward replaced by the published TP-1 times; a cluster of that type with the host links of the
preset `a100+v100-8` (A100s on 200 GB/s, V100s on 50 GB/s pairs, 5 us), its V100s made 16 GB; then
`cost.tensor.node_tp_times_s` of that block on 2 and 4 devices of the host, one micro-batch.
Compared: forward + backward, projected / measured - 1. Also per row: the ideal split (TP-1 time / t),
the projection's parts (the split compute, the fixed part, the all-reduces), the overhead over the
ideal split projected against measured (`error_overhead`: the part hetplan adds), the projection without
DTensor's fixed factor (Megatron does not use DTensor) and with the links of the preset
`a100x32+v100x96` (100 GB/s in every host). Nothing is timed: the projection is arithmetic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from results_file import write_results

from hetplan.cost import CostModel
from hetplan.cost.tensor import DTENSOR_FIXED_FACTOR, node_tp_times_s
from hetplan.io.clusters import cluster_from_spec, preset_spec
from hetplan.precision import FP32
from hetplan.zoo.llm import transformer_chain

HERE = Path(__file__).resolve().parent
SAILOR_REPO = "eth-easl/sailor"
SAILOR_COMMIT = "cf2c8e3cc53ce178fe58a4003f46b4b6b848fc33"
SAILOR_FILE = "sailor/Planner/sailor_planner/profiles/{model}/{gpu}/profile.json"
SAILOR_LAYER = "2"
SEQ_LEN = 2048  # Sailor's profile_all.py: seq_length 2048 for OPT-350 and GPT-Neo-2.7
BLOCK = "block_1"
MAIN_PRESET, ALT_PRESET = "a100+v100-8", "a100x32+v100x96"
MODELS = {"OPT-350": "opt-350m", "GPT-Neo-2.7": "gpt-neo-2.7b"}
TYPES = {"A100-40": "a100-40gb", "V100-16": "v100-16gb"}

# (model, GPU) -> micro-batch -> tp degree -> (forward s, backward s) of layer "2", copied from
# SAILOR_FILE at SAILOR_COMMIT (OPT-350 on V100-16 at micro-batch 8 has no TP-1 time: left out).
PUBLISHED = {
    ("OPT-350", "A100-40"): {
        1: {1: (0.002314, 0.005909), 2: (0.001908, 0.003398), 4: (0.002134, 0.002278)},
        2: {1: (0.004169, 0.011628), 2: (0.002624, 0.006325), 4: (0.002394, 0.004023)},
        4: {1: (0.008204, 0.022715), 2: (0.004744, 0.012288), 4: (0.003001, 0.006854)},
        8: {1: (0.016207, 0.044958), 2: (0.009277, 0.023888), 4: (0.005634, 0.013383)},
    },
    ("OPT-350", "V100-16"): {
        1: {1: (0.007321, 0.017195), 2: (0.004224, 0.00951), 4: (0.002968, 0.005963)},
        2: {1: (0.014086, 0.033946), 2: (0.008285, 0.018651), 4: (0.005193, 0.010241)},
        4: {1: (0.028839, 0.071714), 2: (0.016014, 0.035784), 4: (0.009555, 0.019837)},
    },
    ("GPT-Neo-2.7", "A100-40"): {
        1: {1: (0.004861, 0.011729), 2: (0.003039, 0.006597), 4: (0.002448, 0.004131)},
        2: {1: (0.009391, 0.022795), 2: (0.005581, 0.012448), 4: (0.003566, 0.007378)},
        4: {1: (0.019135, 0.045766), 2: (0.010885, 0.024591), 4: (0.006856, 0.014233)},
        8: {1: (0.03929, 0.093055), 2: (0.021963, 0.049271), 4: (0.013412, 0.027866)},
    },
    ("GPT-Neo-2.7", "V100-16"): {
        1: {1: (0.027493, 0.059348), 2: (0.015067, 0.031247), 4: (0.008557, 0.017177)},
        2: {1: (0.056482, 0.121392), 2: (0.030106, 0.062185), 4: (0.017192, 0.034113)},
        4: {1: (0.116512, 0.240177), 2: (0.060505, 0.124535), 4: (0.033648, 0.065708)},
    },
}


def verify(mirror: str) -> None:
    """Exit with one line unless PUBLISHED equals the files at SAILOR_COMMIT in the git directory `mirror`."""
    for (model, gpu), table in PUBLISHED.items():
        path = SAILOR_FILE.format(model=model, gpu=gpu)
        done = subprocess.run(["git", "--git-dir", mirror, "show", f"{SAILOR_COMMIT}:{path}"],
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"tp_projection: cannot read {path} at {SAILOR_COMMIT[:12]} in {mirror}: "
                     f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'git failed'}")
        profile = json.loads(done.stdout)
        for mbs, degrees in table.items():
            for t, times in degrees.items():
                if tuple(profile[str(mbs)][str(t)][SAILOR_LAYER][:2]) != times:
                    sys.exit(f"tp_projection: {path} mbs {mbs} tp {t} differs from the copied table")
    print(f"the copied table equals {SAILOR_REPO}@{SAILOR_COMMIT[:12]}")


def host_cluster(preset: str):
    """The preset's cluster with its V100s made 16 GB (Sailor's V100-16); links as the preset has them."""
    spec = preset_spec(preset)
    for dev in spec["devices"]:
        if dev["type"].startswith("v100"):
            dev["type"] = TYPES["V100-16"]
    return cluster_from_spec(spec, preset)


def group(cluster, device_type: str, t: int) -> list[str]:
    """The first `t` devices of `device_type` on the first host that has that type."""
    of_type = [d for d in cluster.devices if d.type == device_type]
    on_host = [d.id for d in of_type if d.host == of_type[0].host]
    if len(on_host) < t:
        raise SystemExit(f"tp_projection: {cluster.name} has {len(on_host)} {device_type} on a host, fewer than {t}")
    return on_host[:t]


def measured_graph(model: str, device_type: str, mbs: int, tp1: tuple[float, float]):
    """The counted chain of `model` at batch `mbs`, its BLOCK carrying the published TP-1 times,
    and the chain's own (counted) forward + backward of that block."""
    chain = transformer_chain(MODELS[model], mbs, SEQ_LEN, [device_type], FP32)
    block = chain.by_id[BLOCK]
    counted = block.fwd_s[device_type] + block.bwd_s[device_type]
    measured = dataclasses.replace(block, fwd_s={device_type: tp1[0]}, bwd_s={device_type: tp1[1]})
    nodes = tuple(measured if n.id == BLOCK else n for n in chain.nodes)
    return dataclasses.replace(chain, nodes=nodes), counted


def projection(graph, cluster, device_type: str, t: int) -> dict:
    """node_tp_times_s of BLOCK on `t` devices (one micro-batch), forward + backward, in parts."""
    fwd, bwd, fwd_fixed, bwd_fixed = node_tp_times_s(CostModel(graph, cluster), BLOCK, device_type,
                                                     group(cluster, device_type, t), microbatches=1)
    node = graph.by_id[BLOCK]
    own_fixed = node.fwd_fixed_s.get(device_type, 0.0) + node.bwd_fixed_s.get(device_type, 0.0)
    fixed = own_fixed * (1 + DTENSOR_FIXED_FACTOR)
    return {"fwd": fwd, "bwd": bwd, "total": fwd + bwd, "split": fwd + bwd - fwd_fixed - bwd_fixed,
            "fixed": fixed, "allreduce": fwd_fixed + bwd_fixed - fixed,
            "dtensor": own_fixed * DTENSOR_FIXED_FACTOR}


def compare(model: str, gpu: str, mbs: int, t: int, clusters: dict) -> dict:
    """One row: the published time at degree `t` against hetplan's projection from the TP-1 time."""
    degrees, device_type = PUBLISHED[(model, gpu)][mbs], TYPES[gpu]
    graph, counted = measured_graph(model, device_type, mbs, degrees[1])
    main, alt = (projection(graph, clusters[p], device_type, t) for p in (MAIN_PRESET, ALT_PRESET))
    measured, tp1 = sum(degrees[t]), sum(degrees[1])
    ms = 1e3
    return {
        "model": model, "type": gpu, "degree": t, "microbatch": mbs,
        "measured_ms": round(measured * ms, 3), "measured_fwd_ms": round(degrees[t][0] * ms, 3),
        "measured_bwd_ms": round(degrees[t][1] * ms, 3), "tp1_ms": round(tp1 * ms, 3),
        "ideal_ms": round(tp1 / t * ms, 3), "measured_overhead_ms": round((measured - tp1 / t) * ms, 3),
        "projected_ms": round(main["total"] * ms, 3), "projected_fwd_ms": round(main["fwd"] * ms, 3),
        "projected_bwd_ms": round(main["bwd"] * ms, 3), "projected_split_ms": round(main["split"] * ms, 3),
        "projected_fixed_ms": round(main["fixed"] * ms, 3),
        "projected_allreduce_ms": round(main["allreduce"] * ms, 3),
        "error": round(main["total"] / measured - 1, 4),
        "error_ideal": round(tp1 / t / measured - 1, 4),
        "projected_overhead_ms": round((main["total"] - tp1 / t) * ms, 3),
        "error_overhead": round((main["total"] - tp1 / t) / (measured - tp1 / t) - 1, 4),
        "error_without_dtensor": round((main["total"] - main["dtensor"]) / measured - 1, 4),
        "error_alt_links": round(alt["total"] / measured - 1, 4),
        "counted_tp1_ms": round(counted * ms, 3),
    }


def stats(errors: list[float]) -> dict:
    """The median absolute error and the worst (largest absolute, its sign kept)."""
    return {"n": len(errors), "median_abs": round(statistics.median(abs(e) for e in errors), 4),
            "worst": round(max(errors, key=abs), 4)}


def summarize(rows: list[dict], key: str = "error") -> dict:
    """`stats` of `key` per (type, degree) and over every row."""
    out = {}
    for gpu in TYPES:
        for t in (2, 4):
            picked = [r[key] for r in rows if r["type"] == gpu and r["degree"] == t]
            out[f"{gpu} tp{t}"] = stats(picked)
    out["overall"] = stats([r[key] for r in rows])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=HERE / "results" / "tp_projection.json")
    parser.add_argument("--sailor-mirror", default=os.environ.get("SAILOR_MIRROR"),
                        help="git directory of eth-easl/sailor: check the copied numbers against it first")
    args = parser.parse_args()
    if args.sailor_mirror:
        verify(args.sailor_mirror)
    clusters = {p: host_cluster(p) for p in (MAIN_PRESET, ALT_PRESET)}
    rows = [compare(model, gpu, mbs, t, clusters) for (model, gpu), table in PUBLISHED.items()
            for mbs in table for t in (2, 4)]
    for r in rows:
        print(f"{r['model']:>11} {r['type']} tp{r['degree']} mbs {r['microbatch']}: measured {r['measured_ms']:8.3f} ms"
              f"  projected {r['projected_ms']:8.3f} ms  {r['error']:+7.1%}  (ideal {r['error_ideal']:+6.1%})")
    variants = {k: summarize(rows, k)
                for k in ("error_overhead", "error_ideal", "error_without_dtensor", "error_alt_links")}
    write_results(args.output, summarize(rows), rows, variants=variants,
                  source={"repo": SAILOR_REPO, "commit": SAILOR_COMMIT, "files": SAILOR_FILE, "layer": SAILOR_LAYER,
                          "fields": "profile[mbs][tp][layer][0] forward s, [1] backward s"},
                  clusters={"main": MAIN_PRESET, "alt_links": ALT_PRESET}, seq_len=SEQ_LEN,
                  dtensor_fixed_factor=DTENSOR_FIXED_FACTOR)


if __name__ == "__main__":
    main()
