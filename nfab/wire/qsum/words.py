"""uint8 lanes of 1, 2 or 4 bits packed and unpacked as whole machine words (SWAR), traced ops.

Why: inductor's CPU code for a column read 8 elements apart, or for a short inner dimension of
lanes, runs scalar (3.6 ms to pack 4M votes into bits: 0.1x a copy). Eight consecutive values,
one per byte, read as one int64 are a word whose bytes can be moved together with a handful of
shifts, masks and at most one multiply per word, every load and store contiguous.

Layout (`lanes.pack`'s, uint8 containers): element i sits in lane i % L of container i // L, so
the 8 values of a little-endian int64 word fill 8 / L containers (L = 8 / lane_bits lanes):

- packing (`lanes_of_bytes`): the values are pulled together by halving steps -- byte pairs
  into 16-bit units, those into 32, those into the word's low 8 * lane_bits bits -- or, for
  1-bit values, by one multiply (`GATHER8`: byte k's low bit lands at bit 56 + k, and no carry
  reaches the top byte); `pack` takes 2-bit values 4 at a time from int32 words (`quad_lanes`),
  whose one-byte result needs no int16 narrowing, which inductor's C++ runs scalar;
- unpacking (`bytes_of_lanes`): the inverse steps put lane k of a container into byte k of a
  wider word, and for 1-bit lanes a multiply copies the byte into all 8 bytes (`SPREAD8`), a
  mask keeps bit k in byte k, and adding 0x7F per byte carries it to the byte's top bit
  (`row_counts`, which sums W such rows: at most 255 per byte, no carry between bytes).

`tests/wire/test_fused_eager.py` holds every function here to `lanes.pack` / `lanes.unpack`.
"""

from __future__ import annotations

from functools import cache, lru_cache

import torch

from nfab.wire import fusion
from nfab.wire.qsum.lanes import LaneLayout

LANE_BITS = (1, 2, 4)
"""The uint8 lane widths these words serve (8, 4 or 2 lanes per byte)."""
GATHER8 = 0x0102040810204080
"""(w * GATHER8) >> 56: the low bits of w's 8 bytes (each 0 or 1) as one byte, byte k at bit k."""
SPREAD8 = 0x0101010101010101
"""b * SPREAD8 copies a byte b into each of a word's 8 bytes."""
BIT_K_OF_BYTE_K = 0x8040201008040201 - (1 << 64)
"""Keeps bit k of byte k (a signed int64 constant)."""
LOW7 = 0x7F7F7F7F7F7F7F7F
"""Added to bytes that are 0 or 2^k (k < 8): a byte's top bit is then set exactly when it was not 0."""
HIGH_BITS = 0x8080808080808080 - (1 << 64)


def fits(layout: LaneLayout) -> bool:
    """Whether `layout`'s containers are built and read as words here."""
    return layout.container == torch.uint8 and layout.lane_bits in LANE_BITS


def _word_dtype(lane_bits: int) -> torch.dtype:
    """The container bytes of 8 values: 1, 2 or 4 (uint8, int16, int32)."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[lane_bits]


def gathered_bits(words: torch.Tensor) -> torch.Tensor:
    """The low bits of each int64 word's 8 bytes (each 0 or 1) as one 8-bit value, byte k at bit k."""
    return ((words * GATHER8) >> 56) & 0xFF


def quad_lanes(words: torch.Tensor) -> torch.Tensor:
    """int32 words of 4 values below 4 -> their one uint8 container of 2-bit lanes (the 2-bit case
    of `lanes_of_bytes` on 32-bit words: its int16 result from int64 words narrowed scalar, 0.37 ms
    against 0.08 for 4M values)."""
    w = (words | (words >> 6)) & 0x000F000F
    return ((w | (w >> 12)) & 0xFF).to(torch.uint8)


def lanes_of_bytes(words: torch.Tensor, lane_bits: int) -> torch.Tensor:
    """int64 words of 8 values (bytes below 2^lane_bits) -> their containers as one `_word_dtype`
    word (`compressed`)."""
    if lane_bits == 1:
        return gathered_bits(words).to(torch.uint8)
    return compressed(words, lane_bits).to(_word_dtype(lane_bits))


