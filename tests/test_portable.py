"""Stage code runs on any device: what this CPU-only machine can check of a GPU stage.

Every zoo model's stages are built as the runtime builds them (traced here, on the CPU) and
placed on the `meta` device, which has no data and no kernels of the CPU: a device, a dtype-device
assertion or a layout of the tracing machine left in a piece makes it fail there, as it did on
an H100 (evidence box-2026-11: `aten._assert_tensor_metadata(..., device=cpu)`)."""

import pytest
import torch
from torch import nn

from hetplan.pieces.portable import baked_devices, place, portable
from hetplan.plan import Plan, Stage
from hetplan.runtime.traces import SharedTraces, Traces
from hetplan.zoo import ZOO, load_model


def two_stages(name):
    zm = load_model(name, batch_size=2, seq_len=16, seed=0)
    shared = SharedTraces()  # the cut that names the pieces is the one the stages take
    names = [p.name for p in shared.split(zm.step, zm.batch, "layer", None).pieces]
    half = len(names) // 2
    plan = Plan((Stage(tuple(names[:half]), ("a",)), Stage(tuple(names[half:]), ("b",))), 1, "gpipe", "test")
    return zm, Traces(zm.step, zm.batch, plan, "layer", None, {}, shared=shared).stages(2)


# gpt2 is gpt2-tiny's builder and classes at 124M parameters: seconds of the suite for no other code
@pytest.mark.parametrize("name", [name for name in ZOO if name != "gpt2"])
def test_every_zoo_models_stages_run_on_the_meta_device(name):
    zm, stages = two_stages(name)
    first_inputs = tuple(zm.batch[k][:2] for k in zm.batch)  # the step's inputs, in the batch's order
    cpu_mid = stages[0](*first_inputs)
    cpu_mid = cpu_mid if isinstance(cpu_mid, tuple) else (cpu_mid,)
    cpu_loss = stages[1](*cpu_mid)
    for stage in stages:
        place(stage, "meta")
        assert baked_devices(stage) <= {"meta"}  # no device of the tracing machine is left
        assert all(p.device.type == "meta" for p in stage.parameters())
    mid = stages[0](*(v.to("meta") for v in first_inputs))
    mid = mid if isinstance(mid, tuple) else (mid,)
    assert [(m.shape, m.dtype) for m in mid] == [(c.shape, c.dtype) for c in cpu_mid]
    inputs = [m.detach().requires_grad_(m.is_floating_point() and c.requires_grad) for m, c in zip(mid, cpu_mid,
                                                                                                  strict=True)]
    loss = stages[1](*inputs)
    assert loss.device.type == "meta" and loss.shape == cpu_loss.shape == ()
    loss.backward()  # and the backward pass too
    assert any(i.grad is not None and i.grad.device.type == "meta" for i in inputs if i.requires_grad)


def test_a_traced_view_becomes_a_reshape_that_takes_any_strides():
    """On CUDA, attention returns other strides than on the CPU; a `view` traced on the CPU then
    fails. A portable piece reshapes instead (a view whenever a view works)."""

    class Step(nn.Module):
        def forward(self, x):
            return x.transpose(0, 1).reshape(-1).sum()

    gm = torch.export.export(Step(), (torch.randn(3, 4),), strict=False).module()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    portable(gm)
    after = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.view.default not in after
    assert torch.ops.aten._assert_tensor_metadata.default not in after
    assert targets - after <= {torch.ops.aten.view.default, torch.ops.aten._assert_tensor_metadata.default}
    assert gm(torch.randn(4, 3).t()).shape == ()  # a non-contiguous input: strides the trace never saw
