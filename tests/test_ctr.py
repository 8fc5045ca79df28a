"""The CTR workload: synthetic Criteo click logs, their parser (a torch custom op) and `ctr-dnn`."""

import math
import re
from collections import Counter

import numpy as np
import pytest
import torch

from hetplan.errors import HetplanError
from hetplan.profile import profile_step
from hetplan.zoo import criteo
from hetplan.zoo.criteo import (
    DEFAULT_TABLES,
    LINE_BYTES,
    CriteoParser,
    click_batch,
    click_log,
    decode_lines,
    encode_lines,
    parse_lines,
    write_click_log,
)
from hetplan.zoo.models import ctr_dnn

SMALL = (2000,) * 4 + (100,) * 22  # small tables: fast to build and to learn
HEX = re.compile(rb"[0-9a-f]{8}")


@pytest.fixture
def small_log(tmp_path):
    return write_click_log(tmp_path / "small.tsv", 400, 5, SMALL).read_bytes().splitlines()


def test_the_log_is_deterministic_and_in_the_criteo_format(tmp_path):
    a = write_click_log(tmp_path / "a.tsv", 500, 7, SMALL).read_bytes()
    assert write_click_log(tmp_path / "b.tsv", 500, 7, SMALL).read_bytes() == a
    assert write_click_log(tmp_path / "c.tsv", 500, 8, SMALL).read_bytes() != a
    assert not list(tmp_path.glob("*.tmp"))  # the temporary files were renamed
    lines = a.splitlines()
    assert len(lines) == 500 and a.endswith(b"\n")
    fields = [line.split(b"\t") for line in lines]
    assert {len(f) for f in fields} == {40}
    assert {f[0] for f in fields} == {b"0", b"1"}
    dense = [v for f in fields for v in f[1:14]]
    assert all(v == b"" or v.isdigit() for v in dense)
    assert 0.02 < dense.count(b"") / len(dense) < 0.4  # missing values, as in Criteo
    assert all(HEX.fullmatch(v) for f in fields for v in f[14:])
    ctr = sum(f[0] == b"1" for f in fields) / len(fields)
    assert 0.01 <= ctr <= 0.6, ctr
    assert max(map(len, lines)) <= LINE_BYTES


def test_ids_are_zipf_skewed(tmp_path):
    """A 1M-row table: the hottest id takes ~12% of the samples (uniform: 0.0001%), and the
    10th hottest about 10^1.1 times less."""
    rows = 20_000
    lines = write_click_log(tmp_path / "z.tsv", rows, 1, DEFAULT_TABLES).read_bytes().splitlines()
    big = DEFAULT_TABLES.index(1_000_000)
    counts = [n for _, n in Counter(line.split(b"\t")[14 + big] for line in lines).most_common()]
    assert counts[0] / rows > 0.05
    assert counts[0] > 10_000 * rows / 1_000_000
    assert 5 < counts[0] / counts[9] < 30, counts[:10]
    assert len(counts) > 1000  # and a long tail of rare ids


def _reference(lines):
    """The values of the lines, computed here without the parser."""
    fields = [line.decode().split("\t") for line in lines]
    labels = np.array([float(f[0]) for f in fields], dtype=np.float32)
    dense = np.array([[math.log1p(int(v)) if v else 0.0 for v in f[1:14]] for f in fields], dtype=np.float32)
    cats = np.array([[int(v, 16) for v in f[14:]] for f in fields], dtype=np.int64)
    return labels, dense, cats


def test_the_parser_round_trips(small_log):
    labels, dense, cats = parse_lines(small_log)
    want = _reference(small_log)
    assert labels.dtype == np.float32 and dense.dtype == np.float32 and cats.dtype == np.int64
    assert dense.shape == (400, 13) and cats.shape == (400, 26)
    np.testing.assert_array_equal(labels, want[0])
    np.testing.assert_allclose(dense, want[1], rtol=1e-6)
    np.testing.assert_array_equal(cats, want[2])
    assert cats.max() >= 2**31  # the ids are 32-bit hashes, not table rows
    for got, ref in zip(parse_lines([line.decode() + "\n" for line in small_log]), (labels, dense, cats), strict=True):
        np.testing.assert_array_equal(got, ref)  # str lines with their newline parse the same