def compressed(words: torch.Tensor, lane_bits: int) -> torch.Tensor:
    """int64 words of 8 values (bytes below 2^lane_bits, lane_bits <= 7) -> the 8 values side by side
    in the word's low 8 * lane_bits bits, value k at bit k * lane_bits (int64): byte pairs, then
    16-bit and 32-bit units, pulled together (values are below 2^7, so the arithmetic shifts are
    logical). Up to 4 bits a shifted copy of the word is masked once per step; wider values would
    spill into the next unit, so each unit's halves are masked apart first."""
    w, s = words, lane_bits
    for unit in (16, 32, 64):
        half, width = unit // 2, s * unit // 16  # each half-unit holds `width` bits
        keep = _repeat(unit, (1 << 2 * width) - 1) if unit < 64 else (1 << 2 * width) - 1
        if s <= 4:
            w = (w | (w >> (half - width))) & keep
        else:
            low = _repeat(unit, (1 << half) - 1) if unit < 64 else (1 << half) - 1
            w = (w & low) | (((w >> half) & low) << width)
    return w


def spread(packed: torch.Tensor, lane_bits: int) -> torch.Tensor:
    """The inverse of `compressed`: int64 words holding 8 values of lane_bits (<= 7) bits side by
    side in their low bits -> the values one per byte (int64 words, value k in byte k)."""
    w, s = packed, lane_bits
    for unit in (64, 32, 16):
        half, width = unit // 2, s * unit // 16
        keep = _repeat(unit, (1 << width) - 1) if unit < 64 else (1 << width) - 1
        if s <= 4:
            w = (w | (w << (half - width))) & (keep | (keep << half))
        else:
            w = (w & keep) | (((w >> width) & keep) << half)
    return w


def _repeat(unit_bits: int, value: int) -> int:
    """`value` in every `unit_bits`-bit unit of a 64-bit word, as a signed int64 constant."""
    word = 0
    for shift in range(0, 64, unit_bits):
        word |= value << shift
    return word - (1 << 64) if word >= 1 << 63 else word


def row_counts(rows: torch.Tensor) -> torch.Tensor:
    """(R, bytes) uint8 rows of 1-bit lanes -> (bytes,) int64 words whose byte k counts the rows'
    bit k (R <= 255: no carry between bytes). Each byte widens through int32 inside the kernel:
    straight to int64 it ran 3-6x slower, and widening R rows eagerly first allocates 8 bytes per
    byte (30 ms of page faults at R = 16 rows of 512K bytes)."""
    total = None
    for k in range(rows.shape[0]):
        kept = (rows[k].to(torch.int32).to(torch.int64) * SPREAD8) & BIT_K_OF_BYTE_K
        ones = (((kept + LOW7) & HIGH_BITS) >> 7) & SPREAD8  # arithmetic shift: masked to the low bits
        total = ones if total is None else total + ones
    assert total is not None
    return total


def bytes_of_lanes(lanes: torch.Tensor, lane_bits: int) -> torch.Tensor:
    """Containers -> one lane value per byte: a uint8 container of 8 or 4 lanes of 1 or 2 bits
    becomes an int64 or int32 word, lane k in byte k; 4-bit lanes come as int32 words of 4
    containers (`unpack`'s `as_units`) and become an int64 word (`spread`: one container at a
    time into an int16 ran scalar, 0.64 ms against 0.08 for 4M values)."""
    if lane_bits == 1:
        return row_counts(lanes.unsqueeze(0))
    if lane_bits == 4:
        return spread(lanes.to(torch.int64) & 0xFFFFFFFF, 4)
    c = lanes.to(torch.int32)
    v = (c | (c << 12)) & 0x000F000F
    return (v | (v << 6)) & 0x03030303


@cache
def _packer(lane_bits: int):
    """`lanes_of_bytes` for one lane width (one graph each). The width goes through `fusion.static`:
    torch 2.11's dynamo made the closure's int symbolic and could not trace `1 << 2 * width`."""
    bits = fusion.static(lane_bits)
    return lambda words: lanes_of_bytes(words, fusion.static(bits))


@cache
def _unpacker(lane_bits: int):
    """`bytes_of_lanes` for one lane width (one graph each; the width static, as in `_packer`)."""
    bits = fusion.static(lane_bits)
    return lambda lanes: bytes_of_lanes(lanes, fusion.static(bits))


