"""Projecting a node's time to a device type it was not profiled on (roofline model).

Williams, Waterman and Patterson, "Roofline: an insightful visual performance model for
multicore architectures" (CACM 2009): a kernel of F FLOPs that moves B bytes cannot run faster
than max(F / peak_flops, B / memory_bandwidth). hetplan assumes that a node reaches the same
fraction of its roofline on every device, a fraction calibrated on the device it was measured
on, so

    t_target = t_measured * roofline(F, B, target) / roofline(F, B, measured_on)

with F the node's forward FLOPs and B its parameter, input and output bytes (the backward pass
scales by the same factor). The peak FLOP rate is that of the graph's precision on each device
(`DeviceType.peak_flops_in`: the 16-bit tensor rate for bf16 and fp16, fp32's on a device
without bf16 tensor cores). A node without FLOPs (PipeDream profiles carry none) falls back to
the ratio of peak FLOP/s.

How far off it can be:
- Small layers on a GPU are bound by kernel launches (5-10 us each), which the roofline ignores:
  projecting a tiny layer from a CPU onto a GPU can be optimistic by 10x or more.
- fp32 matrix products on recent GPUs may run on TF32 tensor cores, several times faster than
  the fp32 peak the projection uses: projections onto A100/H100 are then pessimistic.
- The achieved fraction of the roofline differs between devices (CPU GEMMs reach 50-80% of
  peak, large GPU GEMMs 60-90%, attention and normalisation far less). Between two devices of
  the same kind expect errors of tens of percent; between a CPU and a GPU, 2x or more.
BENCHMARKS.md reports the error measured between CPU thread counts on this machine.
Profile on the real device type whenever you can: measured times always take precedence.
"""

from __future__ import annotations

from hetplan.catalog import DeviceType
from hetplan.precision import FP32


def roofline_s(flops: float, traffic_bytes: float, device: DeviceType, precision: str = FP32) -> float:
    """The roofline of a kernel of `flops` products in `precision` moving `traffic_bytes`."""
    return max(flops / device.peak_flops_in(precision), traffic_bytes / device.mem_bw_Bps)


def project_s(measured_s: float, flops: float, traffic_bytes: float, source: DeviceType, target: DeviceType,
              precision: str = FP32) -> float:
    """A time measured on `source`, projected to `target`, both in `precision` (the products'
    peak rate is that precision's: a 16-bit product runs on the tensor cores)."""
    if measured_s <= 0:
        return 0.0
    roof_source = roofline_s(flops, traffic_bytes, source, precision)
    if flops <= 0 or roof_source <= 0:
        return measured_s * source.peak_flops_in(precision) / target.peak_flops_in(precision)
    return measured_s * roofline_s(flops, traffic_bytes, target, precision) / roof_source
