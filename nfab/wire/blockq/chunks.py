"""blockq's chunked containers (bit lanes and radix digits) as traced functions for `torch.compile`.

In the chunked order (`lanes.chunked_layout`, `radix.chunked_radix_layout`) lane or digit l of a
chunk's containers is a contiguous row of elements, and with 64 containers a chunk (`lanes.CHUNK`)
each row is one 64-element scale block where the chunk starts a block view. So:

- packing reads `k` contiguous rows and writes a row of containers (`radix_rows_fn`: Horner's
  rule per container; bit lanes: `qsum.chunks`);
- the decode reads the containers and writes the bucket in one kernel (`scaled_lanes_fn`,
  `scaled_digits_fn`): the sums are never stored.

A radix container is split once into two float64 halves (`radix_halves_fn`, the split of
`fused.radix_unpack_fn`: below 2^51 each), then digit j of a half v is
floor((v + 0.5) R^-j) - R floor((v + 0.5) R^-(j+1)), exact for v < 2^51 (`fused.radix_unpack_fn`
has the argument): the same integers as `radix.unpack`, computed row by row with each row's two
inverse powers broadcast (`digit_powers`), so every load and store is contiguous.
"""

from __future__ import annotations

from functools import cache, lru_cache

import torch

from nfab.wire import fusion
from nfab.wire.blockq.radix import RadixLayout
from nfab.wire.qsum import chunks as qsum_chunks
from nfab.wire.qsum.lanes import LaneLayout, chunk_rows


@cache
def radix_rows_fn(layout: RadixLayout):
    """(chunks, g) int64 containers from the (chunks, digits, g) digits of whole chunks, Horner's rule
    per container (exact: every partial sum stays below R^k <= 2^63)."""

    radix_, digits_ = layout.radix, layout.digits

    def radix_rows(out: torch.Tensor, values: torch.Tensor) -> None:
        r, k = fusion.static(radix_), fusion.static(digits_)
        acc = qsum_chunks.widened(values[:, k - 1], torch.int64)
        for j in range(k - 2, -1, -1):
            acc = acc * r + qsum_chunks.widened(values[:, j], torch.int64)
        out.copy_(acc)

    return radix_rows


