"""A model of a user's own for the benchmarks (`bench_models:encoder`, with bench/ on PYTHONPATH):
not in hetplan's zoo, written as a user would write it, from torch's building blocks."""

import torch
from torch import nn


class Encoder(nn.Module):
    """A small transformer encoder over float features, regressing one value per sequence."""

    def __init__(self, features=32, width=128, layers=4):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
                                     for _ in range(layers)])
        self.head = nn.Linear(width, 1)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.head(h.mean(dim=1)).squeeze(-1), y)


def encoder(batch_size=16, seq_len=32):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return Encoder(), {"x": torch.randn(batch_size, seq_len or 32, 32, generator=g),
                       "y": torch.randn(batch_size, generator=g)}
