import copy

import pytest
import torch
from torch import nn

from hetplan.errors import HetplanError
from hetplan.pieces.split import find_block_classes, split_step
from hetplan.profile import profile, profile_step
from hetplan.profile.devices import cuda_type_name, parse_device, usable_cores
from hetplan.zoo import load_model


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name,kw,granularity", [
    ("gpt2-tiny", {"batch_size": 2, "seq_len": 16}, "layer"),
    ("gpt2-tiny", {"batch_size": 2, "seq_len": 16}, "block"),
    ("llama-tiny", {"batch_size": 2, "seq_len": 16}, "layer"),
    ("inception-tiny", {"batch_size": 4}, "layer"),
    ("inception-tiny", {"batch_size": 4}, "block"),
    ("mlp", {"batch_size": 4}, "layer"),
])
def test_pieces_compute_the_same_loss_and_gradients(name, kw, granularity):
    """Running the pieces one after another is the model: same loss, same gradients."""
    zm = load_model(name, **kw)
    ref = copy.deepcopy(zm.step).train()
    split = split_step(zm.step.train(), zm.batch, granularity, zm.block_classes)
    torch.manual_seed(1)
    ref_loss = ref(**zm.batch)
    ref_loss.backward()
    torch.manual_seed(1)
    loss, _ = split.run(zm.batch)
    loss.backward()
    assert torch.equal(loss, ref_loss)
    want, got = _grads(ref), _grads(zm.step)
    assert want.keys() == got.keys() and len(want) > 0
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


