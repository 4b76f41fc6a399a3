"""qsum's stages, and the lane packing every codec shares, as traced functions for `torch.compile`.

Why: eager, qsum's encode is a division, the level arithmetic, a dozen passes of counter hash
and a packing pass per lane; compiled (`wire/fusion.py`), one segment of one-lane containers
(q8) is one kernel that reads x and writes the containers (the noise computed in registers,
the levels never stored), and its decode one kernel that reads the containers and writes the
bucket slice.

`packed` and `unpacked_into` are the lanes of `lanes.pack` / `lanes.unpack` in traced ops, for
use inside other compiled graphs (sign's votes, blockq's levels): integer sums of values shifted
into disjoint bits, so the same containers in any order. Several lanes per container are packed
from stored levels and unpacked to stored sums (two kernels: reading x, or writing the bucket,
once per lane from strided columns ran 2x slower). The level arithmetic is the eager order,
`((x / s + 1) * (M / 2) + u)`, floor, clamp, and the decode `(S * unit - 1) * s`, contraction off.

Up to `MAX_SEGMENTS` segments run as one compiled call each (levels into a shared buffer, then
one packing kernel); more take the eager path (one gather pass beats a launch per segment).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from itertools import accumulate

import torch

from nfab.wire import fusion
from nfab.wire.qsum import words
from nfab.wire.qsum.lanes import LaneLayout

MAX_SEGMENTS = 8


def _blocks(layout: LaneLayout) -> tuple[tuple[int, int], ...]:
    """`layout.blocks` without its cache (traced code calls no cached function)."""
    if layout.container == torch.uint8:
        return ((0, layout.lanes),)
    return tuple((l0, min(l0 + 8, layout.lanes)) for l0 in range(0, layout.lanes, 8))


def packed(values: torch.Tensor, layout: LaneLayout) -> torch.Tensor:
    """`lanes.pack` of the 1-D non-negative integer tensor `values` (traced ops).

    Each lane is one strided column of a (containers, lanes) view, shifted and OR-ed in: inductor
    vectorises that over the containers (0.5-0.7x a copy on one core), where a sum over a short
    inner dimension of lanes ran scalar (0.05x)."""
    n = values.shape[0]
    per = layout.lanes
    m = (n + per - 1) // per
    work = torch.int32 if layout.container == torch.uint8 else layout.container
    v = torch.nn.functional.pad(values.to(work), (0, m * per - n))
    out = None
    for l0, l1 in _blocks(layout):
        grid = v[m * l0 : m * l1].view(m, l1 - l0)
        for lane in range(l0, l1):
            col = grid[:, lane - l0] << (lane * layout.lane_bits)
            out = col if out is None else out | col
    assert out is not None
    return out.to(layout.container)


def lane_dtype(layout: LaneLayout) -> torch.dtype:
    """The narrowest integer dtype that holds a lane value: uint8 up to 8-bit lanes."""
    if layout.lane_bits <= 8:
        return torch.uint8
    return torch.int32 if layout.lane_bits <= 31 else torch.int64


def unpacked_into(out: torch.Tensor, c: torch.Tensor, layout: LaneLayout, l0: int, l1: int) -> None:
    """Lanes [l0, l1) -- one block of `lanes.unpack` -- of the 1-D containers `c` into the (m, l1 - l0)
    `out` (`lane_dtype`), stacked as columns: one vectorised kernel (a 2-D shift over a short inner
    dimension of lanes ran scalar; the lanes narrowed to int32 before the stack, as int64 -> uint8
    per lane ran 7x slower)."""
    w = c.to(torch.int64 if c.dtype == torch.int64 else torch.int32)
    narrow = torch.int32 if layout.lane_bits <= 31 else torch.int64
    lanes = [((w >> (lane * layout.lane_bits)) & layout.max_value).to(narrow) for lane in range(l0, l1)]
    out.copy_(torch.stack(lanes, 1).to(out.dtype))


@cache
def unpack_fn(layout: LaneLayout, l0: int, l1: int):
    """`unpacked_into` for one block of one layout (one graph each)."""

    def unpack_block(out: torch.Tensor, c: torch.Tensor) -> None:
        unpacked_into(out, c, layout, l0, l1)

    return unpack_block


def unpack(c: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """The lane values of the 1-D containers `c` (compiled; `lane_dtype`, m * lanes of them: the
    caller reads the first numel), or None when compiling failed. 1-, 2- and 4-bit lanes of uint8
    containers as whole words (`words`), others block by block."""
    if words.fits(layout):
        return words.unpack(c, layout)
    m = c.numel()
    out = torch.empty(m * layout.lanes, dtype=lane_dtype(layout), device=c.device)
    for l0, l1 in _blocks(layout):  # a call per block: one graph writing every block's slice ran 8x slower
        fusion.run(unpack_fn(layout, l0, l1), out[m * l0 : m * l1].view(m, l1 - l0), c.reshape(-1))
        if fusion.failed():
            return None
    return out


@cache
def pack_fn(layout: LaneLayout):
    """`packed` for one layout as a function of its values alone (one graph per layout)."""

    def pack_lanes(values: torch.Tensor) -> torch.Tensor:
        return packed(values, layout)

    return pack_lanes


def pack(values: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """`lanes.pack` of the 1-D uint8 `values` (compiled), or None when compiling failed: 1-, 2- and
    4-bit lanes of uint8 containers as whole words (`words`), others lane by lane (`packed`)."""
    if words.fits(layout) and values.dtype == torch.uint8:
        return words.pack(values, layout)
    return fusion.run(pack_fn(layout), values)


def _levels(x: torch.Tensor, safe: torch.Tensor, key: torch.Tensor, first: torch.Tensor, half_m: torch.Tensor,
            m: torch.Tensor) -> torch.Tensor:
    """Levels (int32 in [0, M]) of the 1-D segment `x` whose element i hashes counter `first + i`
    (int32 `first` = 1 for a segment's start), `key` its int64 key (1 element)."""
    lo = fusion.as_i32(key & 0xFFFFFFFF)
    hi = fusion.as_i32((key >> 32) & 0xFFFFFFFF)
    i = torch.arange(x.shape[0], dtype=torch.int32, device=x.device) + first
    u = fusion.uniform_of((lo + i * fusion.GOLDEN_I32) ^ hi, torch.zeros_like(first))
    t = (x.to(torch.float32) / safe + 1.0) * half_m + u
    return torch.minimum(t.floor().clamp(min=0), m).to(torch.int32)


def levels_into(out: torch.Tensor, x: torch.Tensor, safe: torch.Tensor, key: torch.Tensor, first: torch.Tensor,
                half_m: torch.Tensor, m: torch.Tensor) -> None:
    """out (uint8) = the levels of one segment `x` (see `_levels`)."""
    out.copy_(_levels(x, safe, key, first, half_m, m).to(torch.uint8))


@cache
def encode_one_fn(layout: LaneLayout):
    """One segment's encode in one graph: levels straight into `layout`'s containers."""

    def encode_one(x: torch.Tensor, safe: torch.Tensor, key: torch.Tensor, first: torch.Tensor,
                   half_m: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return packed(_levels(x, safe, key, first, half_m, m), layout)

    return encode_one


@cache
def decode_one_fn(layout: LaneLayout):
    """One segment's decode of one-lane containers in one graph: out = (S * unit - 1) * scale."""

    def decode_one(out: torch.Tensor, c: torch.Tensor, unit: torch.Tensor, scale: torch.Tensor) -> None:
        out.copy_((c[: out.shape[0]].to(torch.float32) * unit - 1.0) * scale)

    return decode_one


def scaled_into(out: torch.Tensor, sums: torch.Tensor, unit: torch.Tensor, scale: torch.Tensor) -> None:
    """out = (S * unit - 1) * scale of the first out.numel() unpacked lane sums."""
    out.copy_((sums[: out.shape[0]].to(torch.float32) * unit - 1.0) * scale)


def encode(x: torch.Tensor, safe: torch.Tensor, keys: torch.Tensor, lengths: Sequence[int], m: int,
           layout: LaneLayout) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(payload, levels or None) of qsum's encode by compiled stages: the same containers as
    `QSum._levels_reference`; the levels are returned only when they were stored (several
    segments). None when not compiled here (too many segments, a compile error)."""
    lengths = list(lengths)
    if not lengths or len(lengths) > MAX_SEGMENTS or not x.is_contiguous():
        return None
    dev = x.device
    flat = x.reshape(-1)
    first = fusion.int_constant(1, dev)
    half_m, top = fusion.constant(0.5 * m, dev), fusion.constant(float(m), dev)
    safe = safe.reshape(-1).to(torch.float32)
    if len(lengths) == 1 and layout.lanes == 1:
        payload = fusion.run(encode_one_fn(layout), flat, safe[:1], keys[:1], first, half_m, top)
        return None if payload is None else (payload, None)
    levels = torch.empty(flat.numel(), dtype=torch.uint8, device=dev)
    for s, (a, n) in enumerate(zip(accumulate([0, *lengths[:-1]]), lengths, strict=True)):
        if n == 0:
            continue
        seg = slice(a, a + n)
        fusion.run(levels_into, levels[seg], flat[seg], safe[s : s + 1], keys[s : s + 1], first, half_m, top)
        if fusion.failed():
            return None
    payload = pack(levels, layout)
    return None if payload is None else (payload, levels)


def decode(reduced: torch.Tensor, layout: LaneLayout, numel: int, unit: float, scale: torch.Tensor,
           out: torch.Tensor | None) -> torch.Tensor | None:
    """One segment's decoded mean (fp32, into `out` when given): the same bits as `decode_scaled`'s
    table of `levels * unit - 1` times the scale. One-lane containers in one kernel; several lanes
    unpacked first (`unpack`), then scaled. None when compiling failed."""
    dev = reduced.device
    res = out.view(-1) if out is not None else torch.empty(numel, dtype=torch.float32, device=dev)
    args = (fusion.constant(unit, dev), scale.reshape(-1)[:1].to(torch.float32))
    if layout.lanes == 1:
        fusion.run(decode_one_fn(layout), res, reduced.reshape(-1), *args)
    elif (sums := unpack(reduced, layout)) is not None:
        fusion.run(scaled_into, res, sums, *args)
    return None if fusion.failed() else res
