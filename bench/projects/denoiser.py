"""A diffusion-style denoiser: the model predicts the noise added at a random level (MSE). Its data is a
factory of its own (`data(split=...)`), its loss draws noise from torch's global generator."""

import math

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset


class Denoiser(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 96) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None]], dim=1))


def build() -> nn.Module:
    return Denoiser()


def data(split: str) -> TensorDataset:
    x = torch.tensor(load_digits().data, dtype=torch.float32) / 8 - 1
    return TensorDataset(x[:1500] if split == "train" else x[1500:])


def loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    (x0,) = batch
    t = torch.rand(x0.shape[0])
    alpha = torch.cos(t * math.pi / 2) ** 2
    noise = torch.randn_like(x0)
    xt = alpha.sqrt()[:, None] * x0 + (1 - alpha).sqrt()[:, None] * noise
    return F.mse_loss(model(xt, t), noise)