def as_units(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1-D uint8 `values` as whole `dtype` units (zero-padded by a copy only when needed: zero
    values are what `lanes.pack` pads with)."""
    size = dtype.itemsize
    if values.numel() % size or values.storage_offset() % size:
        values = torch.nn.functional.pad(values, (0, -values.numel() % size))
    return values.view(dtype)


def as_words(values: torch.Tensor) -> torch.Tensor:
    """1-D uint8 `values` as int64 words (`as_units`)."""
    return as_units(values, torch.int64)


def pack(values: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """`lanes.pack` of 1-D uint8 `values` (compiled), or None when compiling failed."""
    whole = as_words(values)
    if layout.lane_bits == 2:
        lanes = fusion.run(quad_lanes, whole.view(torch.int32))
    else:
        words = fusion.run(_packer(layout.lane_bits), whole)
        lanes = None if words is None else words.view(torch.uint8)
    return None if lanes is None else lanes[: layout.containers_for(values.numel())]


def unpack(c: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """One uint8 lane value per element of the containers `c` (compiled; 8 / lanes per container,
    the caller reads the first numel), or None when compiling failed."""
    c = c.reshape(-1)
    words = fusion.run(_unpacker(layout.lane_bits), as_units(c, torch.int32) if layout.lane_bits == 4 else c)
    return None if words is None else words.view(torch.uint8)


# ---- decode: whole words unpacked and scaled in one kernel -------------------------------------
@lru_cache(maxsize=16)
def lane_shifts(lane_bits: int, device: torch.device) -> torch.Tensor:
    """Where each value of an int64 word of `lane_bits`-bit lanes sits (value k at bit k * lane_bits),
    int64 on `device`, made once: the column table every row of `scaled_fn` reads, as `fusion.weyl` is
    the level kernel's (an index vector built in the kernel costs scalar inserts on a CPU)."""
    return (torch.arange(64 // lane_bits, dtype=torch.int64, device="cpu") * lane_bits).to(device, non_blocking=True)


@cache
def scaled_fn(lane_bits: int, indexed: bool):
    """A decode of uint8 containers of `lane_bits`-bit lanes in one graph: out = (S * unit - 1) * scale,
    S each lane's value, scale one fp32 value or (`indexed`) each element's entry of `scales` through
    its per-element index. The containers come as whole int64 words, out (words, 64 / lane_bits),
    each word a row and its values' bit offsets a column table (`lane_shifts`), and as the last few
    bytes (at most 8), their values into `tail`. Why: unpacked to bytes first and then scaled, a
    decode wrote and read a byte per element more and took a stage more, two with a tail (4M
    elements on one CPU core, 4-bit lanes: 0.80 ms against 1.12-1.19; 2-bit: 0.75 against 1.09;
    2026-12-05)."""
    mask, per = fusion.static((1 << lane_bits) - 1), fusion.static(8 // lane_bits)

    def values(w: torch.Tensor, shifts: torch.Tensor, tail: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        body = (w.unsqueeze(1) >> shifts) & fusion.static(mask)
        offsets = torch.arange(fusion.static(per), dtype=torch.int32, device=c.device) * fusion.static(lane_bits)
        rest = ((c.to(torch.int32).unsqueeze(1) >> offsets) & fusion.static(mask)).reshape(-1)[: tail.shape[0]]
        return body.to(torch.float32), rest.to(torch.float32)

    if indexed:
        def scaled_words_indexed(out: torch.Tensor, w: torch.Tensor, shifts: torch.Tensor, tail: torch.Tensor,
                                 c: torch.Tensor, unit: torch.Tensor, scales: torch.Tensor, index: torch.Tensor,
                                 tail_index: torch.Tensor) -> None:
            body, rest = values(w, shifts, tail, c)
            out.copy_((body * unit - 1.0) * scales[index.to(torch.int64)])
            tail.copy_((rest * unit - 1.0) * scales[tail_index.to(torch.int64)])

        return scaled_words_indexed

    def scaled_words(out: torch.Tensor, w: torch.Tensor, shifts: torch.Tensor, tail: torch.Tensor, c: torch.Tensor,
                     unit: torch.Tensor, scale: torch.Tensor) -> None:
        body, rest = values(w, shifts, tail, c)
        out.copy_((body * unit - 1.0) * scale)
        tail.copy_((rest * unit - 1.0) * scale)

    return scaled_words


def scaled_into(res: torch.Tensor, c: torch.Tensor, lane_bits: int, unit: torch.Tensor, scale: torch.Tensor,
                index: torch.Tensor | None) -> bool:
    """res = the decoded values of the uint8 containers `c` by one `scaled_fn` graph: False (nothing
    done) when `c` does not start on a whole int64 word, which the graph reads in place."""
    if c.storage_offset() % 8:
        return False
    n, vals, per = res.shape[0], 64 // lane_bits, 8 // lane_bits
    body = n // vals
    done = body * vals
    args = (res[:done].view(body, vals), c[: body * 8].view(torch.int64), lane_shifts(lane_bits, c.device),
            res[done:], c[body * 8 : body * 8 - (-(n - done) // per)], unit, scale)
    per_element = () if index is None else (index[:done].view(body, vals), index[done:n])
    fusion.run(scaled_fn(lane_bits, index is not None), *args, *per_element)
    return True
