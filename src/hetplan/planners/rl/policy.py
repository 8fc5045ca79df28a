"""Policy networks of `reinforce` and `ppo`: a grouper and a sequence-to-sequence placer.

- Grouper: a feed-forward network from unit features to group logits (the Hierarchical
  placer's grouper, Mirhoseini et al. 2018; Trinity's partition network, an MLP with hidden sizes
  64 and 128 and 30% dropout).
- Placer: an LSTM encoder over the stages (each the mean of its units' features) and an LSTM
  decoder that picks one device per stage, attending over the encoder's outputs; its input at
  each step is the embedding of the device picked before. Devices are scored by the dot product
  of the decoder's attention-mixed state with each device's key: a trainable embedding plus a
  projection of the device's features (speed, memory, price), so that the network can tell
  devices apart and generalise across devices of one type.
- Trinity samples through softmax(C * tanh(u / T)) (C = 5, T = 10): `squash` bounds the logits
  so that no choice becomes certain early.

Sampling and the log-probabilities used for learning are separate: `sample` draws a batch of
plans (memory masks from `PlanEnv`, see there), and `log_prob` recomputes the log-probability of
those choices under the current parameters (teacher forcing), as REINFORCE and PPO need.
Warm starts add a bias (in logits) to the choices of a given plan, scaled by `bias_scale`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hetplan.planners.rl.env import PlanEnv, repair


@dataclass(frozen=True)
class Squash:
    """softmax(C * tanh(u / T)); None in a policy means plain softmax(u)."""

    c: float = 5.0
    t: float = 10.0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.c * torch.tanh(logits / self.t)


@dataclass(frozen=True)
class Sample:
    """A batch of P sampled plans: free labels (P, U), repaired stages (P, U), devices (P, G),
    the device masks used at each stage (P, G, D), and the number of stages (P,)."""

    labels: np.ndarray
    stages: np.ndarray
    devices: np.ndarray
    masks: np.ndarray
    n: np.ndarray


class Grouper(nn.Module):
    def __init__(self, n_in: int, groups: int, hidden: tuple[int, ...], dropout: float) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = n_in
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(dropout)]
            d = h
        layers.append(nn.Linear(d, groups))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Placer(nn.Module):
    def __init__(self, n_in: int, device_features: np.ndarray, hidden: int) -> None:
        super().__init__()
        d = device_features.shape[0]
        self.register_buffer("dev_feat", torch.as_tensor(device_features))
        self.enc = nn.LSTM(n_in, hidden, batch_first=True)
        self.dec = nn.LSTMCell(hidden, hidden)
        self.dev_embed = nn.Embedding(d + 1, hidden)  # the last row is the start token
        self.dev_proj = nn.Linear(device_features.shape[1], hidden)
        self.attn = nn.Linear(hidden, hidden, bias=False)
        self.mix = nn.Linear(2 * hidden, hidden)
        self.devices = d

    def keys(self) -> torch.Tensor:
        return self.dev_embed.weight[:-1] + self.dev_proj(self.dev_feat)

    def encode(self, stage_in: torch.Tensor) -> torch.Tensor:
        out, _ = self.enc(stage_in)
        return out

    def step(self, enc: torch.Tensor, enc_mask: torch.Tensor, state, prev: torch.Tensor, keys: torch.Tensor):
        h, c = self.dec(self.dev_embed(prev), state)
        scores = torch.einsum("pgh,ph->pg", enc, self.attn(h)).masked_fill(~enc_mask, float("-inf"))
        ctx = torch.einsum("pg,pgh->ph", torch.softmax(scores, dim=1), enc)
        q = torch.tanh(self.mix(torch.cat([h, ctx], dim=1)))
        return q @ keys.T, (h, c)


class PlanPolicy(nn.Module):
    """Grouper + placer over a `PlanEnv`."""

    def __init__(self, env: PlanEnv, unit_features: np.ndarray, device_features: np.ndarray, *,
                 group_hidden: tuple[int, ...] = (64,), dropout: float = 0.0, placer_hidden: int = 64,
                 squash: Squash | None = None) -> None:
        super().__init__()
        self.env = env
        self.register_buffer("x", torch.as_tensor(unit_features))
        self.grouper = Grouper(unit_features.shape[1], env.groups, group_hidden, dropout)
        self.placer = Placer(unit_features.shape[1], device_features, placer_hidden)
        self.squash = squash
        self.register_buffer("group_bias", torch.zeros(env.units, env.groups))
        self.register_buffer("device_bias", torch.zeros(env.groups, env.devices))

    def warm(self, stages: np.ndarray, devices: np.ndarray, nats: float) -> None:
        """Bias the policy's choices towards a plan (its stages and devices) by `nats` logits."""
        self.group_bias.zero_()
        self.device_bias.zero_()
        self.group_bias[torch.arange(self.env.units), torch.as_tensor(stages)] = nats
        for s, d in enumerate(devices):
            if d >= 0:
                self.device_bias[s, int(d)] = nats

    def _out(self, logits: torch.Tensor) -> torch.Tensor:
        return self.squash(logits) if self.squash is not None else logits

    def group_logits(self, p: int, bias_scale: float) -> torch.Tensor:
        x = self.x.unsqueeze(0).expand(p, -1, -1)
        return self._out(self.grouper(x) + bias_scale * self.group_bias)

    def stage_inputs(self, stages: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        onehot = torch.as_tensor(stages[:, :, None] == np.arange(self.env.groups)[None, None, :], dtype=torch.float32)
        count = onehot.sum(dim=1)  # (P, G)
        mean = torch.einsum("pug,uf->pgf", onehot, self.x) / count.clamp(min=1).unsqueeze(-1)
        return mean, count > 0

    def _decoder_start(self, stages: np.ndarray):
        """The placer's encoder outputs and mask over stages, the device keys, a zero decoder state
        and the start token, for a batch of repaired stagings."""
        enc_in, enc_mask = self.stage_inputs(stages)
        enc = self.placer.encode(enc_in)
        h = torch.zeros(stages.shape[0], enc.shape[2])
        prev = torch.full((stages.shape[0],), self.env.devices, dtype=torch.long)
        return enc, enc_mask, self.placer.keys(), (h, torch.zeros_like(h)), prev

    @torch.no_grad()
    def sample(self, p: int, gen: torch.Generator, bias_scale: float = 0.0, noise_std: float = 0.0) -> Sample:
        env = self.env
        logits = self.group_logits(p, bias_scale)
        if noise_std > 0:
            logits = logits + noise_std * torch.randn(logits.shape, generator=gen)
        probs = torch.softmax(logits, dim=-1).reshape(-1, env.groups)
        labels = torch.multinomial(probs, 1, generator=gen).reshape(p, env.units).numpy()
        stages = repair(labels, env.groups)
        n = stages.max(axis=1) + 1
        need = env.stage_need_bytes(stages, n)
        enc, enc_mask, keys, state, prev = self._decoder_start(stages)
        used = np.zeros((p, env.devices), dtype=bool)
        devices = np.full((p, env.groups), -1, dtype=int)
        masks = np.zeros((p, env.groups, env.devices), dtype=bool)
        for s in range(int(n.max())):
            dl, state = self.placer.step(enc, enc_mask, state, prev, keys)
            dl = self._out(dl + bias_scale * self.device_bias[s])
            if noise_std > 0:
                dl = dl + noise_std * torch.randn(dl.shape, generator=gen)
            mask = env.device_mask(need[:, s], used)
            mask[n <= s] = True  # past the last stage: anything, ignored
            masks[:, s] = mask
            dl = dl.masked_fill(~torch.as_tensor(mask), float("-inf"))
            pick = torch.multinomial(torch.softmax(dl, dim=1), 1, generator=gen).squeeze(1)
            active = n > s
            devices[active, s] = pick.numpy()[active]
            used[np.flatnonzero(active), pick.numpy()[active]] = True
            prev = torch.where(torch.as_tensor(active), pick, prev)
        return Sample(labels, stages, devices, masks, n)

    def log_prob(self, sample: Sample, bias_scale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of each sampled plan under the current parameters (P,) and the mean
        entropy of the choices (for an entropy bonus)."""
        env = self.env
        p = sample.labels.shape[0]
        logits = self.group_logits(p, bias_scale)
        logp_all = torch.log_softmax(logits, dim=-1)
        labels = torch.as_tensor(sample.labels)
        logp = logp_all.gather(2, labels.unsqueeze(-1)).squeeze(-1).sum(dim=1)
        entropy = -(logp_all.exp() * logp_all).sum(dim=-1).mean()
        enc, enc_mask, keys, state, prev = self._decoder_start(sample.stages)
        for s in range(int(sample.n.max())):
            dl, state = self.placer.step(enc, enc_mask, state, prev, keys)
            dl = self._out(dl + bias_scale * self.device_bias[s])
            mask = torch.as_tensor(sample.masks[:, s])
            dl = torch.log_softmax(dl.masked_fill(~mask, float("-inf")), dim=1)
            active = torch.as_tensor(sample.n > s)
            pick = torch.as_tensor(np.where(sample.n > s, sample.devices[:, s], 0))
            chosen = dl.gather(1, pick.unsqueeze(1)).squeeze(1)
            logp = logp + torch.where(active, chosen, torch.zeros_like(chosen))
            # masked choices have probability 0 and log -inf: zero them before multiplying, or
            # the gradient of 0 * -inf poisons every parameter with NaN
            safe = torch.where(mask, dl, torch.zeros_like(dl))
            ent = -(safe.exp() * safe * mask).sum(dim=1)
            entropy = entropy + (ent * active).sum() / max(int(active.sum()), 1) / env.units
            prev = torch.where(active, pick, prev)
        return logp, entropy
