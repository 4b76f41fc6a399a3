"""A small model with every awkward feature, and a DDP twin harness for runtime tests.

The harness: a rank's own gradient without DDP (`local_grads`, from a deep copy), the
independent reference a sign route must reproduce (`sign_agrees`: every rank's vote,
all-reduced), and the replica check every multi-rank test ends with (`replicas_equal`)."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from nfab.runtime.frontends.ddp import Runtime


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


def local_grads(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], scale: float = 1.0,
                ) -> dict[str, torch.Tensor]:
    """This rank's gradient without DDP (a deep copy of `model`), accumulated over `batches` as
    DDP's no_sync does, of `scale` times the loss; by parameter name, grad-less ones left out."""
    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    for x, y in batches:
        (scale * loss_fn(twin, x, y).float()).backward()
    return {n: p.grad.clone() for n, p in twin.named_parameters() if p.grad is not None}


def sign_agrees(got: torch.Tensor, local: torch.Tensor, world_size: int) -> bool:
    """Whether a sign route's decoded gradient `got` (no residual carried) has the sign of the ranks'
    majority vote on their `local` gradients (every rank calls it: one all-reduce); 0 is a tie (even
    W). An exact zero votes by group rank and the runtime's step (`codec.sign_bits`), which these
    loops need not track: where a rank's element is zero, either vote passes. The zeros'
    cancellation is checked on its own (`test_sign_zeros_dist.py`)."""
    counts = torch.stack([local > 0, local == 0]).to(torch.int64)
    dist.all_reduce(counts)
    low = torch.sign(2.0 * counts[0] - world_size)  # every zero voted negative
    high = torch.sign(2.0 * (counts[0] + counts[1]) - world_size)  # every zero voted positive
    sign = torch.sign(got.float())
    return bool(((sign >= low) & (sign <= high)).all())


def replicas_equal(model: nn.Module, world_size: int) -> bool:
    """Whether every rank holds bit-identical parameters (every rank calls it: one all-gather)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], t) for t in every[1:])


class DefaultDeviceMeta(Runtime):
    """A Runtime whose hook bodies and callbacks run with the meta device as the default: an
    allocation that does not name the gradient's device fails (as a default-device allocation
    would on CUDA)."""

    def hook(self, bucket):  # noqa: ANN001, ANN201 - DDP's signature
        with torch.device("meta"):
            return super().hook(bucket)

    def _callback(self, *args):  # noqa: ANN002, ANN202
        with torch.device("meta"):
            return super()._callback(*args)