@cache
def radix_halves_fn(layout: RadixLayout):
    """(chunks, g) int64 containers -> (chunks, 2, g) float64: each container's low and high parts
    (c = hi * R^h + lo, h = k // 2) plus 0.5, the split of `fused.radix_unpack_fn`."""

    split = layout.radix ** (layout.digits // 2)  # a Python int here: traced, the power went symbolic

    def radix_halves(c: torch.Tensor, inv_split: torch.Tensor) -> torch.Tensor:
        base = fusion.static(split)
        hi = (c.to(torch.float64) * inv_split).to(torch.int64)
        lo = c - hi * base
        under = lo < 0
        lo, hi = torch.where(under, lo + base, lo), torch.where(under, hi - 1, hi)
        over = lo >= base
        lo, hi = torch.where(over, lo - base, lo), torch.where(over, hi + 1, hi)
        return torch.stack([lo.to(torch.float64) + 0.5, hi.to(torch.float64) + 0.5], 1)

    return radix_halves


def chunk_digits(halves: torch.Tensor, powers: torch.Tensor, digits: int, radix: float) -> torch.Tensor:
    """The (chunks, digits, g) digits (float64 whole numbers) of containers split into `halves`
    (`radix_halves_fn`); `powers` (2, digits) float64: each digit's two inverse powers
    (`digit_powers`). Traced (`digits`, `radix`: constants of the builder's closure)."""
    k, h = fusion.static(digits), fusion.static(digits // 2)
    low = torch.arange(k, device=halves.device).view(1, -1, 1) < h
    part = torch.where(low, halves[:, :1], halves[:, 1:])
    return torch.floor(part * powers[0].view(1, -1, 1)) - torch.floor(part * powers[1].view(1, -1, 1)) * radix


@lru_cache(maxsize=64)
def digit_powers(radix: int, digits: int, device: torch.device) -> torch.Tensor:
    """(2, digits) float64 on `device`: for digit j, R^-j' and R^-(j'+1), j' its place in its half
    (j below k // 2: the low half, else j - k // 2); made once."""
    h = digits // 2
    places = [j if j < h else j - h for j in range(digits)]
    rows = [[1.0 / radix**p for p in places], [1.0 / radix ** (p + 1) for p in places]]
    return torch.tensor(rows, dtype=torch.float64, device="cpu").to(device, non_blocking=True)


@lru_cache(maxsize=64)
def inverse_split(radix: int, digits: int, device: torch.device) -> torch.Tensor:
    """0-d float64 R^-(k // 2) on `device` (`radix_halves_fn`'s quotient factor); made once."""
    return torch.tensor(1.0 / radix ** (digits // 2), dtype=torch.float64, device="cpu").to(device, non_blocking=True)


@cache
def radix_digits_fn(layout: RadixLayout):
    """The (chunks, digits, g) digits (uint8 / int32 `out`) of split containers (one graph per layout)."""

    k, r = layout.digits, float(layout.radix)

    def radix_digit_rows(out: torch.Tensor, halves: torch.Tensor, powers: torch.Tensor) -> None:
        out.copy_(chunk_digits(halves, powers, k, r).to(torch.int32).to(out.dtype))

    return radix_digit_rows


def _unit_scaled(sums: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """(S * unit - 1) * scale in fp32, the scale each row's code's (`fused.unit_scaled_into`'s order)."""
    return (sums.to(torch.float32) * unit - 1.0) * scales[codes_.to(torch.int64)].unsqueeze(2)


@cache
def scaled_lanes_fn(layout: LaneLayout):
    """The decoded mean of whole chunks of chunked bit lanes whose lane rows are blocks: out (chunks,
    lanes, block) fp32 from the containers (chunks, block) and the rows' codes (chunks, lanes)."""

    def scaled_lanes(out: torch.Tensor, c: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor,
                     unit: torch.Tensor) -> None:
        out.copy_(_unit_scaled(qsum_chunks.lane_values(c, layout), codes_, scales, unit))

    return scaled_lanes


@cache
def scaled_digits_fn(layout: RadixLayout):
    """`scaled_lanes_fn` for radix digits, from the split containers (`radix_halves_fn`)."""

    k, r = layout.digits, float(layout.radix)

    def scaled_digits(out: torch.Tensor, halves: torch.Tensor, powers: torch.Tensor, codes_: torch.Tensor,
                      scales: torch.Tensor, unit: torch.Tensor) -> None:
        out.copy_(_unit_scaled(chunk_digits(halves, powers, k, r), codes_, scales, unit))

    return scaled_digits


def digit_width(layout: RadixLayout) -> torch.dtype:
    """The dtype of an unpacked digit: uint8 up to radix 256, else int32."""
    return torch.uint8 if layout.radix <= 256 else torch.int32


def pack_radix(values: torch.Tensor, layout: RadixLayout) -> torch.Tensor | None:
    """`radix.pack` of a chunked layout (compiled), or None when compiling failed."""
    return qsum_chunks.pack_chunks(values, layout.digits, layout.chunk, torch.int64, radix_rows_fn(layout))


def halves_of(c: torch.Tensor, layout: RadixLayout) -> torch.Tensor | None:
    """`radix_halves_fn` of (chunks, g) containers (compiled), or None when compiling failed."""
    return fusion.run(radix_halves_fn(layout), c, inverse_split(layout.radix, layout.digits, c.device))


def unpack_radix(c: torch.Tensor, layout: RadixLayout) -> torch.Tensor | None:
    """The m * digits digits (`digit_width`, element order) of the m containers `c` of a chunked
    layout (compiled), or None when compiling failed: per view of whole chunks, the split
    (`halves_of`), then the digits' rows (`radix_digits_fn`)."""
    flat = c.reshape(-1)
    out = torch.empty(flat.numel() * layout.digits, dtype=digit_width(layout), device=flat.device)
    powers = digit_powers(layout.radix, layout.digits, flat.device)
    for c0, rows in chunk_rows(out, layout.digits, layout.chunk, flat.numel()):
        halves = halves_of(flat[c0 : c0 + rows.shape[0] * rows.shape[2]].view(rows.shape[0], rows.shape[2]), layout)
        if halves is None or fusion.run(radix_digits_fn(layout), rows, halves, powers) is None and fusion.failed():
            return None
    return out
