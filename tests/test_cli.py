import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetplan.io import serde
from hetplan.runtime.settings import RunSettings


def test_help_explains_the_workflow(cli):
    r = cli("--help")
    assert r.code == 0
    for word in ("workflow", "import pipedream", "plan", "info", "--json"):
        assert word in r.out


def test_acceptance_resnet50(cli, profiles, tmp_path):
    """The issue's acceptance commands: import, then info --json."""
    src = profiles / "resnet50" / "graph.txt"
    out = tmp_path / "r50.json"
    assert cli("import", "pipedream", src, "-o", out).code == 0
    r = cli("info", out, "--json")
    assert r.code == 0
    info = r.json()
    assert info["kind"] == "graph" and info["nodes"] == 177 and info["edges"] == 193
    fwd_ms = sum(float(m) for m in re.findall(r"forward_compute_time=([\d.]+)", src.read_text()))
    assert math.isclose(info["fwd_s_total"], fwd_ms / 1e3, rel_tol=1e-12)
    assert {"bwd_s_total", "param_bytes_total"} <= set(info)


def test_info_on_a_preset(cli):
    r = cli("info", "hetero-4", "--json")
    assert r.code == 0
    info = r.json()
    assert info["kind"] == "cluster" and len(info["devices"]) == 4
    for d in info["devices"]:
        assert {"id", "type", "host", "mem_bytes", "peak_flops", "usd_per_hour"} <= set(d)
    assert len(info["links"]) == 6


def test_info_tables_for_people(cli, profiles, tmp_path):
    g = tmp_path / "vgg.json"
    cli("import", "pipedream", profiles / "vgg16" / "graph.txt", "-o", g)
    r = cli("info", g)
    assert r.code == 0 and "nodes / edges" in r.out and "41 / 41" in r.out
    r = cli("info", "hetero-4")
    assert r.code == 0 and "a100-40gb" in r.out and "bandwidth between devices" in r.out


def test_plan_then_info_on_the_plan(cli, profiles, tmp_path):
    g, p = tmp_path / "r50.json", tmp_path / "plan.json"
    cli("import", "pipedream", profiles / "resnet50" / "graph.txt", "-o", g)
    r = cli("plan", g, "--cluster", "hetero-4", "--planner", "uniform", "-o", p, "--json")
    assert r.code == 0
    plan = r.json()
    assert plan["kind"] == "plan" and plan["num_stages"] == 4 and plan["predicted"]["method"] == "event"
    assert plan["microbatches"] == 16
    r = cli("info", p, "--json")
    assert r.code == 0 and r.json()["stages"] == plan["stages"]
    r = cli("plan", g, "--cluster", "hetero-4", "--planner", "single", "--schedule", "gpipe",
            "--microbatches", "4")
    assert r.code == 0 and "event-driven simulator" in r.out and "feasible" in r.out


def test_simulate_prints_the_estimate_and_draws_the_step(cli, profiles, tmp_path):
    g, p = tmp_path / "vgg.json", tmp_path / "plan.json"
    cli("import", "pipedream", profiles / "vgg16" / "graph.txt", "-o", g)
    assert cli("plan", g, "--cluster", "hetero-4", "--planner", "uniform", "-o", p).code == 0
    png, trace = tmp_path / "out" / "step.png", tmp_path / "trace.json"
    r = cli("simulate", p, "--graph", g, "--cluster", "hetero-4", "--gantt", png, "--trace", trace, "--json")
    assert r.code == 0, r.err
    est = r.json()
    for key in ("step_s", "samples_per_s", "bubble_fraction", "peak_mem_bytes", "usd_per_step", "feasible",
                "violations", "link_bytes", "peak_link"):
        assert key in est
    assert set(est["peak_mem_bytes"]) == {"a0", "v0", "t0", "t1"} and est["feasible"] is True
    assert est["samples_per_s"] == pytest.approx(128 / est["step_s"])
    assert est["step_s"] == pytest.approx(json.loads(p.read_text())["predicted"]["step_s"])
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert width >= 1200 and height >= 400
    events = json.loads(trace.read_text())["traceEvents"]
    # 4 stages x 16 micro-batches x (F, B), plus 3 links x 2 directions x 16 x 1 tensor, plus an
    # optimizer step on each of the 4 devices
    assert sum(e["ph"] == "X" for e in events) == 4 * 16 * 2 + 3 * 2 * 16 + 4
    r = cli("simulate", p, "--graph", g, "--cluster", "hetero-4", "--routing", "relay")
    assert r.code == 0 and "busiest link" in r.out and "t0->v0" in r.out and "utilisation" in r.out


@pytest.mark.parametrize("extra,message", [
    (("--cluster", "v100x4"), "plan.json: invalid plan: stage 0 uses device 'a0', which cluster 'v100x4' does not "
                              "have"),  # the message names the file
    (("--cluster", "hetero-4", "--gantt", "x.jpg"), "x.jpg: the chart is written as .png, .svg or .pdf"),
    (("--cluster", "hetero-4", "--routing", "psychic"), "invalid choice: 'psychic'"),
])
def test_simulate_errors(cli, profiles, tmp_path, extra, message):
    g, p = tmp_path / "vgg.json", tmp_path / "plan.json"
    cli("import", "pipedream", profiles / "vgg16" / "graph.txt", "-o", g)
    cli("plan", g, "--cluster", "hetero-4", "--planner", "uniform", "-o", p)
    r = cli("simulate", p, "--graph", g, *extra)
    assert r.code == 2 and message in r.err and "Traceback" not in r.err


