"""Codecs: how one rank turns an fp32 gradient into something smaller, and back.

Pure functions over torch tensors (any device). The reducers in `reducers.py` compose
these with lane packing and collectives. Route names are the user's vocabulary:
`fp32`, `bf16`, `fp16`, `q8`, `q4`, `q2` and `sign`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ROUTES: tuple[str, ...] = ("fp32", "bf16", "fp16", "q8", "q4", "q2", "sign")
"""Every route a profile or a user may name, cheapest-last is NOT implied."""


@dataclass(frozen=True, slots=True)
class Codec:
    """A route's codec: its name, nominal bits per element, and whether it loses information."""

    name: str
    bits: int
    lossy: bool


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", 32, lossy=False),
    "bf16": Codec("bf16", 16, lossy=True),
    "fp16": Codec("fp16", 16, lossy=True),
    "q8": Codec("q8", 8, lossy=True),
    "q4": Codec("q4", 4, lossy=True),
    "q2": Codec("q2", 2, lossy=True),
    "sign": Codec("sign", 1, lossy=True),
}


def segment_mean_abs(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Mean |x| over each consecutive segment of `x` (one scale per parameter slice).

    A per-parameter scale keeps a large conv kernel's magnitude from swamping a small
    one's when both ride in the same bucket.
    """
    parts = torch.split(x, list(lengths))
    out = torch.empty(len(parts), dtype=torch.float32, device=x.device)
    for i, part in enumerate(parts):
        out[i] = torch.linalg.vector_norm(part, 1) / max(part.numel(), 1)
    return out


def segment_max_abs(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """max |x| over each consecutive segment of `x`."""
    parts = torch.split(x, list(lengths))
    out = torch.zeros(len(parts), dtype=torch.float32, device=x.device)
    for i, part in enumerate(parts):
        if part.numel():
            out[i] = torch.linalg.vector_norm(part, float("inf"))
    return out


def scale_segments_(x: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Multiply each segment of `x` in place by its scale; returns `x`."""
    for part, s in zip(torch.split(x, list(lengths)), scales.tolist(), strict=True):
        part.mul_(s)
    return x


def sign_bits(x: torch.Tensor) -> torch.Tensor:
    """One vote per element: True where x >= 0 (a zero votes positive, as in signSGD)."""
    return x >= 0


def vote_table(world_size: int, vote: str, device: torch.device | None = None) -> torch.Tensor:
    """Decode table from a positive count c in [0, W] to a vote value.

    `majority`: sign(2c - W), a tie (even W, c = W/2) decodes to 0.
    `mean`: (2c - W) / W, the average of the ranks' +-1 votes.
    """
    c = torch.arange(world_size + 1, dtype=torch.float32, device=device)
    diff = 2 * c - world_size
    if vote == "majority":
        return torch.sign(diff)
    if vote == "mean":
        return diff / world_size
    raise ValueError(f"unknown vote {vote!r}: use 'majority' or 'mean'")


def stochastic_levels(
    x: torch.Tensor, scale: torch.Tensor, max_level: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Stochastically round x onto the grid {0..M} that spans [-scale, +scale].

    Level v stands for scale * (2v/M - 1). Rounding up with probability equal to the
    fractional part makes the code unbiased: E[decoded] = x for |x| <= scale.
    `scale` is per element (already expanded). Returns int32 levels.
    """
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    t = (x / safe + 1.0) * (0.5 * max_level)
    noise = torch.rand(t.shape, generator=generator, device=t.device, dtype=t.dtype)
    return torch.floor(t + noise).clamp_(0, max_level).to(torch.int32)


def levels_to_values(
    levels: torch.Tensor, scale: torch.Tensor, max_level: int, count: int = 1
) -> torch.Tensor:
    """Decode a (summed over `count` ranks) level back to the mean value per element."""
    return scale * (levels.to(torch.float32) * (2.0 / (max_level * count)) - 1.0)
