"""`hetplan profile`: a model's training step, timed piece by piece, into a graph."""

from __future__ import annotations

import argparse
import contextlib

from hetplan.cli._shared import _console, _emit_json, _progress_bar, checked_batch
from hetplan.errors import HetplanError
from hetplan.io import serde
from hetplan.report.summary import graph_summary


def cmd_profile(args: argparse.Namespace) -> int:
    if args.batch_size is not None:
        checked_batch(args.batch_size, "--batch-size")
    if args.roofline:
        return _count_model(args)
    from hetplan.profile import profile_step
    from hetplan.zoo import load_model

    zoo_model = load_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    bar = _progress_bar(args)
    with bar or contextlib.nullcontext():
        task = bar.add_task("tracing the model", total=1.0) if bar else None
        report = profile_step(
            zoo_model.step, zoo_model.batch, name=zoo_model.name, devices=args.device or ["cpu"],
            granularity=args.granularity,
            block_classes=args.block_class or zoo_model.block_classes or None,
            repeats=args.repeats, seed=args.seed, check=args.check, precision=args.precision,
            tp_degrees=tuple(args.tp_degrees or ()),
            progress=(lambda done, what: bar.update(task, completed=done, description=what)) if bar else None,
        )
    graph = report.graph
    serde.dump(graph, args.output)
    summary = {**{k: v for k, v in graph_summary(graph).items() if k != "ops"}, "kind": "profile",
               "output": str(args.output), "profile_s": report.profile_s,
               "whole_step_s": dict(report.whole_step_s),
               "whole_step_range_s": {k: list(v) for k, v in report.whole_step_range_s.items()},
               "check_ratio": dict(report.check_ratio), "check_ratio_median": dict(report.check_ratio_median)}
    if args.json:
        _emit_json(summary)
        return 0
    out = _console()
    out.print(f"wrote {args.output}: graph {graph.name!r} at {graph.meta['granularity']} granularity, "
              f"{len(graph.nodes)} nodes, {len(graph.edges)} edges, batch {graph.batch_size}, "
              f"{graph.precision}, profiled on {', '.join(graph.device_types)} in {report.profile_s:.1f} s")
    for dtype, ratio in report.check_ratio.items():
        low, high = report.whole_step_range_s[dtype]
        out.print(f"check on {dtype}: sum of node times / measured whole step = {ratio:.3f} repeat by repeat "
                  f"(median), {report.check_ratio_median[dtype]:.3f} comparing medians; "
                  f"whole step {_ms(report.whole_step_s[dtype])} median, {_ms(low)} to {_ms(high)}")
    return 0


def _count_model(args: argparse.Namespace) -> int:
    """`profile --roofline`: a transformer counted from its shape, no torch, no device."""
    from hetplan.zoo.llm import shape, transformer_chain

    for flag in ("device", "check", "block_class", "tp_degrees"):
        if getattr(args, flag):
            raise HetplanError(f"--{flag.replace('_', '-')} measures a model on a device; --roofline counts it: "
                               "give one or the other")
    model = shape(args.model)
    batch = 8 if args.batch_size is None else args.batch_size  # checked by cmd_profile
    seq = 2048 if args.seq_len is None else args.seq_len
    if seq < 1:
        raise HetplanError(f"--seq-len: {seq} must be >= 1")
    graph = transformer_chain(model, batch, seq, args.roofline, args.precision)
    serde.dump(graph, args.output)
    summary = {**{k: v for k, v in graph_summary(graph).items() if k != "ops"}, "kind": "profile",
               "output": str(args.output), "source": "analytic", "profile_s": 0.0}
    if args.json:
        _emit_json(summary)
        return 0
    _console().print(f"wrote {args.output}: {model.name} counted, not measured ({len(graph.nodes)} nodes, "
                     f"{graph.param_bytes_total / 4e9:.2f} billion parameters, batch {batch} x {seq} tokens, "
                     f"{graph.precision}), "
                     f"times from the roofline of {', '.join(args.roofline)}")
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
