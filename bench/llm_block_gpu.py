"""A transformer block measured on a real GPU against the roofline count that plans at scale use.

`hetplan profile --roofline TYPE` (hetplan.zoo.llm.transformer_chain) times a block as its FLOPs
at ACHIEVED_FRACTION of the type's peak, plus a fixed part. This measures the same blocks, built
by transformers with random weights, on the GPU this runs on (CUDA events, after warm-up), in
three precisions: fp32 (TF32 off, torch's default), TF32 matrix products, and bf16 autocast. A
block's time is the difference between a model of `--deep` layers and one of `--shallow` layers,
divided by the layers between them, so the embedding, the LM head and the loss cancel out.

It also profiles the shallow model at block granularity with hetplan's profiler and puts its
block times beside the direct measurement (the box evidence found CUDA node times overstated).

    python3 bench/llm_block_gpu.py [--shapes opt-350m,opt-1.3b,llama-3-8b] [--out DIR]

Writes llm_block_gpu.json (and prints a markdown table) under --out. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from hetplan.catalog import lookup
from hetplan.profile import profile
from hetplan.profile.devices import cuda_type_name
from hetplan.zoo.llm import ACHIEVED_FRACTION, shape, transformer_chain

# (shape, batch, seq): about 4-8 k tokens a micro-batch, as plans of these models use
CASES = {"opt-350m": (8, 1024), "opt-1.3b": (8, 1024), "llama-3-8b": (4, 1024)}
MODES = ("fp32", "tf32", "bf16")


def build(name: str, layers: int) -> torch.nn.Module:
    """A causal LM of `name`'s shape with `layers` blocks, random weights, on the GPU."""
    import transformers

    s = shape(name)
    if name.startswith("llama"):
        cfg = transformers.LlamaConfig(hidden_size=s.hidden, intermediate_size=s.ffn, num_attention_heads=s.heads,
                                       num_key_value_heads=s.kv_heads or s.heads, num_hidden_layers=layers,
                                       vocab_size=s.vocab, max_position_embeddings=4096)
        with torch.device("cuda"):
            return transformers.LlamaForCausalLM(cfg).train()
    cfg = transformers.OPTConfig(hidden_size=s.hidden, ffn_dim=s.ffn, num_attention_heads=s.heads,
                                 num_hidden_layers=layers, vocab_size=s.vocab, word_embed_proj_dim=s.hidden,
                                 max_position_embeddings=2048, dropout=0.0, attention_dropout=0.0)
    with torch.device("cuda"):
        return transformers.OPTForCausalLM(cfg).train()