class Halves(nn.Module):
    """`chunk` between two layers, its halves read by different layers: the list it returns must
    not cross between pieces (a list cannot be sent, and the profiler's detach missed it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        left, right = self.a(x).chunk(2, dim=-1)
        return (self.b(left) + self.c(right)).pow(2).mean()


def _step(ref):
    zm = load_model(ref, batch_size=2, seq_len=8)
    return zm.step, zm.batch


@pytest.mark.parametrize("make", [lambda: (Halves(), {"x": torch.randn(3, 4)}),
                                  lambda: _step("hf_families:mixtral"), lambda: _step("hf_families:mamba")])
def test_only_tensors_cross_between_pieces(make):
    model, batch = make()
    split = split_step(model.train(), batch, "layer")
    _, values = split.run(batch, capture=True)
    crossing = {n for p in split.pieces for n in p.inputs}
    assert len(split.pieces) > 2 and crossing
    assert all(isinstance(values[n], torch.Tensor) for n in crossing), \
        {n: type(values[n]).__name__ for n in crossing if not isinstance(values[n], torch.Tensor)}


def test_gpt2_tiny_graph_has_residual_edges():
    zm = load_model("gpt2-tiny", batch_size=2, seq_len=16)
    g = profile_step(zm.step, zm.batch, name="gpt2-tiny", repeats=1).graph
    ids = [n.id for n in g.nodes]
    assert ids[0] == "input" and g.node("input").is_input
    assert "transformer.h.3.mlp.c_proj" in ids and g.node("transformer.h.0.attn.c_attn").op == "Conv1D"
    # The residual around attention: the block's input goes straight to the add before ln_2.
    assert ("transformer.drop", "transformer.h.0.ln_2") in g.skip_edges
    hidden = 2 * 16 * 128 * 4
    assert g.edge_bytes[("transformer.drop", "transformer.h.0.ln_1")] == hidden
    assert g.node("transformer.h.0.attn.c_attn").flops == 2 * (2 * 16) * 128 * 384 + 0  # Q, K, V projection
    assert g.node("transformer.h.0.attn.c_attn").param_bytes == (128 * 384 + 384) * 4
    assert all(n.fwd_s["cpu-" + str(torch.get_num_threads()) + "t"] >= 0 for n in g.nodes)
    assert g.meta["granularity"] == "layer" and g.batch_size == 2


def test_block_granularity_gives_one_node_per_block():
    zm = load_model("gpt2-tiny", batch_size=2, seq_len=16)
    g = profile_step(zm.step, zm.batch, name="gpt2-tiny", granularity="block", block_classes=zm.block_classes,
                     repeats=1).graph
    blocks = [n for n in g.nodes if n.op == "GPT2Block"]
    assert [n.id for n in blocks] == [f"transformer.h.{i}" for i in range(4)]
    assert blocks[0].module == ("transformer.h.0",)
    # recomputation's figures, measured per block: selective keeps less than all its activations
    # and builds again less than all of them plus what it keeps; both units add time
    assert g.selective_measured
    for b in blocks:
        assert 0 < b.selective_keep_bytes < b.act_bytes
        assert 0 < b.selective_rebuilt_bytes <= b.act_bytes
        assert b.rerun_forwards["block"] >= 0 and b.rerun_forwards["selective"] >= 0
    # times: a difference of fastest runs, which a busy machine can make 0 for one block, not all
    assert any(b.rerun_forwards["block"] > 0 for b in blocks) and any(b.rerun_forwards["selective"] > 0 for b in blocks)


def test_inception_has_parallel_branches():
    zm = load_model("inception-tiny", batch_size=4)
    graphs = {granularity: profile_step(zm.step, zm.batch, name="inception-tiny", granularity=granularity,
                                        block_classes=zm.block_classes, repeats=1).graph
              for granularity in ("block", "layer")}
    for granularity, g in graphs.items():
        assert max(len(g.successors(n.id)) for n in g.nodes) >= 3, granularity
    assert set(graphs["block"].successors("stem")) == {f"blocks.0.branches.{i}" for i in range(4)}


def test_mlp_numbers_are_exact():
    zm = load_model("mlp", batch_size=4)
    g = profile_step(zm.step, zm.batch, name="mlp", repeats=1).graph
    first = g.node("0")
    assert first.op == "Linear"
    assert first.flops == 2 * 4 * 784 * 1024
    assert first.param_bytes == (784 * 1024 + 1024) * 4
    assert first.out_bytes == 4 * 1024 * 4
    assert first.act_bytes == 4 * 784 * 4  # the input, kept for the weight gradient
    assert g.edge_bytes[("0", "1")] == 4 * 1024 * 4
    assert g.node("1").act_bytes == 4 * 1024 * 4  # ReLU keeps its output
    assert g.edge_bytes[("input", "0")] == 4 * 784 * 4
    assert sum(n.param_bytes for n in g.nodes) == sum(p.numel() * 4 for p in zm.step.parameters())


def test_several_devices_in_one_graph():
    zm = load_model("mlp", batch_size=4)
    g = profile_step(zm.step, zm.batch, devices=["cpu:1", "cpu:2"], repeats=1).graph
    assert g.profiled_on == "cpu-1t" and g.device_types == ("cpu-1t", "cpu-2t")
    assert all(set(n.fwd_s) == {"cpu-1t", "cpu-2t"} for n in g.nodes)


def test_profile_leaves_the_users_model_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 2))
    model.eval()
    model[0].weight.requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    modes = [m.training for m in model.modules()]
    flags = [p.requires_grad for p in model.parameters()]
    threads = torch.get_num_threads()
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    with torch.no_grad():
        g = profile(model, (x,), device=["cpu:1"], repeats=1)
        assert not torch.is_grad_enabled()
    assert len(g.nodes) == 5
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert [m.training for m in model.modules()] == modes
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)


def test_profile_api_with_keyword_inputs_and_loss_fn():
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    g = profile(model, {"input": torch.randn(6, 3)}, loss_fn=lambda out: (out ** 2).mean(), repeats=1, name="tiny")
    assert g.name == "tiny" and g.batch_size == 6 and g.node("input").is_input
    assert [n.op for n in g.nodes[1:]] == ["Linear", "Tanh", "Linear"]


def test_block_classes_are_found():
    assert find_block_classes(load_model("gpt2-tiny", batch_size=1, seq_len=4).step) == ("GPT2Block",)
    seq = nn.Sequential(*(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3)))
    assert find_block_classes(seq) == ("Sequential",)


def test_device_specs():
    n = usable_cores()
    assert parse_device(f"cpu:{n}").device_type == f"cpu-{n}t"
    with pytest.raises(HetplanError, match=f"999 threads, but this process may use {n} cores; profile with at most "
                                           f"cpu:{n}"):
        parse_device("cpu:999")  # more threads than cores: the times would be of a machine that is not there
    assert parse_device("cpu").device_type == f"cpu-{torch.get_num_threads()}t"
    with pytest.raises(HetplanError, match="write cpu, cpu:N"):
        parse_device("tpu")


# (the name the CUDA driver reports, the memory it reports: torch's get_device_properties, type)
DRIVER_NAMES = [
    ("NVIDIA H200", 143_771_140_096, "h200-141gb"),
    ("NVIDIA H100 80GB HBM3", 85_045_035_008, "h100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 42_505_273_344, "a100-40gb"),
    ("NVIDIA A100-SXM4-40GB", 40 * 2**30, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 80 * 2**30, "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", 85_096_873_984, "a100-80gb"),
    ("Tesla V100-SXM2-16GB", 16_945_512_448, "v100-16gb"),
    ("Tesla V100-SXM2-32GB", 34_089_730_048, "v100-32gb"),
    ("Tesla V100S-PCIE-32GB", 34_079_637_504, "v100-32gb"),
    ("Tesla T4", 15_843_721_216, "t4-16gb"),
    ("NVIDIA L4", 23_580_639_232, "l4-24gb"),
    ("NVIDIA GeForce RTX 3090", 25_438_126_080, "rtx3090-24gb"),
    ("Mystery GPU 9000", 8 * 2**30, "gpu-mystery-gpu-9000"),
    # an L40S is no L4 (48 GB, twice its FLOP/s): it was typed l4-24gb, whose name it holds
    ("NVIDIA L40S", 47_697_362_944, "gpu-nvidia-l40s"),
]


@pytest.mark.parametrize(("name", "mem_bytes", "expected"), DRIVER_NAMES)
def test_a_gpu_is_typed_by_the_name_and_memory_its_driver_reports(name, mem_bytes, expected):
    assert cuda_type_name(name, mem_bytes) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_where_there_is_none():
    with pytest.raises(HetplanError, match="no CUDA device is available here"):
        parse_device("cuda")


def test_untraceable_model_names_the_module_and_the_way_out():
    from user_models import untraceable

    model, batch = untraceable()
    with pytest.raises(HetplanError, match=r"cannot trace the model in module 'gate' \(Gate\): .*--granularity block"):
        profile(model, batch, repeats=1)
    with pytest.raises(HetplanError, match=r"torch.fx fails too in module 'gate' .* --block-class Gate"):
        profile(model, batch, granularity="block", repeats=1)


def test_blocks_are_run_not_traced_when_export_fails():
    """The way out works: with Gate as a block, torch.fx treats it as one opaque call."""
    from user_models import untraceable

    model, batch = untraceable()
    g = profile(model, batch, granularity="block", block_classes=["Gate"], repeats=1)
    assert [(n.id, n.op) for n in g.nodes] == [("input", "Input"), ("gate", "Gate"), ("fc", "Linear")]
    assert g.edge_bytes[("input", "gate")] == 2 * 4 * 4 and g.edge_bytes[("gate", "fc")] == 2 * 4 * 4
    # and the pieces still compute the model's loss and gradients
    step = __import__("hetplan.zoo.models", fromlist=["TrainStep"]).TrainStep(
        model, lambda m, b: m(**b).float().mean())
    ref = copy.deepcopy(step)
    split = split_step(step, batch, "block", ["Gate"])
    loss, _ = split.run(batch)
    loss.backward()
    ref_loss = ref(**batch)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    torch.testing.assert_close(step.model.fc.weight.grad, ref.model.fc.weight.grad)


def test_out_of_memory_names_the_batch_size():
    from user_models import hungry

    model, batch = hungry(batch_size=2)
    with pytest.raises(HetplanError, match="out of memory while profiling .* at batch size 2 on cpu: try a smaller"):
        profile(model, batch, repeats=1)


def test_granularity_block_without_blocks():
    zm = load_model("mlp", batch_size=2)
    with pytest.raises(HetplanError, match="no module of class Nope"):
        profile_step(zm.step, zm.batch, granularity="block", block_classes=["Nope"], repeats=1)


def _in_sequence_grads(step, batch, granularity, block_classes):
    from hetplan.profile.timing import Clock, run_in_sequence

    ref = copy.deepcopy(step).train()
    split = split_step(step.train(), batch, granularity, block_classes)
    torch.manual_seed(1)
    ref(**batch).backward()
    torch.manual_seed(1)
    run_in_sequence(split, batch, Clock("cpu"))
    return _grads(ref), _grads(step)


@pytest.mark.parametrize("name,kw,granularity", [
    ("gpt2-tiny", {"batch_size": 2, "seq_len": 16}, "layer"),
    ("gpt2-tiny", {"batch_size": 2, "seq_len": 16}, "block"),
    ("inception-tiny", {"batch_size": 4}, "layer"),  # in-place ReLUs, four branches read one value
    ("mlp", {"batch_size": 4}, "layer"),
])
def test_pieces_timed_in_sequence_compute_the_steps_gradients(name, kw, granularity):
    """Each piece's backward on its own, with the gradients its consumers sent, gives every
    parameter the gradient of the unsplit step."""
    zm = load_model(name, **kw)
    want, got = _in_sequence_grads(zm.step, zm.batch, granularity, zm.block_classes)
    assert want.keys() == got.keys() and len(want) == len(list(zm.step.parameters()))
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)


class _Diamond(nn.Module):
    """x -> a -> (b, c) -> b * tanh(c) + a: one value read by both branches and the residual."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        a = torch.relu(self.a(x))
        return self.head(self.b(a) * torch.tanh(self.c(a)) + a)