def test_simulate_wants_a_plan(cli, profiles, tmp_path):
    g = tmp_path / "vgg.json"
    cli("import", "pipedream", profiles / "vgg16" / "graph.txt", "-o", g)
    r = cli("simulate", g, "--graph", g, "--cluster", "hetero-4")
    assert r.code == 2 and "plan" in r.err and len(r.err.strip().splitlines()) == 1


@pytest.mark.parametrize("args", [
    ("catalog",), ("info", "cloud-mix"), ("info", "local"),
])
def test_every_command_prints_one_json_object(cli, args):
    r = cli(*args, "--json")
    assert r.code == 0
    assert isinstance(json.loads(r.out), dict)


def test_import_json(cli, profiles, tmp_path):
    r = cli("import", "pipedream", profiles / "alexnet" / "graph.txt", "-o", tmp_path / "a.json", "--json")
    assert r.code == 0 and r.json()["nodes"] == 23 and r.json()["output"].endswith("a.json")


# ---- bad input: one line on stderr, exit status 2, no traceback -------------------------------

def bad(r, *needles):
    assert r.code == 2, (r.code, r.out, r.err)
    assert r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("hetplan: error: ")
    assert "Traceback" not in r.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_unknown_device_type(cli, tmp_path):
    c = write(tmp_path, "c.yaml", "devices:\n  - {id: a0, type: a100}\n")
    bad(cli("info", c), "c.yaml", "devices[0].type", "unknown device type 'a100'", "a100-40gb")


def test_negative_size(cli, tmp_path):
    c = write(tmp_path, "c.yaml", "devices:\n  - {id: c0, type: cpu, memory: -8GiB}\n")
    bad(cli("info", c), "c.yaml", "devices[0].memory", "negative")


def test_unparsable_size(cli, tmp_path):
    c = write(tmp_path, "c.yaml", "devices:\n  - {id: c0, type: cpu, memory: eight gigs}\n")
    bad(cli("info", c), "c.yaml", "devices[0].memory", "cannot read 'eight gigs'", "40GiB")
    c = write(tmp_path, "n.yaml", "devices: [{id: c0, type: cpu}]\nnetwork: {inter_host: {bandwidth: 10Gbit}}\n")
    bad(cli("info", c), "network.inter_host.bandwidth", "unknown bandwidth unit", "10Gbit/s")


def test_duplicate_id(cli, tmp_path):
    c = write(tmp_path, "c.yaml", "devices:\n  - {id: g, type: t4-16gb}\n  - {id: g, type: t4-16gb}\n")
    bad(cli("info", c), "c.yaml", "duplicate device id 'g'")
    g = write(tmp_path, "g.json", json.dumps(graph_doc(nodes=["a", "a"], edges=[])))
    bad(cli("info", g), "g.json", "duplicate node id 'a'")


def graph_doc(nodes, edges):
    return {"kind": "graph", "schema_version": 1, "name": "g", "batch_size": 1, "profiled_on": "v100-16gb",
            "nodes": [{"id": n, "op": "Linear", "fwd_s": {"v100-16gb": 1}, "bwd_s": {"v100-16gb": 1}} for n in nodes],
            "edges": [{"src": a, "dst": b, "bytes": 1} for a, b in edges]}


def test_edge_to_missing_node(cli, tmp_path):
    g = write(tmp_path, "g.json", json.dumps(graph_doc(["a", "b"], [("a", "ghost")])))
    bad(cli("info", g), "g.json", "edge 0 (a -> ghost) names node 'ghost', which does not exist")
    t = write(tmp_path, "graph.txt", TXT + "\tnode2 -- node7\n")
    bad(cli("import", "pipedream", t, "-o", tmp_path / "o.json"), "graph.txt:4", "node 'node7'")


def test_cycle(cli, tmp_path):
    g = write(tmp_path, "g.json", json.dumps(graph_doc(["a", "b", "c"], [("a", "b"), ("b", "c"), ("c", "a")])))
    bad(cli("info", g), "g.json", "not a DAG", "cycle", "->")
    t = write(tmp_path, "graph.txt", TXT + "\tnode2 -- node1\n")
    bad(cli("import", "pipedream", t, "-o", tmp_path / "o.json"), "graph.txt", "cycle node1 -> node2 -> node1")


TXT = ("node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, "
       "activation_size=602112.0, parameter_size=0.0\n"
       "node2 -- ReLU -- forward_compute_time=2.0, backward_compute_time=3.0, activation_size=8.0, parameter_size=0.0\n"
       "\tnode1 -- node2\n")


def test_malformed_graph_txt_line(cli, tmp_path):
    t = write(tmp_path, "graph.txt", TXT.replace("node2 -- ReLU --", "node2 ReLU"))
    bad(cli("import", "pipedream", t, "-o", tmp_path / "o.json"), "graph.txt:2:", "expected 'nodeN -- Layer")


def test_missing_file(cli, tmp_path):
    bad(cli("info", tmp_path / "nothing.json"), "nothing.json: no such file")
    bad(cli("import", "pipedream", tmp_path / "graph.txt", "-o", tmp_path / "o.json"), "graph.txt: no such file")
    bad(cli("plan", tmp_path / "nothing.json", "--cluster", "hetero-4"), "nothing.json: no such file")
    bad(cli("info", "hetero-5"), "neither a file nor a cluster preset", "hetero-4")