def test_the_custom_op_is_the_parser(small_log):
    encoded = encode_lines(small_log)
    assert encoded.dtype == torch.uint8 and encoded.shape == (400, LINE_BYTES)
    assert decode_lines(encoded) == small_log
    out = torch.ops.hetplan.parse_criteo(encoded)
    for got, ref in zip(out, parse_lines(small_log), strict=True):
        assert torch.equal(got, torch.from_numpy(ref))
    labels, dense, columns = CriteoParser(columns=True)(encoded)
    assert len(columns) == 26 and all(c.is_contiguous() and c.shape == (400,) for c in columns)
    assert torch.equal(torch.stack(columns, 1), out[2]) and torch.equal(labels, out[0])


def test_bad_lines_are_refused(small_log):
    with pytest.raises(HetplanError, match=f"line 2 is {LINE_BYTES + 1} bytes, longer than the {LINE_BYTES} bytes"):
        encode_lines([small_log[0], b"1" * (LINE_BYTES + 1)])
    with pytest.raises(HetplanError, match="line 1: 39 tab-separated fields, the format has 40"):
        parse_lines([small_log[0].rsplit(b"\t", 1)[0]])
    bad_hex = small_log[1].rsplit(b"\t", 1)[0] + b"\tzzzzzzzz"
    with pytest.raises(HetplanError, match="line 2, field C26: b'zzzzzzzz' is not a hexadecimal id"):
        parse_lines([small_log[0], bad_hex])
    with pytest.raises(HetplanError, match="label b'2', must be 0 or 1"):
        parse_lines([b"2" + small_log[0][1:]])
    with pytest.raises(HetplanError, match="give 26 table sizes"):
        write_click_log("unused.tsv", 10, 0, (10,) * 25)
    with pytest.raises(HetplanError, match="uint8 tensor"):
        criteo.decode_lines(torch.zeros(2, 8))


def test_a_reimport_keeps_the_registered_op(small_log):
    import importlib

    lines = encode_lines(small_log[:3])
    before = torch.ops.hetplan.parse_criteo.default
    traced = torch.export.export(CriteoParser(), (lines,), strict=False).module()
    importlib.reload(criteo)  # registers nothing: the op is there
    assert torch.ops.hetplan.parse_criteo.default is before and criteo.PARSE_CRITEO is before
    again = torch.export.export(criteo.CriteoParser(), (lines,), strict=False).module()  # the fake kernel is kept
    for got, ref in zip(again(lines), traced(lines), strict=True):
        assert torch.equal(got, ref)


def test_batches_take_the_log_in_order_and_wrap_around(tmp_path, monkeypatch):
    log = click_log(3, SMALL, rows=100, cache=tmp_path)
    text = log.text.read_bytes().splitlines()
    assert decode_lines(log.batch(64, 0)["lines"]) == text[:64]
    assert decode_lines(log.batch(64, 1)["lines"]) == text[64:] + text[:28]
    monkeypatch.setenv("HETPLAN_CACHE", str(tmp_path / "cache"))
    batch = click_batch(8, 2, 3, SMALL)
    (made,) = (tmp_path / "cache").glob("*.tsv")
    assert f"{criteo.LOG_ROWS}r-seed3" in made.name
    assert decode_lines(batch["lines"]) == made.read_bytes().splitlines()[16:24]


