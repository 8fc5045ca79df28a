"""The host allocator's setting (`hetplan.pieces.hostmem`): with it, a training step on the CPU
page-faults nothing in its steady state; without it, glibc faulted Adam's temporaries in again
every step (the perceptron's runs measured 22-54% slower than its profile)."""

import json
import os
import platform
import subprocess
import sys

import pytest

import hetplan.profile as hp
from hetplan.pieces import hostmem

# Steps of the zoo's 784-1024x4-10 perceptron with Adam in a fresh process (the setting is for the
# whole process and cannot be undone), each with a 64 MiB activation besides (above glibc's largest
# dynamic mmap threshold, 32 MiB: mapped and faulted in every step under its defaults, whatever the
# process's history); prints the median minor page faults of the last steps.
STEPS = """
import json, resource, statistics, sys, torch
from torch import nn
from hetplan.pieces.hostmem import keep_freed_memory
torch.set_num_threads(1)
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.manual_seed(0)
layers = [nn.Linear(784, 1024), nn.ReLU()] + [nn.Linear(1024, 1024), nn.ReLU()] * 3 + [nn.Linear(1024, 10)]
model, x, y = nn.Sequential(*layers), torch.randn(64, 784), torch.randint(0, 10, (64,))
opt = torch.optim.Adam(model.parameters(), lr=1e-6)
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    activation = torch.ones(16 << 20)
    nn.functional.cross_entropy(model(x), y + int(activation[0]) - 1).backward()
    del activation
    opt.step()
    opt.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": statistics.median(faults[4:])}))
"""


def _faults_per_step(mode: str) -> dict:
    # glibc's defaults in the child: nothing of the caller's own malloc settings or opt-out
    env = {k: v for k, v in os.environ.items()
           if k not in ("HETPLAN_HOST_MEMORY", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120,
                          check=True, env=env)
    return json.loads(proc.stdout)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                    or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 35),
                    reason="the setting is glibc's, and a threshold above 32 MiB needs glibc 2.35")
def test_kept_memory_makes_a_steady_step_fault_nothing():
    default = _faults_per_step("default")
    if default["faults"] < 1000:
        pytest.skip(f"this C library does not fault the step in again ({default['faults']} faults per step)")
    kept = _faults_per_step("keep")
    assert kept["kept"] is True
    assert kept["faults"] < 50, (default, kept)


def test_the_profiler_measures_with_the_runtimes_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(hp, "keep_freed_memory", lambda: calls.append(1) or True)
    import torch

    step = torch.nn.Sequential(torch.nn.Linear(4, 1))

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = step

        def forward(self, x):
            return self.net(x).sum()

    hp.profile_step(Loss(), {"x": torch.randn(8, 4)}, repeats=1, fixed=False)
    assert calls == [1]


def test_the_environment_can_leave_the_c_librarys_defaults(monkeypatch):
    monkeypatch.setenv("HETPLAN_HOST_MEMORY", "system")
    monkeypatch.setattr(hostmem, "_mallopt", lambda: pytest.fail("mallopt called although the user said system"))
    assert hostmem.keep_freed_memory() is False


def test_another_c_library_is_left_as_it_is(monkeypatch):
    monkeypatch.delenv("HETPLAN_HOST_MEMORY", raising=False)
    hostmem._mallopt.cache_clear()
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("musl", "1.2"))
    try:
        assert hostmem.keep_freed_memory() is False
    finally:
        hostmem._mallopt.cache_clear()
