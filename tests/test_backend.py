"""Which backend a run's workers talk over, and how a message travels on it: pipeline messages
pair by their order on a channel's own group (tag 0, as NCCL pairs them), never by a tag; a
message or a sum stays on the GPU only where every rank in it is on one and NCCL carries it."""

from unittest import mock

import pytest
import torch

from hetplan.errors import HetplanError
from hetplan.lowering import ACTIVATIONS, GRADIENTS
from hetplan.runtime.backend import MIXED, backend_of
from hetplan.runtime.sharding import RING_TAG
from hetplan.runtime.transport import GlooTransport

GPUS, MIX, CPUS = ["cuda:0", "cuda:1"], ["cuda:0", "cpu"], ["cpu", "cpu"]
ONE_GPU = ["cuda:0", "cpu", "cuda:0"]  # two workers on one GPU (NCCL refuses two ranks on one device)


@pytest.mark.parametrize("setting,bindings,nccl,expected", [
    ("gloo", GPUS, True, "gloo"),
    ("auto", CPUS, True, "gloo"),
    ("auto", GPUS, False, "gloo"),  # a CPU build of torch: the GPUs' messages go through the host
    ("auto", GPUS, True, MIXED),
    ("auto", MIX, True, MIXED),  # NCCL between the GPUs, gloo to the CPU worker
    ("nccl", GPUS, True, MIXED),
    ("auto", ONE_GPU, True, "gloo"),  # NCCL would refuse them: through the host
    ("auto", ["cuda", "cuda:1"], True, MIXED),  # "cuda" is cuda:0
    ("auto", ["cuda", "cuda:0"], True, "gloo"),
])
def test_the_backend_of_each_setting(setting, bindings, nccl, expected):
    assert backend_of(setting, bindings, lambda: nccl) == expected


@pytest.mark.parametrize("setting,bindings,nccl,words", [
    ("nccl", MIX, True, "--backend nccl: worker 1 runs on the CPU (cpu), and NCCL carries GPU tensors only"),
    ("nccl", CPUS, True, "worker 0 runs on the CPU"),
    ("nccl", GPUS, False, "this torch has no NCCL"),
    ("mpi", GPUS, True, "--backend 'mpi' is unknown: use one of auto, gloo, nccl"),
    ("nccl", ["cuda:0", "cuda:1", "cuda:0"], True, "workers 0 and 2 are both on cuda:0, and NCCL runs one worker"),
])
def test_a_backend_that_cannot_hold_is_refused_in_one_line(setting, bindings, nccl, words):
    with pytest.raises(HetplanError, match="^[^\n]*$") as err:
        backend_of(setting, bindings, lambda: nccl)
    assert words in str(err.value)


def transport(devices, backend):
    """A GlooTransport of rank 0 of two, over a recording stand-in for torch.distributed."""
    dist = mock.MagicMock()
    dist.is_initialized.return_value = False
    dist.new_group.side_effect = lambda ranks: f"group{tuple(ranks)}"
    with mock.patch.dict("sys.modules", {"torch.distributed": dist}), \
            mock.patch("torch.distributed", dist, create=True):
        made = GlooTransport(0, 2, [(0, 1)], 5.0, devices, backend)
    return made, dist


def test_pipeline_messages_pair_by_order_on_their_channels_group_never_by_tag():
    """Activations on the default group, gradients on a group of their own, both with tag 0
    (what NCCL needs: it pairs by order alone); a sharded stage's ring keeps its gloo tags."""
    t, dist = transport(CPUS, "gloo")
    assert dist.init_process_group.call_args.args[0] == "gloo"
    x = torch.zeros(4, dtype=torch.uint8)
    t.isend(x, 1, ACTIVATIONS)
    t.isend(x, 1, GRADIENTS)
    t.recv(x, 1, ACTIVATIONS)
    t.recv(x, 1, GRADIENTS)
    t.isend(x, 1, RING_TAG + 7)
    sent = [(c.kwargs.get("group"), c.kwargs["tag"]) for c in dist.isend.call_args_list]
    got = [(c.kwargs.get("group"), c.kwargs["tag"]) for c in dist.recv.call_args_list]
    assert sent[:2] == got == [(None, 0), ("group(0, 1)", 0)]
    assert dist.isend.call_args_list[2].kwargs == {"tag": RING_TAG + 7}