def test_the_model_learns_the_clicks(tmp_path):
    """Some 200 SGD steps on 14,336 samples beat the best constant guess on 2,048 held-out ones
    (which learning the click rate alone cannot): the labels depend on the features."""
    log = click_log(3, SMALL, rows=16_384, cache=tmp_path)
    held_out = log.batch(2048, 7)
    rate = float(parse_lines(decode_lines(held_out["lines"]))[0].mean())
    constant = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    step = ctr_dnn(64, 0, 0, tables=SMALL, hidden=(64, 32)).step
    opt = torch.optim.SGD(step.parameters(), lr=0.1)  # SGD takes the tables' sparse gradients
    for i in range(14_336 // 64):
        opt.zero_grad()
        step(**log.batch(64, i)).backward()
        opt.step()
    with torch.no_grad():
        loss = step(**held_out).item()
    assert loss < constant - 0.02, (loss, constant)


def test_sparse_and_dense_tables_give_the_same_loss_and_gradients():
    runs = {}
    for sparse in (True, False):
        zm = ctr_dnn(32, 0, 4, tables=SMALL, hidden=(64, 32), sparse=sparse)
        loss = zm.step(**zm.batch)
        loss.backward()
        runs[sparse] = loss, dict(zm.step.named_parameters())
    (loss_s, params_s), (loss_d, params_d) = runs[True], runs[False]
    torch.testing.assert_close(loss_s, loss_d, rtol=1e-5, atol=1e-5)
    assert params_s.keys() == params_d.keys()
    tables = [n for n in params_s if ".tables." in n]
    assert len(tables) == 26
    for name in params_s:
        grad_s, grad_d = params_s[name].grad, params_d[name].grad
        assert grad_s.is_sparse == (name in tables) and not grad_d.is_sparse
        torch.testing.assert_close(grad_s.to_dense(), grad_d, rtol=1e-5, atol=1e-5)
    assert any(params_s[n].grad.coalesce().values().abs().sum() > 0 for n in tables)


def test_ctr_dnn_profiles_with_a_parser_node():
    zm = ctr_dnn(16, 0, 0, tables=SMALL, hidden=(64, 32))
    graph = profile_step(zm.step, zm.batch, name="ctr-dnn", repeats=1, fixed=False).graph
    parser = graph.node("parser")
    assert parser.op == "CriteoParser" and parser.param_bytes == 0
    assert all(t > 0 for t in parser.fwd_s.values())
    bags = [n for n in graph.nodes if n.op == "EmbeddingBag"]
    assert len(bags) == 26
    assert graph.node("shards.0.tables.C1").param_bytes == 2000 * 16 * 4
    assert sorted(n.param_bytes for n in bags) == sorted(rows * 16 * 4 for rows in SMALL)
    assert all(graph.edge_bytes[("parser", n.id)] == 16 * 8 for n in bags)  # each table reads its ids only
    assert graph.edge_bytes[("input", "parser")] == 16 * LINE_BYTES
    assert {"mlp.0", "mlp.4"} <= {n.id for n in graph.nodes}
    block = profile_step(zm.step, zm.batch, granularity="block", block_classes=zm.block_classes, repeats=1,
                         fixed=False).graph
    # the four 2,000-row tables alone, the 22 small ones in shards of at most 2,000 rows
    assert [n.op for n in block.nodes] == ["Input", "CriteoParser", *["EmbeddingShard"] * 6, "MLP"]


def test_the_profile_marks_the_parser_as_host_work_and_counts_the_looked_up_rows():
    """The parser runs on the host whatever the stage's device; a table's optimizer updates the
    rows the batch looked up (its sparse gradient's distinct rows), not the whole table, and its
    replicas exchange those rows and their indices (`sparse_rows`)."""
    zm = ctr_dnn(16, 0, 0, tables=SMALL, hidden=(64, 32))
    graph = profile_step(zm.step, zm.batch, name="ctr-dnn", repeats=1, fixed=False).graph
    assert graph.node("parser").runs_on_host
    assert not any(n.runs_on_host for n in graph.nodes if n.id != "parser")
    _, _, ids = parse_lines(decode_lines(zm.batch["lines"]))
    bags = {n.id.rsplit(".", 1)[-1]: n for n in graph.nodes if n.op == "EmbeddingBag"}
    for field in range(26):
        node = bags[f"C{field + 1}"]
        rows = len(np.unique(ids[:, field] % SMALL[field]))  # hashing trick
        assert node.updated_bytes == rows * 16 * 4 and node.sparse_rows == rows
        assert node.optimizer_bytes == node.updated_bytes < node.param_bytes
    mlp = graph.node("mlp.0")
    assert mlp.updated_bytes is None and mlp.optimizer_bytes == mlp.param_bytes and mlp.sparse_rows == 0
    # the optimizer step of every node with parameters, measured: SparseAdam on a table's rows
    assert all(n.opt_s[t] > 0 for n in graph.nodes if n.param_bytes for t in n.fwd_s)
    assert not any(n.opt_s for n in graph.nodes if not n.param_bytes)
