"""blockq's chunked containers (bit lanes and radix digits) as traced functions for `torch.compile`.

In the chunked order (`lanes.chunked_layout`, `radix.chunked_radix_layout`) lane or digit l of a
chunk's containers is a contiguous row of elements, and with 64 containers a chunk (`lanes.CHUNK`)
each row is one 64-element scale block where the chunk starts a block view. So:

- packing reads `k` contiguous rows and writes a row of containers (`radix_rows_fn`: Horner's
  rule per container; bit lanes: `qsum.chunks`), and the encode computes those rows' levels from
  x in the same kernel (`packed_levels_fn`): the levels are never stored;
- the decode reads the containers and writes the bucket in one kernel (`scaled_lanes_fn`,
  `scaled_digits_fn`): the sums are never stored.

A radix container is split once into P parts of d digits each (`radix_parts_fn`; d the most
digits whose values stay below 2^22, `part_digits`: 5 for base 13, 7 for base 7), each part
exact in float32; digit j of part v is then floor((v + 0.5) R^-j') - R floor((v + 0.5) R^-(j'+1))
(j' its place in the part), exact in float32: v + 0.5 < 2^22 is exact, the two roundings (of
R^-j' and of the product) err by less than 2^-23 (v + 0.5) R^-j' < 0.5 R^-j', and (v + 0.5) R^-j'
lies at least 0.5 R^-j' from an integer. So the same integers as `radix.unpack`, row by row with
each row's two inverse powers broadcast (`digit_powers`): every load and store contiguous, 16
float32 lanes a vector where float64 halves ran 8 (1.5-1.7 ms per 4M elements on one core).
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

    radix_, digits_ = fusion.static(layout.radix), fusion.static(layout.digits)  # registered outside the trace

    def radix_rows(out: torch.Tensor, values: torch.Tensor) -> None:
        r, k = fusion.static(radix_), fusion.static(digits_)
        acc = qsum_chunks.widened(values[:, k - 1], torch.int64)
        for j in range(k - 2, -1, -1):
            acc = acc * r + qsum_chunks.widened(values[:, j], torch.int64)
        out.copy_(acc)

    return radix_rows


PART_LIMIT = 1 << 22
"""Parts of a radix container stay below this: exact in float32 with room for `chunk_digits`' bound."""


def part_digits(radix: int) -> int:
    """Digits per part: the most whose values (below R^d) stay below `PART_LIMIT`."""
    d = 1
    while radix ** (d + 1) <= PART_LIMIT:
        d += 1
    return d