def test_gradients_of_a_value_read_by_several_pieces_are_summed():
    from hetplan.zoo.models import TrainStep

    torch.manual_seed(0)
    step = TrainStep(_Diamond(), lambda m, b: m(**b).pow(2).mean())
    batch = {"x": torch.randn(5, 6)}
    split = split_step(step, batch, "layer", None)
    producer = {o: p.name for p in split.pieces for o in p.outputs}
    readers = [sum(1 for p in split.pieces if v in p.inputs) for v in producer]
    assert max(readers) >= 2  # the diamond is there (the residual add is folded into a reader)
    want, got = _in_sequence_grads(step, batch, "layer", None)
    assert want.keys() == got.keys() == {n for n, _ in step.named_parameters()}
    for key in want:
        torch.testing.assert_close(got[key], want[key])


def test_cuda_timing_synchronises_once_per_repeat(monkeypatch):
    """On CUDA the pieces are stamped with events and the CPU never waits for the GPU inside a
    repeat: one synchronisation per repeat. (No GPU here: the events and the synchronisation
    are counted, on a CPU run that takes the CUDA path.)"""
    from hetplan.profile import timing

    events, syncs = [], []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = len(events)
            events.append(self)

        def elapsed_time(self, end):
            assert syncs, "read before synchronising"
            return float(end.t - self.t)

    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: syncs.append(len(events)))
    monkeypatch.setattr(timing.Clock, "__init__", lambda self, device: setattr(self, "cuda", True)
                        or setattr(self, "device", device))
    zm = load_model("mlp", batch_size=4)
    split = split_step(zm.step.train(), zm.batch, "layer", None)
    out = timing.time_in_sequence(split, zm.batch, "cuda", repeats=3)
    assert len(syncs) == 4  # the warm-up and 3 repeats: one each, after the last piece's backward
    per_repeat = 4 * len(split.pieces)  # a stamp before and after each forward and each backward
    assert syncs == [per_repeat * (i + 1) for i in range(4)]
    assert set(out.times) == {p.name for p in split.pieces} and len(out.totals_s) == 3
    # one "millisecond" between the two stamps of every piece, and no CPU overhead taken off
    assert all(t.fwd_s == t.bwd_s == 1e-3 for t in out.times.values()), out.times