def step_times(model: torch.nn.Module, ids: torch.Tensor, mode: str, warmup: int, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of one training step (loss included)."""
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if mode == "bf16" else nullcontext()
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        e[1].record()
        loss.backward()
        e[2].record()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        if i >= warmup:
            fwd.append(e[0].elapsed_time(e[1]) / 1e3)
            bwd.append(e[1].elapsed_time(e[2]) / 1e3)
    return statistics.median(fwd), statistics.median(bwd)


def measure(name: str, shallow: int, deep: int, warmup: int, repeats: int) -> dict:
    batch, seq = CASES[name]
    ids = torch.randint(0, shape(name).vocab, (batch, seq), device="cuda")
    per_layers = {}
    for layers in (shallow, deep):
        model = build(name, layers)
        per_layers[layers] = {mode: step_times(model, ids, mode, warmup, repeats) for mode in MODES}
        del model
        torch.cuda.empty_cache()
    span = deep - shallow
    return {mode: {"block_fwd_s": (per_layers[deep][mode][0] - per_layers[shallow][mode][0]) / span,
                   "block_bwd_s": (per_layers[deep][mode][1] - per_layers[shallow][mode][1]) / span,
                   "shallow_fwd_s": per_layers[shallow][mode][0], "shallow_bwd_s": per_layers[shallow][mode][1]}
            for mode in MODES}


def profiled_block(name: str, layers: int) -> dict:
    """hetplan's profiler on the same shallow model, block granularity, fp32: mean block times."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batch, seq = CASES[name]
    ids = torch.randint(0, shape(name).vocab, (batch, seq))
    block_class = "LlamaDecoderLayer" if name.startswith("llama") else "OPTDecoderLayer"
    graph = profile(build(name, layers), {"input_ids": ids, "labels": ids}, device="cuda",
                    granularity="block", block_classes=[block_class], name=name)
    blocks = [n for n in graph.nodes if n.op == block_class or block_class in str(n.module)]
    t = graph.profiled_on
    return {"type": t, "blocks": len(blocks),
            "block_fwd_s": statistics.mean(n.fwd_s[t] for n in blocks) if blocks else None,
            "block_bwd_s": statistics.mean(n.bwd_s[t] for n in blocks) if blocks else None,
            "step_s": sum(n.fwd_s[t] + n.bwd_s[t] for n in graph.nodes)}


def counted(name: str, type_name: str) -> dict:
    batch, seq = CASES[name]
    graph = transformer_chain(name, batch, seq, [type_name])
    block = next(n for n in graph.nodes if n.id == "block_0")
    return {"flops": block.flops, "fwd_s": block.fwd_s[type_name], "bwd_s": block.bwd_s[type_name]}


def table(rows: list[dict], device: str) -> str:
    lines = [f"{device}, torch {torch.__version__}; roofline at {ACHIEVED_FRACTION} of the fp32 peak",
             "", "| shape | batch x seq | precision | block fwd+bwd ms | roofline ms | measured / roofline "
             "| achieved TFLOP/s | fraction of the precision's peak |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for mode, m in r["measured"].items():
            t = m["block_fwd_s"] + m["block_bwd_s"]
            roof = r["counted"]["fwd_s"] + r["counted"]["bwd_s"]
            flops = 3 * r["counted"]["flops"]
            peak = r["peak_fp32"] if mode == "fp32" else r["peak_16"] / (2 if mode == "tf32" else 1)
            lines.append(f"| {r['shape']} | {r['batch']} x {r['seq']} | {mode} | {t * 1e3:.2f} | {roof * 1e3:.2f} | "
                         f"{t / roof:.2f} | {flops / t / 1e12:.1f} | {flops / t / peak:.2f} |")
    lines += ["", "| shape | profiler's block fwd+bwd ms (fp32) | direct ms | profiler / direct |", "|---|---|---|---|"]
    for r in rows:
        p, m = r.get("profiled") or {}, r["measured"]["fp32"]
        if p.get("block_fwd_s") is not None:
            pt, dt = p["block_fwd_s"] + p["block_bwd_s"], m["block_fwd_s"] + m["block_bwd_s"]
            lines.append(f"| {r['shape']} | {pt * 1e3:.2f} | {dt * 1e3:.2f} | {pt / dt:.2f} |")
        else:
            lines.append(f"| {r['shape']} | {p.get('error', 'no block nodes')} | - | - |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="opt-350m,opt-1.3b,llama-3-8b")
    parser.add_argument("--shallow", type=int, default=2)
    parser.add_argument("--deep", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile-shapes", default="llama-3-8b", help="shapes also run through hetplan's profiler")
    parser.add_argument("--out", type=Path, default=Path("out/bench/llm_block_gpu"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("llm_block_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    props = torch.cuda.get_device_properties(0)
    type_name = cuda_type_name(props.name, props.total_memory)
    dtype = lookup(type_name)
    rows = []
    for name in args.shapes.split(","):
        batch, seq = CASES[name]
        row = {"shape": name, "batch": batch, "seq": seq, "type": type_name, "peak_fp32": dtype.peak_flops,
               "peak_16": dtype.peak_flops_fp16, "counted": counted(name, type_name),
               "measured": measure(name, args.shallow, args.deep, args.warmup, args.repeats)}
        if name in args.profile_shapes.split(","):
            try:
                row["profiled"] = profiled_block(name, args.shallow)
            except Exception as exc:  # noqa: BLE001 - a bench row records what failed and goes on
                row["profiled"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_block_gpu.json").write_text(json.dumps({"device": props.name, "torch": torch.__version__,
                                                             "rows": rows}, indent=1))
    text = table(rows, f"{props.name} ({type_name})")
    (args.out / "llm_block_gpu.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