@cache
def radix_parts_fn(layout: RadixLayout):
    """(chunks, g) int64 containers -> P (chunks, g) float32 tensors: each container's parts of d digits
    (`part_digits`), lowest first, each peeled off as c = hi * R^d + lo with the quotient from a
    float64 product corrected by one each way (R^d >= 2^13 for every layout here, so the product
    errs by less than one; `fused.radix_unpack_fn` has the argument)."""
    d = part_digits(layout.radix)
    count, base = -(-layout.digits // d), fusion.static(layout.radix**d)  # registered outside the trace

    def radix_parts(c: torch.Tensor, inverse: torch.Tensor) -> tuple[torch.Tensor, ...]:
        unit = fusion.static(base)
        parts, rest = [], c
        for _ in range(fusion.static(count) - 1):
            hi = (rest.to(torch.float64) * inverse).to(torch.int64)
            lo = rest - hi * unit
            under = lo < 0
            lo, hi = torch.where(under, lo + unit, lo), torch.where(under, hi - 1, hi)
            over = lo >= unit
            lo, hi = torch.where(over, lo - unit, lo), torch.where(over, hi + 1, hi)
            parts.append(lo.to(torch.float32))
            rest = hi
        parts.append(rest.to(torch.float32))
        return tuple(parts)  # one kernel storing P rows (stacked, each row recomputed the splits below it)

    return radix_parts


def chunk_digits(parts: tuple[torch.Tensor, ...], powers: torch.Tensor, digits: int, per_part: int,
                 radix: float) -> torch.Tensor:
    """The (chunks, digits, g) digits (float32 whole numbers) of containers split into `parts`
    (`radix_parts_fn`); `powers` (2, digits) float32: each digit's two inverse powers
    (`digit_powers`). Traced (`digits`, `per_part`, `radix`: constants of the builder's closure)."""
    k, d = fusion.static(digits), fusion.static(per_part)
    place = torch.arange(k, device=parts[0].device).view(1, -1, 1)
    v = parts[0].unsqueeze(1)
    for i in range(1, -(-k // d)):
        v = torch.where(place >= i * d, parts[i].unsqueeze(1), v)
    v = v + 0.5
    return torch.floor(v * powers[0].view(1, -1, 1)) - torch.floor(v * powers[1].view(1, -1, 1)) * radix


@lru_cache(maxsize=64)
def digit_powers(radix: int, digits: int, device: torch.device) -> torch.Tensor:
    """(2, digits) float32 on `device`: for digit j, R^-j' and R^-(j'+1), j' its place in its part
    (`part_digits`); made once."""
    d = part_digits(radix)
    rows = [[1.0 / radix ** (j % d) for j in range(digits)], [1.0 / radix ** (j % d + 1) for j in range(digits)]]
    return torch.tensor(rows, dtype=torch.float32, device="cpu").to(device, non_blocking=True)


@lru_cache(maxsize=64)
def inverse_part(radix: int, device: torch.device) -> torch.Tensor:
    """0-d float64 R^-d on `device` (`radix_parts_fn`'s quotient factor); made once."""
    return torch.tensor(1.0 / radix ** part_digits(radix), dtype=torch.float64, device="cpu").to(
        device, non_blocking=True)


@cache
def radix_digits_fn(layout: RadixLayout):
    """The (chunks, digits, g) digits (uint8 / int32 `out`) of split containers (one graph per layout)."""

    k, d, r = layout.digits, part_digits(layout.radix), float(layout.radix)

    def radix_digit_rows(out: torch.Tensor, powers: torch.Tensor, *parts: torch.Tensor) -> None:
        out.copy_(chunk_digits(parts, powers, k, d, r).to(torch.int32).to(out.dtype))

    return radix_digit_rows


@cache
def packed_levels_fn(layout: LaneLayout | RadixLayout):
    """The containers (chunks, g) of whole chunks whose lane or digit rows are blocks, straight from
    the bucket's values x (chunks, k, block) and the rows' `fused.row_terms` (each (chunks, k, 1)):
    each row's levels (`fusion.levels_of`, the level kernel's arithmetic) shifted into its lane, or
    added by Horner's rule as a digit, in registers. The levels are never stored: for bit lanes 1.8
    ms per 4M elements on one CPU core against 1.8 + 0.3 for the level kernel and the packing apart
    (k level terms, each a contiguous row; a sum over a short inner dimension vectorised badly);
    for radix digits about even on the CPU (Horner's int64 products); on a GPU, two bytes per
    element less memory traffic (the levels' store and load) and a launch fewer."""
    radix_ = isinstance(layout, RadixLayout)
    k = fusion.static(layout.digits if radix_ else layout.lanes)
    step = fusion.static(layout.radix if radix_ else layout.lane_bits)  # registered outside the trace
    # uint8 containers are built in int32 and narrowed once by the store: in uint8, inductor's C++ shifted
    # and ORed lane by lane more slowly (bq3 at W=2, 4M elements on one core: 2.27-2.41 ms -> 1.98-2.0)
    container = torch.int64 if radix_ else layout.container if layout.container.itemsize >= 4 else torch.int32

    def packed_levels(out: torch.Tensor, x: torch.Tensor, safe: torch.Tensor, base: torch.Tensor, hi: torch.Tensor,
                      shift: torch.Tensor, half_m: torch.Tensor, m: torch.Tensor, weyl: torch.Tensor) -> None:
        lanes, s = fusion.static(k), fusion.static(step)

        def level(row: int) -> torch.Tensor:
            counters = (base[:, row] + weyl) ^ hi[:, row]
            return fusion.levels_of(x[:, row], safe[:, row], counters, shift, half_m, m).to(container)

        if radix_:  # exact: every partial sum stays below R^k <= 2^63
            acc = level(lanes - 1)
            for j in range(lanes - 2, -1, -1):
                acc = acc * s + level(j)
        else:
            acc = level(0)
            for lane in range(1, lanes):
                acc = acc | (level(lane) << (lane * s))
        out.copy_(acc)

    return packed_levels


def unit_scaled(sums: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """(S * unit - 1) * scale in fp32, in that order (the eager `unit_values`, then `scale_blocks_`),
    each row of `sums` scaled by its code's scale (`codes_` one dimension short of `sums`)."""
    return (sums.to(torch.float32) * unit - 1.0) * scales[codes_.to(torch.int64)].unsqueeze(-1)


@cache
def scaled_lanes_fn(layout: LaneLayout):
    """The decoded mean of whole chunks of chunked bit lanes whose lane rows are blocks: out (chunks,
    lanes, block) fp32 from the containers (chunks, block) and the rows' codes (chunks, lanes)."""

    def scaled_lanes(out: torch.Tensor, c: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor,
                     unit: torch.Tensor) -> None:
        out.copy_(unit_scaled(qsum_chunks.lane_values(c, layout), codes_, scales, unit))

    return scaled_lanes


@cache
def packed_rest_fn(layout: LaneLayout, block: int):
    """The containers (m,) of a bucket's last, partial chunk of bit lanes straight from its n values x
    (n <= m * lanes; consecutive blocks of one segment, their `fused.row_terms` rows (blocks, 1) each):
    what `fused.levels_into` per block view and then `pack_into` make, in one graph. Element e is
    lane e // m of container e % m (the chunked order, `lanes.chunk_rows`) and lies in block e // block;
    elements past n are zero lanes, as `pack_into` pads. Why: that rest was 2-3 stage calls and a
    padding op per bucket each way (bq4 at W=2, the last 256 of 4M elements: 0.34 ms on a CPU core
    in four calls, nearly all host time; now 0.24 in two)."""
    k, s, b = fusion.static(layout.lanes), fusion.static(layout.lane_bits), fusion.static(block)
    work = layout.container if layout.container.itemsize >= 4 else torch.int32  # as `packed_levels_fn`

    def packed_rest(out: torch.Tensor, x: torch.Tensor, safe: torch.Tensor, base: torch.Tensor, hi: torch.Tensor,
                    shift: torch.Tensor, half_m: torch.Tensor, m: torch.Tensor, weyl: torch.Tensor) -> None:
        n, total = x.shape[0], out.shape[0] * fusion.static(k)
        e = torch.arange(total, device=x.device)
        row = torch.clamp(e // fusion.static(b), max=safe.shape[0] - 1)  # past n: any row, the lane is zeroed
        values = torch.nn.functional.pad(x.to(torch.float32), (0, total - n))
        counters = (base[row, 0] + weyl[e % fusion.static(b)]) ^ hi[row, 0]
        levels = torch.where(e < n, fusion.levels_of(values, safe[row, 0], counters, shift, half_m, m), 0)
        lanes = levels.to(work).view(fusion.static(k), -1)
        acc = lanes[0]
        for lane in range(1, fusion.static(k)):
            acc = acc | (lanes[lane] << (lane * fusion.static(s)))
        out.copy_(acc)

    return packed_rest


@cache
def scaled_rest_fn(layout: LaneLayout, block: int):
    """The decoded mean of a bucket's last, partial chunk of bit lanes (`packed_rest_fn`'s containers
    c, its blocks' `codes_`): out (n,) = (S * unit - 1) * scale of element e's block, in one graph where
    `unpack` and then a scaling per block view were two to three stages."""
    b = fusion.static(block)

    def scaled_rest(out: torch.Tensor, c: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor,
                    unit: torch.Tensor) -> None:
        n = out.shape[0]
        sums = qsum_chunks.lane_values(c.view(1, -1), layout).reshape(-1)[:n]
        row = torch.arange(n, device=c.device) // fusion.static(b)
        out.copy_((sums.to(torch.float32) * unit - 1.0) * scales[codes_[row].to(torch.int64)])

    return scaled_rest


@cache
def scaled_digits_fn(layout: RadixLayout):
    """`scaled_lanes_fn` for radix digits, from the split containers (`radix_parts_fn`)."""

    k, d, r = layout.digits, part_digits(layout.radix), float(layout.radix)

    def scaled_digits(out: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor, unit: torch.Tensor,
                      powers: torch.Tensor, *parts: torch.Tensor) -> None:
        out.copy_(unit_scaled(chunk_digits(parts, powers, k, d, r), codes_, scales, unit))

    return scaled_digits


def digit_width(layout: RadixLayout) -> torch.dtype:
    """The dtype of an unpacked digit: uint8 up to radix 256, else int32."""
    return torch.uint8 if layout.radix <= 256 else torch.int32


def pack_radix(values: torch.Tensor, layout: RadixLayout) -> torch.Tensor | None:
    """`radix.pack` of a chunked layout (compiled), or None when compiling failed."""
    return pack_into(values, layout)


def pack_into(values: torch.Tensor, layout: LaneLayout | RadixLayout,
              out: torch.Tensor | None = None) -> torch.Tensor | None:
    """`lanes.pack` / `radix.pack` of a chunked layout (compiled; into `out` when given), or None when
    compiling failed."""
    if isinstance(layout, RadixLayout):
        return qsum_chunks.pack_chunks(values, layout.digits, layout.chunk, torch.int64, radix_rows_fn(layout), out)
    return qsum_chunks.pack_chunks(values, layout.lanes, layout.chunk, layout.container,
                                   qsum_chunks.pack_rows_fn(layout), out)


def parts_of(c: torch.Tensor, layout: RadixLayout) -> tuple[torch.Tensor, ...] | None:
    """`radix_parts_fn` of (chunks, g) containers (compiled), or None when compiling failed."""
    return fusion.run(radix_parts_fn(layout), c, inverse_part(layout.radix, c.device))


def unpack_radix(c: torch.Tensor, layout: RadixLayout) -> torch.Tensor | None:
    """The m * digits digits (`digit_width`, element order) of the m containers `c` of a chunked
    layout (compiled), or None when compiling failed: per view of whole chunks, the split
    (`parts_of`), then the digits' rows (`radix_digits_fn`)."""
    flat = c.reshape(-1)
    out = torch.empty(flat.numel() * layout.digits, dtype=digit_width(layout), device=flat.device)
    powers = digit_powers(layout.radix, layout.digits, flat.device)
    for c0, rows in chunk_rows(out, layout.digits, layout.chunk, flat.numel()):
        parts = parts_of(flat[c0 : c0 + rows.shape[0] * rows.shape[2]].view(rows.shape[0], rows.shape[2]), layout)
        if parts is None or fusion.run(radix_digits_fn(layout), rows, powers, *parts) is None and fusion.failed():
            return None
    return out