@pytest.mark.parametrize("devices,backend,ranks,where", [
    (GPUS, MIXED, (0, 1), "cuda:0"),  # GPU to GPU on NCCL: no host hop
    (MIX, MIXED, (0, 1), "cpu"),  # a CPU worker takes part: through the host, by gloo
    (MIX, MIXED, (0,), "cuda:0"),
    (GPUS, "gloo", (0, 1), "cpu"),  # gloo carries host tensors only
])
def test_a_message_stays_on_the_gpu_only_between_gpus_on_nccl(devices, backend, ranks, where):
    t, dist = transport(devices, backend)
    assert dist.init_process_group.call_args.args[0] == backend
    assert t.wire(ranks) == torch.device(where)


@pytest.mark.parametrize("devices,backend,on", [(GPUS, MIXED, True), (MIX, MIXED, False), (GPUS, "gloo", False)])
def test_a_sharded_stage_uses_the_backends_collectives_only_among_gpus_on_nccl(devices, backend, on):
    """NCCL's reduce-scatter and all-gather where the replicas are GPU workers under NCCL, on their
    group; elsewhere the ring over point-to-point (gloo's reduce-scatter is an all-reduce)."""
    t, dist = transport(devices, backend)
    for name in ("reduce_scatter_single", "all_gather_single"):  # the stand-in has the names this torch has
        if not hasattr(torch.distributed, name):
            delattr(dist, name)
    assert t.collectives((0, 1)) is on
    out, x = torch.zeros(2), torch.zeros(4)
    t.reduce_scatter(out, x, (0, 1))
    t.all_gather(x, out, (0, 1))
    scatter = dist.reduce_scatter_single if hasattr(torch.distributed, "reduce_scatter_single") \
        else dist.reduce_scatter_tensor
    assert scatter.call_args.args == (out, x) and scatter.call_args.kwargs == {"group": "group(0, 1)"}
    gather = dist.all_gather_single if hasattr(torch.distributed, "all_gather_single") else dist.all_gather_into_tensor
    assert gather.call_args.args == (x, out) and gather.call_args.kwargs == {"group": "group(0, 1)"}


def gpu_box(bindings):
    from hetplan.io.clusters import cluster_from_spec

    return cluster_from_spec({"name": "box", "devices": [
        {"id": f"g{i}", "type": "h100-80gb", "host": "h", "binding": b} for i, b in enumerate(bindings)]}, "box")


@pytest.mark.parametrize("bindings,words", [
    (["cuda:0", "cuda:1"], None),  # DTensor over NCCL, one worker per GPU
    (["cuda:0", "cuda:0"], "the tensor-parallel group g0, g1 shares a GPU, and its collectives need NCCL"),
    (["cuda:0", "cpu"], "the tensor-parallel group g0, g1 mixes CPU and GPU workers"),
    (["cpu", "cpu"], None),
])
def test_a_tensor_parallel_group_runs_on_gpus_of_its_own(bindings, words):
    from hetplan.plan import Plan, Stage
    from hetplan.runtime.support import runtime_refusal

    plan = Plan((Stage(("a",), ("g0",), tp=2, tp_devices=(("g0", "g1"),)),), 1, "gpipe", "test")
    why = runtime_refusal(plan, gpu_box(bindings))
    assert why is None if words is None else why.startswith(words) and "\n" not in why


@pytest.mark.parametrize("setting,nccl", [("gloo", True), ("auto", False)])
def test_a_run_of_a_tensor_parallel_group_on_gpus_without_nccl_is_refused_before_it_starts(setting, nccl):
    """Its collectives are DTensor's over NCCL: a run whose workers would talk over gloo (the
    setting, or a torch without NCCL) is refused in one line, before any worker starts."""
    from hetplan.plan import Plan, Stage
    from hetplan.runtime.launch import run_spec
    from hetplan.runtime.settings import RunSettings

    plan = Plan((Stage(("a",), ("g0",), tp=2, tp_devices=(("g0", "g1"),)),), 1, "gpipe", "test")
    settings = RunSettings(batch_size=2, granularity="layer", out_dir="unused", backend=setting)
    with mock.patch("hetplan.runtime.backend.nccl_available", lambda: nccl), \
            pytest.raises(HetplanError, match="^[^\n]*$") as err:
        run_spec(plan, gpu_box(["cuda:0", "cuda:1"]), "mlp", settings)
    assert str(err.value).startswith("the tensor-parallel group g0, g1 is on GPUs, whose collectives need NCCL, and "
                                     "this run talks over gloo")