def test_profiles_say_how_nodes_were_timed_and_check_pairs_the_repeats():
    zm = load_model("mlp", batch_size=16)
    report = profile_step(zm.step, zm.batch, repeats=2, check=True)
    timing = report.graph.meta["timing"]
    assert timing.startswith("pieces run in sequence") and "5 repeats" in timing  # at least 5 with check
    (dtype,) = report.graph.device_types
    assert 0.2 < report.check_ratio[dtype] < 5 and 0.2 < report.check_ratio_median[dtype] < 5
    low, high = report.whole_step_range_s[dtype]
    assert low <= report.whole_step_s[dtype] <= high


def test_tensor_parallel_rules_that_cannot_read_a_model_leave_its_profile_whole(monkeypatch):
    """The split rules run on every profile, for plans that may ask for tensor parallelism later;
    a model they cannot read (heads given per stage once made them raise a TypeError) is profiled
    all the same, every node unsplittable (tp_units 1), instead of ending in a traceback."""
    import hetplan.pieces.tensor_split as rules

    def unreadable(*args, **kwargs):
        raise TypeError("int() argument must be a string, a bytes-like object or a real number, not 'list'")

    monkeypatch.setattr(rules, "split_units", unreadable)
    monkeypatch.setattr(rules, "tensor_splits", unreadable)
    zm = load_model("llama-tiny", batch_size=2, seq_len=8, seed=0)
    graph = profile_step(zm.step, zm.batch, name="llama-tiny", repeats=1).graph
    assert all(n.tp_units == 1 for n in graph.nodes if not n.is_input)
    assert not any(n.act_split_share for n in graph.nodes)
