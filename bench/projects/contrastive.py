"""A contrastive two-tower model (InfoNCE): each sample is a dict of two noisy views of one digit."""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset


class Views(Dataset):
    """Two views of each digit (fixed per index: the noise is part of the data set)."""

    def __init__(self, split: str) -> None:
        x = torch.tensor(load_digits().data, dtype=torch.float32) / 16
        self.x = x[:1500] if split == "train" else x[1500:]
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.noise = 0.2 * torch.randn(2, *self.x.shape, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"a": self.x[i] + self.noise[0, i], "b": self.x[i] + self.noise[1, i]}


class TwoTower(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 64, embed: int = 32) -> None:
        super().__init__()
        self.tower_a = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, embed))
        self.tower_b = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, embed))
        self.log_temperature = nn.Parameter(torch.tensor(2.0))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the scale comes out of forward (as CLIP's logit_scale does): under DDP the loss sees the wrapper
        return F.normalize(self.tower_a(a), dim=-1), F.normalize(self.tower_b(b), dim=-1), self.log_temperature.exp()


def build() -> nn.Module:
    return TwoTower()


def data(split: str) -> Dataset:
    return Views(split)


def info_nce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    za, zb, scale = model(batch["a"], batch["b"])
    logits = za @ zb.T * scale
    labels = torch.arange(len(za))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
