"""Radix lanes: small non-negative integers packed as the digits of one int64 in base R.

Why: bit lanes round a lane up to a power of two. The W-rank sum of block-scaled levels
takes W * M + 1 values — 13 for 4 levels at W=4 — and 4-bit lanes spend 4 bits on 3.7 bits
of information. Seventeen base-13 digits fit in one int64 (13^17 < 2^63): 3.76 bits per
element instead of 4, which is what takes 4-level bq past 8x fewer bytes than FP32 at W=4.

Exactness is the same argument as for bit lanes: each rank's digit is at most M, so the
W-rank sum of a digit is at most W * M = R - 1 and never carries into the next digit, and
the whole sum stays below R^k <= 2^63, so an int64 SUM all-reduce (ring, tree, gloo, NCCL)
adds every digit exactly.

Element order: element i is digit (i mod k) of container i // k (consecutive), or, in a
*chunked* layout (`chunk` > 0, `chunked_radix_layout`: blockq's all-reduce), the order of
`lanes.chunked_layout`: in the chunk of g containers starting at container c0 (g = chunk, less
for the last), digit j of container c0 + i holds element k * c0 + j * g + i, so each digit of a
chunk is a contiguous row of elements. Torch ops only, so the same code runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache, lru_cache

import torch

from nfab.wire.qsum.lanes import CHUNK, chunk_rows

_LIMIT = 1 << 63
"""A container's sum stays below R^k, which must not exceed 2^63 (int64's positive range + 1)."""


@dataclass(frozen=True, slots=True)
class RadixLayout:
    """Base-`radix` digits, `digits` per int64 container."""

    radix: int
    digits: int
    storage_bits: int = 64
    chunk: int = 0
    """Containers per chunk of the chunked element order (module docstring); 0: consecutive."""

    @property
    def max_value(self) -> int:
        """Largest value one digit holds (and so the largest W-rank sum)."""
        return self.radix - 1

    @property
    def bits_per_element(self) -> float:
        return self.storage_bits / self.digits

    def containers_for(self, numel: int) -> int:
        return -(-numel // self.digits)


@cache
def radix_layout(radix: int) -> RadixLayout:
    """As many base-`radix` digits per int64 as keep every sum below 2^63."""
    if radix < 2:
        raise ValueError(f"radix must be >= 2, got {radix}")
    k, p = 0, 1
    while p * radix <= _LIMIT:
        p *= radix
        k += 1
    return RadixLayout(radix, k)


@cache
def chunked_radix_layout(radix: int) -> RadixLayout:
    """`radix_layout(radix)` in the chunked element order, `lanes.CHUNK` containers a chunk."""
    return replace(radix_layout(radix), chunk=CHUNK)


@lru_cache(maxsize=64)
def _powers(radix: int, digits: int, device: torch.device) -> torch.Tensor:
    """R^0 .. R^(k-1) as int64 on `device`: made on the host once and copied without waiting."""
    powers = torch.tensor([radix**j for j in range(digits)], dtype=torch.int64, device="cpu")
    return powers.to(device, non_blocking=True)


def pack(values: torch.Tensor, layout: RadixLayout) -> torch.Tensor:
    """int64 containers holding `values` (each in 0..radix-1) as base-R digits.

    Horner's rule over the (containers, digits) view, in place on one int64 column: k - 1
    multiply-adds on a container each, not an int64 copy of every digit times its power
    (the same integers: every partial sum stays below R^k <= 2^63)."""
    n, k = values.numel(), layout.digits
    m = layout.containers_for(n)
    flat = values.reshape(-1)
    if n < m * k:
        flat = torch.cat([flat, flat.new_zeros(m * k - n)])
    if layout.chunk:  # per view of chunks: each row of digits times its power, summed (exact: below R^k)
        out = torch.empty(m, dtype=torch.int64, device=flat.device)
        powers = _powers(layout.radix, k, flat.device).view(1, k, 1)
        for c0, rows in chunk_rows(flat, k, layout.chunk, m):
            dest = out[c0 : c0 + rows.shape[0] * rows.shape[2]].view(rows.shape[0], rows.shape[2])
            torch.sum(rows.to(torch.int64) * powers, 1, out=dest)
        return out
    grid = flat.view(m, k)
    acc = grid[:, k - 1].to(torch.int64, copy=True)  # a copy: never the caller's int64 values
    for j in range(k - 2, -1, -1):
        acc.mul_(layout.radix).add_(grid[:, j])
    return acc


EXACT_RADIX = 1 << 20
"""Below this radix the digits come out of float64 arithmetic exactly (see `unpack`)."""


def unpack(containers: torch.Tensor, layout: RadixLayout, numel: int,
           dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The first `numel` digits of the (summed) containers, in element order (`dtype`: int64, or
    a float type that holds R - 1 exactly).

    Each container is split once in int64 into two halves below 2^33 (c = hi * R^h + lo); their
    digits then come from float64 division, which vectorises where integer division does not
    (torch's int64 remainder ran one scalar `idiv` per digit). Exact: for p < 2^33 and R < 2^20,
    fl(p / R) lies within half an ulp (< 2^-20 < 1/R) of p/R, whose fraction is at most
    1 - 1/R, so its floor is the true quotient; products and differences of whole numbers
    below 2^53 are exact."""
    c = containers.reshape(-1)
    m, k, r = c.numel(), layout.digits, layout.radix
    out = torch.empty(m, k, dtype=dtype, device=c.device)
    if r >= EXACT_RADIX:  # never chosen by any layout in use: the integer path, kept exact
        rest = c.clone()
        for j in range(k):
            out[:, j] = torch.remainder(rest, r)
            rest.floor_divide_(r)
        return _element_order(out, layout)[:numel]
    h = (k + 1) // 2
    hi = torch.div(c, r**h, rounding_mode="floor")
    lo = (c - hi * r**h).to(torch.float64)
    for part, first, count in ((lo, 0, h), (hi.to(torch.float64), h, k - h)):
        q = torch.empty_like(part)
        for j in range(first, first + count):
            torch.div(part, r, out=q).floor_()
            out[:, j].copy_(part.sub_(q, alpha=r))  # the digit: part - R * floor(part / R)
            part, q = q, part
    return _element_order(out, layout)[:numel]


def _element_order(digits: torch.Tensor, layout: RadixLayout) -> torch.Tensor:
    """The (containers, k) digits as a flat tensor in `layout`'s element order."""
    if not layout.chunk:
        return digits.view(-1)
    m, k = digits.shape
    flat = torch.empty(m * k, dtype=digits.dtype, device=digits.device)
    for c0, rows in chunk_rows(flat, k, layout.chunk, m):
        q, g = rows.shape[0], rows.shape[2]
        rows.copy_(digits[c0 : c0 + q * g].view(q, g, k).transpose(1, 2))
    return flat
