"""An MSE autoencoder on digit rows (an `.npy` of inputs alone): the loss is the user's."""

import torch
import torch.nn.functional as F
from torch import nn


class AutoEncoder(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 48, code: int = 12) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, code))
        self.decoder = nn.Sequential(nn.Linear(code, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def build() -> nn.Module:
    return AutoEncoder()


def mse(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(batch), batch)
