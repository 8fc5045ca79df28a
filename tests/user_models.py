"""Models used by the tests as a user's own (`module.path:factory`)."""

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.relu(self.bn(self.fc1(x)))
        return self.fc2(h) + x[:, :1]  # a skip from the input to the output


def ctr_small(batch_size=16, seq_len=None):
    """hetplan's ctr-dnn with small tables (four of 2,000 rows, 22 of 100) and a small MLP."""
    from hetplan.zoo.models import ctr_dnn

    return ctr_dnn(batch_size, 0, 0, tables=(2000,) * 4 + (100,) * 22, hidden=(64, 32))


def make(batch_size=4, seq_len=None):
    torch.manual_seed(0)
    return Tiny(), {"x": torch.randn(batch_size, 8)}


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.gate(x))


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a value: torch.export cannot trace it
            return x
        return -x


def untraceable(batch_size=2, seq_len=None):
    return DataDependent(), {"x": torch.randn(batch_size, 4)}


class Hungry(nn.Module):
    """Asks for 1 PiB when it runs for real (tracing uses fake tensors and allocates nothing)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        big = x.new_zeros(2**48)
        return self.fc(x) + big[:1]


def hungry(batch_size=2, seq_len=None):
    return Hungry(), {"x": torch.randn(batch_size, 4)}


def broken(batch_size=4, seq_len=None):
    """A factory that fails, as a user's may while being written."""
    raise ValueError("no such checkpoint")


def sizeless():
    """A factory that takes no batch size."""
    return make()
