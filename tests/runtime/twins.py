"""A small model with every awkward feature, and a DDP twin harness for runtime tests."""

from __future__ import annotations

import torch
from torch import nn


class Awkward(nn.Module):
    """Convs, norms, biases, a tied embedding/head, an unused branch and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 48)
        self.conv = nn.Conv1d(48, 48, 3, padding=1)
        self.norm = nn.LayerNorm(48)
        self.frozen = nn.Linear(48, 48)
        self.frozen.requires_grad_(False)
        self.mlp = nn.Linear(48, 64)
        self.bn = nn.BatchNorm1d(64)
        self.unused = nn.Linear(64, 64)  # never called: find_unused_parameters
        self.head = nn.Linear(48, 40, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.proj = nn.Linear(64, 48)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, T, C)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = self.frozen(self.norm(h))
        z = self.mlp(h)
        z = self.bn(z.transpose(1, 2)).transpose(1, 2).relu()
        h = h + self.proj(z)
        return self.head(h)


def batch(rank: int, step: int, n: int = 8, t: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 40, (n, t), generator=g)
    return x, torch.roll(x, 1, dims=1)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