def test_other_bad_input(cli, profiles, tmp_path):
    g = tmp_path / "r50.json"
    cli("import", "pipedream", profiles / "resnet50" / "graph.txt", "-o", g)
    bad(cli("plan", g, "--cluster", "hetero-4", "--microbatches", "lots"), "--microbatches: 'lots'")
    bad(cli("plan", g, "--cluster", "hetero-4", "--microbatches", "999"), "999 micro-batches for a batch of 128")
    bad(cli("plan", profiles / "resnet50" / "graph.txt", "--cluster", "hetero-4"), "import it first")
    bad(cli("plan", "hetero-4-plan.json", "--cluster", "hetero-4"), "no such file")
    bad(cli("import", "pipedream", profiles / "gnmt" / "graph.txt", "-o", tmp_path / "o.json"), "--batch-size N")
    broken = write(tmp_path, "b.json", "{not json")
    bad(cli("info", broken), "b.json: not valid JSON")


def test_a_batch_too_large_to_plan_is_refused_at_once(cli, profiles, tmp_path):
    """Planning weighs up to a micro-batch per sample, so a step of 10**15 samples filled memory
    until the kernel stopped it: every flag that sets a step's samples, and a graph of that many,
    are refused in one line before any work."""
    from hetplan.graph import MAX_BATCH_SIZE
    from slowness import limit_s

    g, p = tmp_path / "vgg.json", tmp_path / "plan.json"
    cli("import", "pipedream", profiles / "vgg16" / "graph.txt", "-o", g)
    assert cli("plan", g, "--cluster", "hetero-4", "--planner", "uniform", "-o", p).code == 0
    huge, over, start = str(10**15), str(MAX_BATCH_SIZE + 1), time.perf_counter()
    for flag, args in (("--global-batch", ("plan", g, "--cluster", "hetero-4", "--global-batch", huge)),
                       ("--global-batch", ("compare", g, "--cluster", "hetero-4", "--global-batch", over)),
                       ("--global-batch", ("simulate", p, "--graph", g, "--cluster", "hetero-4", "--global-batch",
                                           huge)),
                       ("--batch-size", ("run", p, "--model", "mlp", "--batch-size", huge, "--dry-run")),
                       ("--batch-size", ("profile", "mlp", "--batch-size", huge, "-o", tmp_path / "mlp.json")),
                       ("--batch-size", ("profile", "opt-350m", "--roofline", "a100-80gb", "--batch-size", over, "-o",
                                         tmp_path / "o.json"))):
        bad(cli(*args), f"{flag}: {args[args.index(flag) + 1]} must be at most {MAX_BATCH_SIZE} samples per step",
            "give a smaller batch")
    bad(cli("import", "pipedream", profiles / "vgg16" / "graph.txt", "--batch-size", huge, "-o", tmp_path / "h.json"),
        f"batch_size is {huge}; it must be at most {MAX_BATCH_SIZE} samples per step")
    assert time.perf_counter() - start < limit_s(5)
    assert not (tmp_path / "mlp.json").exists() and not (tmp_path / "o.json").exists()


def test_a_counted_model_of_no_samples_or_tokens_is_refused(cli, tmp_path):
    """0 is a size given, not a size left out: it was counted as the default (8 samples, 2048 tokens)."""
    out = tmp_path / "o.json"
    bad(cli("profile", "opt-350m", "--roofline", "a100-80gb", "--batch-size", "0", "-o", out),
        "--batch-size: 0 must be a whole number of samples >= 1")
    bad(cli("profile", "opt-350m", "--roofline", "a100-80gb", "--seq-len", "0", "-o", out), "--seq-len: 0 must be >= 1")
    assert not out.exists()


