import math
import re

import pytest

from hetplan.errors import InputError
from hetplan.io.pipedream import import_pipedream, parse_pipedream

EXPECTED = {"vgg16": (41, 41), "alexnet": (23, 23), "resnet18": (71, 79), "resnet50": (177, 193),
            "squeezenet1_0": (68, 76), "gnmt": (48, 58)}


def file_sums(path):
    """Independent reading of the file: sums of forward and backward times in milliseconds."""
    fwd = bwd = 0.0
    for line in path.read_text().splitlines():
        m = re.search(r"forward_compute_time=([\d.]+), backward_compute_time=([\d.]+)", line)
        if m:
            fwd += float(m[1])
            bwd += float(m[2])
    return fwd, bwd


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_every_shared_profile_imports(profiles, model):
    path = profiles / model / "graph.txt"
    g = import_pipedream(path, batch_size=64 if model == "gnmt" else None)
    assert (len(g.nodes), len(g.edges)) == EXPECTED[model]
    assert g.name == model and g.profiled_on == "v100-16gb"
    fwd_ms, bwd_ms = file_sums(path)
    assert math.isclose(g.fwd_s_total(), fwd_ms / 1e3, rel_tol=1e-12)
    assert math.isclose(g.bwd_s_total(), bwd_ms / 1e3, rel_tol=1e-12)
    assert any(n.is_input for n in g.nodes)


def test_resnet50_details(profiles):
    g = import_pipedream(profiles / "resnet50" / "graph.txt")
    assert g.batch_size == 128  # 77070336 input bytes = 128 x 3 x 224 x 224 x 4
    inp = g.node("node1")
    assert inp.is_input and inp.op == "Input" and inp.fwd_s["v100-16gb"] == pytest.approx(18.962e-3)
    conv = g.node("node76")
    assert conv.op == "Conv2d" and conv.param_bytes == 262144 and conv.out_bytes == 205520896
    assert g.topo_order[0] == "node1"
    # Residual connections: some node feeds two others (the block and the shortcut).
    assert max(len(g.successors(n.id)) for n in g.nodes) == 2
    edge = next(e for e in g.edges if e.src == "node76")
    assert edge.bytes == 205520896


def test_gnmt_list_sizes_add_up_and_batch_is_required(profiles):
    path = profiles / "gnmt" / "graph.txt"
    with pytest.raises(InputError, match="cannot tell the batch size .* --batch-size N"):
        import_pipedream(path)
    g = import_pipedream(path, batch_size=64)
    assert g.node("node7").out_bytes == 6291456 + 131072 + 131072


GOOD = ("node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, "
       "activation_size=602112.0, parameter_size=0.0\n"
        "node2 -- Linear(in=1) -- forward_compute_time=2.0, backward_compute_time=3.0, "
        "activation_size=8.0, parameter_size=16.0\n"
        "\tnode1 -- node2\n")


def test_parse_small_text():
    g = parse_pipedream(GOOD, device_type="t4-16gb")
    assert g.batch_size == 1 and g.profiled_on == "t4-16gb"
    assert g.node("node2").fwd_s == {"t4-16gb": 0.002}


@pytest.mark.parametrize("text,match", [
    (GOOD + "garbage here\n", r"graph.txt:4: expected 'nodeN -- Layer"),
    (GOOD.replace("forward_compute_time=2.0", "forward_compute_time=fast"),
     r"graph.txt:2: forward_compute_time is 'fast'"),
    (GOOD.replace(", parameter_size=16.0", ""), "graph.txt:2: missing parameter_size"),
    (GOOD + "\tnode2 -- node9\n", r"graph.txt:4: edge node2 -- node9 names node 'node9'"),
    (GOOD + "\tnode2 -- node1\n", "not a DAG: it has the cycle"),
    (GOOD + GOOD.splitlines()[1] + "\n", "graph.txt:4: node 'node2' is already defined on line 2"),
    (GOOD.replace("forward_compute_time=2.0", "forward_compute_time=-2.0"), r"graph.txt:2: node 'node2': fwd_s"),
    ("", "no node lines"),
])
def test_malformed_files(text, match):
    with pytest.raises(InputError, match=match) as err:
        parse_pipedream(text, source="graph.txt")
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        import_pipedream(tmp_path / "graph.txt")


def test_input_time_zero_is_pipedreams_optimizer(profiles):
    """PipeDream's optimizer zeroes the Input nodes' times (optimizer_graph_hierarchical.py):
    `--input-time zero` does the same; `keep` counts loading as work."""
    path = profiles / "resnet50" / "graph.txt"
    kept = import_pipedream(path)
    zeroed = import_pipedream(path, input_time="zero")
    inp = zeroed.node("node1")
    assert inp.is_input and inp.fwd_s["v100-16gb"] == 0.0 and inp.act_bytes == 0
    assert zeroed.fwd_s_total() == pytest.approx(kept.fwd_s_total() - 18.962e-3, rel=1e-12)
    assert zeroed.bwd_s_total() == kept.bwd_s_total()
    with pytest.raises(InputError, match="--input-time: 'drop' is unknown"):
        import_pipedream(path, input_time="drop")


@pytest.mark.parametrize(("side", "batch"), [(224, 256), (299, 32), (227, 8), (256, 16)])
def test_batch_size_from_any_image_input(side, batch):
    text = GOOD.replace("activation_size=602112.0", f"activation_size={batch * 3 * side * side * 4}.0")
    assert parse_pipedream(text).batch_size == batch