def test_the_installed_command_never_prints_a_traceback(tmp_path):
    """The real entry point, in its own process."""
    c = write(tmp_path, "c.yaml", "devices:\n  - {id: a0, type: a100}\n")
    proc = subprocess.run([sys.executable, "-m", "hetplan", "info", str(c)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("hetplan: error: ") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ---- profile ------------------------------------------------------------------------------------

def test_acceptance_profile_gpt2_tiny(cli, tmp_path):
    out = tmp_path / "g.json"
    r = cli("profile", "gpt2-tiny", "--batch-size", "4", "--seq-len", "64", "--device", "cpu", "-o", out)
    assert r.code == 0, r.err
    info = cli("info", out, "--json").json()
    assert info["kind"] == "graph" and info["nodes"] == 42 and info["batch_size"] == 4
    assert info["skip_edges"] >= 8  # two residual connections in each of the 4 blocks
    assert ["transformer.drop", "transformer.h.0.ln_2"] in info["skip_edge_examples"]
    graph = serde.load(out)
    dtype = graph.profiled_on
    fixed = [(n.fwd_fixed_s[dtype], n.fwd_s[dtype]) for n in graph.nodes if not n.is_input]
    assert all(0 <= f <= t for f, t in fixed)  # the part of each pass that does not shrink with the batch
    assert sum(f for f, _ in fixed) > 0


def test_acceptance_profile_inception_tiny(cli, tmp_path):
    r = cli("profile", "inception-tiny", "--granularity", "block", "--batch-size", "8", "-o", tmp_path / "i.json",
            "--json")
    assert r.code == 0, r.err
    assert r.json()["max_out_degree"] >= 3
    assert cli("info", tmp_path / "i.json", "--json").json()["max_out_degree"] >= 3


def test_profile_check_and_devices(cli, tmp_path):
    r = cli("profile", "mlp", "--device", "cpu:1", "--device", "cpu:2", "--check", "--repeats", "2",
            "-o", tmp_path / "m.json", "--json")
    assert r.code == 0, r.err
    d = r.json()
    assert d["device_types"] == ["cpu-1t", "cpu-2t"]
    assert set(d["check_ratio"]) == {"cpu-1t", "cpu-2t"} and all(0.2 < x < 5 for x in d["check_ratio"].values())
    r = cli("profile", "mlp", "--check", "-o", tmp_path / "m2.json")
    assert r.code == 0 and "sum of node times / measured whole step" in r.out and "comparing medians" in r.out


def test_profile_a_users_model(cli, tmp_path):
    r = cli("profile", "user_models:make", "-o", tmp_path / "u.json", "--json")
    assert r.code == 0, r.err
    assert r.json()["nodes"] == 4  # input, fc1, bn, fc2 (relu and the skip add folded in)


def test_profile_bad_input(cli, tmp_path):
    out = tmp_path / "x.json"
    bad(cli("profile", "gpt3", "-o", out), "unknown model 'gpt3'", "gpt2-tiny", "inception-tiny")
    bad(cli("profile", "user_models:untraceable", "-o", out), "cannot trace the model in module 'gate'",
        "--granularity block")
    bad(cli("profile", "user_models:untraceable", "--granularity", "block", "-o", out), "--block-class Gate")
    assert cli("profile", "user_models:untraceable", "--granularity", "block", "--block-class", "Gate",
               "-o", out).code == 0
    out.unlink()
    bad(cli("profile", "user_models:hungry", "-o", out), "out of memory while profiling", "batch size")
    bad(cli("profile", "mlp", "--device", "tpu:0", "-o", out), "--device 'tpu:0'")
    bad(cli("profile", "gpt2-tiny", "--seq-len", "9999", "-o", out), "--seq-len 9999")
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_profile_on_cuda_without_a_gpu(cli, tmp_path):
    bad(cli("profile", "mlp", "--device", "cuda", "-o", tmp_path / "x.json"), "no CUDA device is available")


def test_compare_rows_and_best(cli, profiles, tmp_path):
    g = tmp_path / "vgg.json"
    cli("import", "pipedream", profiles / "vgg16" / "graph.txt", "-o", g)
    r = cli("compare", g, "--cluster", "hetero-4", "--planners", "single,uniform,balanced-time,dp,exact,local-search",
            "--budget-s", "0.5", "--json")
    assert r.code == 0, r.err
    out = r.json()
    rows = {row["planner"]: row for row in out["rows"]}
    assert list(rows) == ["single", "uniform", "balanced-time", "dp", "exact", "local-search"]
    for name in ("single", "uniform", "balanced-time", "dp", "local-search"):
        row = rows[name]
        for key in ("step_s", "samples_per_s", "usd_per_step", "feasible", "planning_s", "stages"):
            assert row[key] is not None, (name, key)
    assert rows["exact"]["error"].startswith("exact: ") and "too many to search" in rows["exact"]["error"]
    assert out["best"] in ("dp", "local-search")
    assert rows["dp"]["step_s"] <= min(rows[b]["step_s"] for b in ("single", "uniform", "balanced-time"))
    assert rows["local-search"]["step_s"] <= rows["dp"]["step_s"] * (1 + 1e-9)
    assert rows["dp"]["gain_over_best_baseline"] > 0
    r = cli("compare", g, "--cluster", "hetero-4", "--planners", "single,dp")
    assert r.code == 0 and "best: dp" in r.out and "vs baselines" in r.out


def test_plan_cost_objective_and_errors(cli, profiles, tmp_path):
    g, p = tmp_path / "vgg.json", tmp_path / "plan.json"
    cli("import", "pipedream", profiles / "vgg16" / "graph.txt", "-o", g)
    r = cli("plan", g, "--cluster", "cloud-mix", "--objective", "cost", "--min-samples-per-s", "200", "-o", p, "--json")
    assert r.code == 0, r.err
    plan = r.json()
    assert plan["planner"] == "dp" and plan["objective"] == "cost" and plan["predicted"]["samples_per_s"] >= 200
    for args, message in [
        (("--objective", "cost"), "--objective cost needs a throughput floor: add --min-samples-per-s X"),
        (("--objective", "cost", "--min-samples-per-s", "1e9"), "no plan dp found reaches 1e+09 samples/s"),
        (("--planner", "nope"), "invalid choice: 'nope'"),
    ]:
        r = cli("plan", g, "--cluster", "cloud-mix", *args)
        assert r.code == 2 and message in r.err and "Traceback" not in r.err, r.err
    r = cli("compare", g, "--cluster", "cloud-mix", "--planners", "dp,nope")
    assert r.code == 2 and "unknown planner 'nope'" in r.err


def test_plan_says_what_memory_is_missing(cli, tmp_path):
    from hetplan.graph import Edge, Graph, Node
    from hetplan.io import serde

    nodes = tuple(Node(f"n{i}", "Linear", {"v100-16gb": 0.01}, {"v100-16gb": 0.02}, param_bytes=4 * 2**30)
                  for i in range(8))
    g = Graph("huge", nodes, tuple(Edge(f"n{i}", f"n{i + 1}", 8) for i in range(7)), 32, "v100-16gb")
    path = tmp_path / "huge.json"
    serde.dump(g, path)
    r = cli("plan", path, "--cluster", "hetero-4")
    assert r.code == 2 and len(r.err.strip().splitlines()) == 1
    assert "all 4 devices together have 104.0 GiB: add devices" in r.err


def test_run_a_plan_and_compare_with_the_prediction(cli, tmp_path):
    g, p, out = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "run"
    assert cli("profile", "gpt2-tiny", "--batch-size", "8", "--seq-len", "16", "--device", "cpu:1", "-o", g).code == 0
    assert json.loads(g.read_text())["meta"]["seq_len"] == "16"  # what run rebuilds the model with
    assert cli("plan", g, "--cluster", "local", "--planner", "uniform", "--microbatches", "4", "-o", p).code == 0
    ckpt = tmp_path / "ckpt"
    r = cli("run", p, "--model", "gpt2-tiny", "--graph", g, "--steps", "3", "--warmup", "1", "--out", out, "--json",
            "--checkpoint-dir", ckpt, "--checkpoint-every", "3", "--trace")  # a switch, once taken for a path
    assert r.code == 0, r.err
    s = r.json()
    for key in ("measured_step_s", "predicted_step_s", "steps", "loss_first", "loss_last", "relative_error"):
        assert s[key] is not None, key
    assert s["steps"] == 3 and len(s["losses"]) == 3 and 4.5 < s["loss_first"] < 6.5  # ln 256 = 5.5
    assert s["relative_error"] == pytest.approx(s["measured_step_s"] / s["predicted_step_s"] - 1)
    # the run folder keeps what its page shows, and the page itself
    assert s["report"] == str(out / "report.html") and (out / "report.html").stat().st_size > 1e6
    assert "measured (last step of the run)" in (out / "report.html").read_text()  # the traced step, on the page
    assert json.loads((out / "summary.json").read_text())["measured_step_s"] == s["measured_step_s"]
    assert serde.load(out / "graph.json").name == serde.load(g).name
    (tmp_path / "run.json").write_text(r.out)  # `run --json`'s output names its folder: its page is the run's
    page = cli("report", tmp_path / "run.json", "-o", tmp_path / "run.html", "--json")
    assert page.code == 0 and page.json()["of"] == "run", page.err
    # the price of 1,000 samples, measured and predicted: the devices' hourly price x the step
    from hetplan.io.clusters import load_cluster

    hourly = sum(load_cluster("local").device(d).usd_per_hour for d in serde.load(p).devices)
    for key in ("measured", "predicted"):
        assert s[f"{key}_usd_per_1k_samples"] == pytest.approx(1000 * hourly * s[f"{key}_step_s"] / 3600 / 8)
    r = cli("run", p, "--model", "gpt2-tiny", "--graph", g, "--dry-run", "--out", out)
    assert r.code == 0 and "torchrun --nnodes 1 --node-rank 0 --nproc-per-node 2" in r.out
    r = cli("run", p, "--model", "gpt2-tiny", "--graph", g, "--resume", "--out", out)
    assert r.code == 2 and "--resume needs --checkpoint-dir DIR" in r.err
    bad(cli("run", p, "--model", "gpt2-tiny", "--graph", g, "--steps", "3", "--out", out, "--checkpoint-dir", ckpt,
            "--resume"), "the checkpoint is at step 3 already; ask for more steps (--steps 6)")
    for steps in ("0", "-1"):  # no step to take a median of: refused before the workers start
        bad(cli("run", p, "--model", "gpt2-tiny", "--graph", g, "--steps", steps, "--out", out), "run at least 1 step")


@pytest.mark.parametrize("model,flags,warned", [
    ("gpt2-tiny", [], ["the model draws random numbers in training (dropout)", "--no-dropout"]),
    ("gpt2-tiny", ["--no-dropout"], []),
    ("resnet50", [], ["batch norm (", "normalises each micro-batch on its own statistics"]),
    ("user_models:mixtral_aux", [], ["the loss is not a mean over samples: its gradient summed"]),
    ("hf_families:mixtral_router", [], ["the loss is not a mean over samples", "of its largest value"]),
    ("hf_families:mixtral", [], []),
    ("hf_families:opt", [], ["the model draws random numbers in training (dropout)"]),
    ("hf_families:opt", ["--no-dropout"], []),  # its dropout is functional: p is an attribute
    ("hf_families:wav2vec2", ["--no-dropout"], []),
    ("mlp", [], []),
    ("user_models:spatial_dropout", [], ["the model draws random numbers in training (dropout)"]),
    ("user_models:spatial_dropout", ["--no-dropout"], []),
])
def test_run_warns_where_the_pipelined_step_cannot_equal_the_whole_batch(cli, tmp_path, monkeypatch, model, flags,
                                                                         warned):
    from hetplan.plan import Plan, Stage

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    plan = tmp_path / "p.json"
    serde.dump(Plan((Stage(("input",), ("cpu0",)),), 2, "1f1b", "test", cluster="local"), plan)
    r = cli("run", plan, "--model", model, "--batch-size", "4", "--seq-len", "16", "--dry-run", "--json",
            "--out", tmp_path / "run", *flags)
    assert r.code == 0, r.err
    warnings = [line for line in r.err.splitlines() if line.startswith("hetplan: warning: ")]
    assert len(warnings) == (1 if warned else 0), r.err
    assert all(w in r.err for w in warned)


def test_run_refuses_text_data_for_a_model_that_is_not_a_language_model(cli, tmp_path):
    from hetplan.io import serde
    from hetplan.plan import Plan, Stage

    plan = tmp_path / "p.json"
    serde.dump(Plan((Stage(("input",), ("cpu0",)),), 1, "1f1b", "test", cluster="local"), plan)
    r = cli("run", plan, "--model", "mlp", "--data", "text", "--batch-size", "8")
    assert r.code == 2
    assert r.err.strip() == "hetplan: error: --data text is for language models; mlp takes --data synthetic"


def test_outputs_never_replace_devices_fifos_directories_links_or_inputs(cli, tmp_path, profiles):
    """Writing an output must never destroy what is there: run as root, an atomic write over
    `-o /dev/null` would replace the device with a regular file, and so FIFOs and symbolic links;
    `-o` equal to the input graph must be refused, not overwrite it and exit 0."""
    import os
    import stat

    graph = tmp_path / "g.json"
    assert cli("import", "pipedream", profiles / "vgg16" / "graph.txt", "-o", graph).code == 0
    before = graph.read_bytes()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    device = tmp_path / "null"  # a device of the test's own: a regression must not clobber /dev/null
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:  # not root: the system's, which an unprivileged run cannot replace
        device = "/dev/null"
    for out, why in ((device, "not a regular file"), (fifo, "not a regular file"), (tmp_path, "a directory"),
                     (link, "symbolic link"), (graph, "also an input of this command")):
        bad(cli("plan", graph, "--cluster", "hetero-4", "--planner", "single", "-o", out), why)
    bad(cli("simulate", tmp_path / "nope.json", "--graph", graph, "--cluster", "hetero-4", "--gantt", graph),
        "also an input of this command")
    assert stat.S_ISCHR(os.lstat(device).st_mode) and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert link.is_symlink() and not (tmp_path / "elsewhere.json").exists() and graph.read_bytes() == before
    assert cli("plan", graph, "--cluster", "hetero-4", "--planner", "single", "-o", tmp_path / "p.json").code == 0


def test_catalog_lists_the_zoo_and_help_says_run(cli):
    r = cli("catalog")
    assert r.code == 0 and "models (the zoo" in r.out and "gpt2-tiny" in r.out and "inception-tiny" in r.out
    assert "zero-bubble (" in r.out and "ScheduleInterleavedZeroBubble" in r.out
    assert "(later)" not in cli("--help").out and "hetplan run plan.json" in cli("--help").out


def test_planning_on_a_type_that_was_not_profiled_says_so(cli, tmp_path):
    """A graph profiled on cpu-2t planned on `local` (cpu-1t workers) was projected silently."""
    from hetplan.graph import Edge, Graph, Node

    g = tmp_path / "g.json"
    nodes = tuple(Node(f"n{i}", "linear", {"cpu-2t": 1e-3}, {"cpu-2t": 2e-3}, flops=1e6) for i in range(3))
    serde.dump(Graph("two-threads", nodes, (Edge("n0", "n1", 64), Edge("n1", "n2", 64)), 8, "cpu-2t"), g)
    r = cli("plan", g, "--cluster", "local", "-o", tmp_path / "p.json")
    assert r.code == 0
    assert ("hetplan: note: graph 'two-threads' has no times measured on cpu-1t (from cpu-2t): they are projected "
            "by the roofline model") in r.err
    two = tmp_path / "two.yaml"
    two.write_text("devices: [{id: c, type: cpu, threads: 2}]\n")
    r = cli("plan", g, "--cluster", two, "-o", tmp_path / "q.json")
    assert r.code == 0, r.err
    assert "note" not in r.err


def test_planning_a_counted_graph_says_its_times_rest_on_one_gpus_fraction(cli, tmp_path):
    """A counted chain's 16-bit times assume every GPU reaches the fraction one H200 reached: the
    plan says so, with the fraction and the types; a profiled graph says nothing of it."""
    g = tmp_path / "opt.json"
    r = cli("profile", "opt-350m", "--roofline", "a100-40gb", "--roofline", "v100-16gb", "--precision", "bf16",
            "--batch-size", "8", "--seq-len", "512", "-o", g)
    assert r.code == 0, r.err
    r = cli("plan", g, "--cluster", "a100+v100-8", "-o", tmp_path / "p.json")
    assert r.code == 0, r.err
    assert "graph 'opt-350m' is counted, not measured: its bf16 times assume every GPU (a100-40gb, v100-32gb) " \
           "reaches 0.43 of its bf16 peak, as the counted blocks did on one H200" in r.err


def test_a_prediction_for_real_workers_says_when_the_cluster_is_not_calibrated(cli, tmp_path):
    from dataclasses import replace

    from hetplan.cluster import Calibration
    from hetplan.graph import Edge, Graph, Node
    from hetplan.io.clusters import load_cluster

    g = tmp_path / "g.json"
    nodes = tuple(Node(f"n{i}", "linear", {"cpu-1t": 1e-3}, {"cpu-1t": 2e-3}) for i in range(3))
    serde.dump(Graph("g", nodes, (Edge("n0", "n1", 64), Edge("n1", "n2", 64)), 8, "cpu-1t"), g)
    r = cli("plan", g, "--cluster", "local", "-o", tmp_path / "p.json")
    assert r.code == 0 and "hetplan: note: cluster 'local' is not calibrated" in r.err
    assert "hetplan calibrate --cluster local -o cal.json" in r.err
    cal = tmp_path / "cal.json"
    serde.dump(replace(load_cluster("local"), calibration=Calibration("test")), cal)
    for args in (("plan", g, "--cluster", cal, "-o", tmp_path / "q.json"),
                 ("simulate", tmp_path / "p.json", "--graph", g, "--cluster", cal)):
        r = cli(*args)
        assert r.code == 0 and "note" not in r.err, r.err
    r = cli("simulate", tmp_path / "p.json", "--graph", g, "--cluster", "local")
    assert r.code == 0 and "not calibrated" in r.err


def test_a_plan_file_that_places_a_node_twice_is_refused(cli, tmp_path):
    """`info` of such a plan said nothing wrong (exit 0); every command that reads one refuses it."""
    plan = {"kind": "plan", "schema_version": 1, "microbatches": 2, "schedule": "1f1b", "planner": "hand",
            "stages": [{"nodes": ["a", "b"], "devices": ["v0"]}, {"nodes": ["c", "a"], "devices": ["v1"]}]}
    path = write(tmp_path, "twice.json", json.dumps(plan))
    bad(cli("info", path), "twice.json: node 'a' is in stage 0 and in stage 1; each node goes in one stage")


def test_run_finds_the_cluster_file_the_plan_was_made_on(cli, tmp_path, monkeypatch):
    """A plan made with `--cluster c3.yaml` runs without naming it again (it said "'c3' is neither
    a cluster file nor a preset"); a file that is gone is said so; a batch below 1 is refused."""
    from hetplan.cli import running

    monkeypatch.chdir(tmp_path)
    write(tmp_path, "c3.yaml", "name: c3\ndevices:\n  - {id: c, type: cpu, threads: 1, binding: cpu, count: 2}\n")
    nodes = [{"id": n, "op": "Linear", "fwd_s": {"cpu-1t": 0.01}, "bwd_s": {"cpu-1t": 0.02}} for n in "ab"]
    graph = {"kind": "graph", "schema_version": 1, "name": "g", "nodes": nodes,
             "edges": [{"src": "a", "dst": "b", "bytes": 8}], "batch_size": 4, "profiled_on": "cpu-1t"}
    write(tmp_path, "g.json", json.dumps(graph))
    assert cli("plan", "g.json", "--cluster", "c3.yaml", "--planner", "uniform", "-o", "p.json").code == 0
    plan = serde.load(tmp_path / "p.json", expect="plan")
    assert running.plan_cluster_ref(plan) == str(tmp_path / "c3.yaml")
    bad(cli("run", "p.json", "--model", "gpt2-tiny", "--batch-size", "-1"), "--batch-size: -1 must be")
    bad(cli("run", "p.json", "--model", "gpt2-tiny", "--batch-size", "0"), "--batch-size: 0 must be")
    for every, folder in (("0", ["--checkpoint-dir", "ck"]), ("-2", ["--checkpoint-dir", "ck"]), ("3", [])):
        bad(cli("run", "p.json", "--model", "gpt2-tiny", "--checkpoint-every", every, *folder),
            f"--checkpoint-every {every}: K must be >= 1 and needs --checkpoint-dir DIR")
    (tmp_path / "c3.yaml").unlink()
    bad(cli("run", "p.json", "--model", "gpt2-tiny"), "c3.yaml, which is not there now; pass --cluster C")


def test_a_factory_that_raises_or_takes_no_batch_size_gets_one_line(cli, tmp_path):
    """Both printed a traceback and exited 1."""
    out = tmp_path / "u.json"
    bad(cli("profile", "user_models:broken", "-o", out), "user_models:broken: the factory raised ValueError: "
        "no such checkpoint (at user_models.py:")
    bad(cli("profile", "user_models:sizeless", "--batch-size", "4", "-o", out),
        "the factory takes no batch_size; give it that keyword parameter, or leave out --batch-size")
    assert cli("profile", "user_models:sizeless", "-o", out).code == 0  # no size given: called as it is


def test_a_speech_model_with_a_ctc_loss_runs_in_stages_of_its_encoder_layers(cli, tmp_path, monkeypatch):
    """Wav2Vec2 with CTC: transformers' loss picks the labels out of their padding (a size known
    only from the data), which no tracer takes; hetplan computes the same loss traceably
    (`hetplan.zoo.losses`), so the encoder's layers are the blocks, the loss is on the last stage,
    and a pipeline of them runs."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    graph, plan = tmp_path / "w.json", tmp_path / "p.json"
    assert cli("profile", "user_models:wav2vec2_ctc", "--batch-size", "4", "--granularity", "block",
               "-o", graph).code == 0
    nodes = [n["id"] for n in json.loads(graph.read_text())["nodes"]]
    assert "wav2vec2.encoder.layers.0" in nodes and "wav2vec2.encoder.layers.1" in nodes and nodes[-1] == "lm_head"
    assert cli("plan", graph, "--cluster", "local", "--planner", "uniform", "-o", plan).code == 0
    assert len(json.loads(plan.read_text())["stages"]) == 2
    r = cli("run", plan, "--model", "user_models:wav2vec2_ctc", "--graph", graph, "--steps", "1", "--warmup", "0",
            "--out", tmp_path / "run", "--json")
    assert r.code == 0, r.err
    assert math.isfinite(json.loads(r.out)["losses"][0])


def _fill_the_disk(path, *args, **kwargs):
    """A writer on a disk that fills up: some bytes, then ENOSPC."""
    import errno

    with open(path, "wb") as f:
        f.write(b"\x89PNG half")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_leaves_neither_half_a_file_nor_its_temporary(cli, profiles, tmp_path, monkeypatch):
    """`simulate --gantt` left a 0-byte PNG and `report -o` a `.p.html.tmp` on a full disk."""
    from matplotlib.figure import Figure

    from hetplan.errors import InputError
    from hetplan.io.serde import atomic_write

    page = tmp_path / "p.html"
    with pytest.raises(InputError, match=r"p.html: cannot write the page \(No space left on device\)"):
        atomic_write(page, _fill_the_disk, "the page")
    assert list(tmp_path.iterdir()) == []
    page.write_text("the old page")
    with pytest.raises(InputError):
        atomic_write(page, _fill_the_disk, "the page")
    assert page.read_text() == "the old page" and sorted(p.name for p in tmp_path.iterdir()) == ["p.html"]
    g, p = tmp_path / "r50.json", tmp_path / "plan.json"
    cli("import", "pipedream", profiles / "resnet50" / "graph.txt", "-o", g)
    cli("plan", g, "--cluster", "hetero-4", "--planner", "uniform", "-o", p)
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: _fill_the_disk(path))
    bad(cli("simulate", p, "--graph", g, "--cluster", "hetero-4", "--gantt", tmp_path / "step.png"),
        "step.png: cannot write the chart (No space left on device)")
    assert not (tmp_path / "step.png").exists() and not (tmp_path / ".step.png.tmp").exists()


def test_progress_shows_the_time_left_on_a_terminal_only_and_never_under_json(monkeypatch):
    """profile, calibrate, compare, plan and run's start show a bar with the time spent and left
    on stderr; piped or under --json, nothing (an issue: 15 silent minutes of `profile --check`)."""
    import argparse

    from rich.progress import TimeRemainingColumn

    from hetplan.cli._shared import _progress_bar

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    assert _progress_bar(argparse.Namespace(json=False)) is None  # pytest's stderr is not a terminal
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert _progress_bar(argparse.Namespace(json=True)) is None
    bar = _progress_bar(argparse.Namespace(json=False))
    assert bar is not None and any(isinstance(c, TimeRemainingColumn) for c in bar.columns)


def test_the_profiler_tells_how_much_of_the_profile_is_done():
    from hetplan.profile import profile_step
    from hetplan.zoo import load_model

    zm = load_model("mlp", batch_size=8)
    told = []
    profile_step(zm.step, zm.batch, devices=["cpu:1", "cpu:2"], repeats=2, fixed=False,
                 progress=lambda done, what: told.append((done, what)))
    shares = [d for d, _ in told]
    assert shares == sorted(shares) and shares[0] == 0 and 0.5 < shares[-1] < 1, shares
    assert {w for _, w in told} == {"timing on cpu:1", "timing on cpu:2"}


@pytest.mark.parametrize("calibrated", [False, True])
def test_demo_says_when_its_predictions_are_not_calibrated(cli, tmp_path, monkeypatch, calibrated):
    """A user's first impression was +177% (uncalibrated, and not said); `make demo` calibrates
    `local` first and passes the file, and without it the table is followed by what to do."""
    import hetplan.demo

    asked = []

    def fake(out, steps, budget_s, say, cluster_ref):
        asked.append(cluster_ref)
        run = {"label": "chosen: dp", "stages": 2, "devices": 2, "microbatches": 4, "predicted_step_s": 0.1,
               "measured_step_s": 0.3, "error": 2.0}
        return {"model": "gpt2-tiny", "cluster": "local", "chosen": "dp", "calibrated": calibrated, "runs": [run],
                "speedup_over_best_baseline": 1.2}

    monkeypatch.setattr(hetplan.demo, "run_demo", fake)
    r = cli("demo", "--out", tmp_path / "d", *(["--cluster", "cal.json"] if calibrated else []))
    assert r.code == 0 and asked == ["cal.json" if calibrated else "local"]
    said = "These predictions are not calibrated" in r.out and "hetplan calibrate --cluster local -o cal.json" in r.out
    assert said != calibrated, r.out
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assert "calibrate --cluster local -o $(OUT)/local-calibrated.json" in makefile


def test_a_milp_plan_is_written_and_read_back(cli, profiles, tmp_path):
    """A milp plan's report (`meta.milp`) is plain JSON: the solver's numpy values (a numpy bool
    is not JSON serializable) are turned into Python's before the plan is written."""
    graph, plan = tmp_path / "r50.json", tmp_path / "p.json"
    assert cli("import", "pipedream", profiles / "resnet50" / "graph.txt", "-o", graph).code == 0
    r = cli("plan", graph, "--cluster", "v100x8", "--planner", "milp", "--objective", "throughput",
            "--max-replicas", "1", "-o", plan)
    assert r.code == 0, r.err
    meta = json.loads(plan.read_text())["meta"]["milp"]
    assert meta and all(isinstance(v, str | int | float | bool | list | dict | type(None)) for v in meta.values())
    assert cli("info", plan).code == 0


def test_a_refused_run_leaves_no_folder_and_a_model_that_cannot_run_is_one_line(cli, tmp_path, monkeypatch):
    """The run folder was made, then the checkpoint folder refused: the run folder stayed. And a
    batch the model cannot take ended `run --dry-run` in a traceback (the check of the loss runs
    the model before any worker starts)."""
    from hetplan.plan import Plan, Stage

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    plan = tmp_path / "p.json"
    serde.dump(Plan((Stage(("input",), ("cpu0",)),), 2, "1f1b", "test", cluster="local"), plan)
    (tmp_path / "afile").write_text("x")
    bad(cli("run", plan, "--model", "mlp", "--batch-size", "4", "--out", tmp_path / "new" / "a", "--checkpoint-dir",
            tmp_path / "afile" / "ck", "--dry-run"), "afile/ck: cannot write checkpoints there")
    assert not (tmp_path / "new").exists()
    bad(cli("run", plan, "--model", "user_models:batch_of_the_wrong_shape", "--batch-size", "4", "--dry-run",
            "--out", tmp_path / "run"), "the model does not run on its example batch (RuntimeError: mat1 and mat2")
    assert not (tmp_path / "run").exists()


def test_a_run_folder_made_for_torchrun_holds_nothing_of_an_earlier_run(tmp_path):
    """An earlier run's graph.json made rank 0 predict with the wrong graph and fail after a good run."""
    from hetplan.io.clusters import load_cluster
    from hetplan.plan import Plan, Stage
    from hetplan.runtime.launch import run_spec
    from hetplan.runtime.run import write_for_elsewhere

    for name in ("graph.json", "summary.json", "gantt.png"):
        (tmp_path / name).write_text("an earlier run's")
    cluster = load_cluster("local")
    spec = run_spec(Plan((Stage(("input",), ("cpu0",)),), 1, "1f1b", "test"), cluster, "mlp",
                    RunSettings(batch_size=4, seq_len=None, granularity="layer", out_dir=tmp_path))
    write_for_elsewhere(spec, None, cluster)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "cluster.json", "run.json"]  # (the folder's lock)
