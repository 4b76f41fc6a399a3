"""sign's stages as traced functions for `torch.compile` (opt-in; see `wire/fusion.py`).

Why: the votes are one bit per element, and inductor's CPU code for a bool, for a column read
8 elements apart, or for a short inner dimension of 8 bit positions runs scalar (3.6 ms to
pack 4M votes, 2 ms to count them: 0.1x a copy). So the stages work on whole machine words,
each a kernel of contiguous vector loads and stores (SWAR: SIMD within a register):

- encode: each vote as a byte, 1 where x >= 0, computed from x's bits by integer arithmetic
  (`vote_bytes`: -0.0 votes positive, NaN negative, as IEEE `>=` does); then every 8 vote
  bytes, read as one int64, become their lanes: a multiply by `GATHER8` moves byte k's low bit
  to bit 56 + k (the product's top byte is the 8 votes, no carries reach it), and for 2- or
  4-bit lanes the 8 bits are spread apart by shifts and masks (`_spread_bits`);
- decode: each payload byte becomes its lanes' counts, one count per byte of an int64 / int32 /
  int16 word (a gathered vote byte b: `b * SPREAD8` copies b into every byte, the mask keeps
  bit k in byte k, and adding 0x7F per byte carries it to the byte's top bit; count lanes:
  the inverse shifts and masks), summed over the gathered rows; read as bytes, the counts go
  through the vote table's own fp32 arithmetic (`_vote`) times the scale into the bucket.

The byte and bit orders are `lanes.pack`'s (little-endian words: byte k of a word is vote k),
so the payloads are the eager path's and the host kernels' bit for bit. Layouts whose lanes are
not 1, 2 or 4 bits of a uint8 (count lanes at W = 4..7 and W >= 16, in int32/int64 containers)
pack the same vote bytes and unpack to the same count bytes by the generic traced lanes
(`qsum.fused.pack_fn` / `unpack`).

The per-segment mean |x| is not here: `segments.segment_mean_abs` (a float64 sum, compiled).
"""

from __future__ import annotations

from functools import cache

import torch

from nfab.wire import fusion
from nfab.wire.qsum import fused as qsum_fused
from nfab.wire.qsum.lanes import LaneLayout

GATHER8 = 0x0102040810204080
"""(w * GATHER8) >> 56: the low bits of w's 8 bytes (each 0 or 1) as one byte, byte k at bit k."""
SPREAD8 = 0x0101010101010101
"""b * SPREAD8 copies a byte b into each of a word's 8 bytes."""
BIT_K_OF_BYTE_K = 0x8040201008040201 - (1 << 64)
"""Keeps bit k of byte k (as a signed int64 constant)."""
LOW7 = 0x7F7F7F7F7F7F7F7F
"""Added to bytes that are 0 or 2^k (k < 8): the byte's top bit is then set exactly when it was not 0."""
HIGH_BITS = 0x8080808080808080 - (1 << 64)
SWAR_LANE_BITS = (1, 2, 4)
"""uint8 containers whose lanes these stages build from vote bytes (8, 4 or 2 lanes per byte)."""


def swar(layout: LaneLayout) -> bool:
    """Whether `layout`'s lanes are built and read by the word stages (else the generic traced lanes)."""
    return layout.container == torch.uint8 and layout.lane_bits in SWAR_LANE_BITS


# ---- encode ----------------------------------------------------------------------------------
def vote_bytes(x: torch.Tensor) -> torch.Tensor:
    """uint8 1 where x >= 0, else 0, from x's fp32 bits: against = (negative and not +-0) or NaN,
    each term a sign bit by an arithmetic shift (no bool tensor: inductor stores those scalar)."""
    b = x.to(torch.float32).view(torch.int32)
    mag = b & 0x7FFFFFFF
    against = ((b >> 31) & ((-mag) >> 31)) | ((0x7F800000 - mag) >> 31)
    return (1 - (against & 1)).to(torch.uint8)


def votes_into(out: torch.Tensor, x: torch.Tensor) -> None:
    """out (uint8) = `vote_bytes(x)`."""
    out.copy_(vote_bytes(x))


def _spread_bits(p: torch.Tensor, lane_bits: int) -> torch.Tensor:
    """Bit k of the 8-bit values `p` moved to bit k * lane_bits (int64 in, the lane word out:
    uint8 / int16 / int32 for 1 / 2 / 4 bits, i.e. 1 / 2 / 4 payload bytes per 8 votes)."""
    if lane_bits == 1:
        return p.to(torch.uint8)
    if lane_bits == 2:
        p = (p | (p << 4)) & 0x0F0F
        p = (p | (p << 2)) & 0x3333
        return ((p | (p << 1)) & 0x5555).to(torch.int16)
    p = (p | (p << 12)) & 0x000F000F
    p = (p | (p << 6)) & 0x03030303
    return ((p | (p << 3)) & 0x11111111).to(torch.int32)


@cache
def lanes_fn(lane_bits: int):
    """int64 words of 8 vote bytes -> their lane words (`_spread_bits` of the gathered byte)."""

    def lanes(words: torch.Tensor) -> torch.Tensor:
        return _spread_bits(((words * GATHER8) >> 56) & 0xFF, lane_bits)

    return lanes


# ---- decode ----------------------------------------------------------------------------------
def _vote(counts: torch.Tensor, w: torch.Tensor, vote: str) -> torch.Tensor:
    """`codec.vote_table(W, vote)[counts]` computed per element by the table's own fp32 ops
    (`w`: W as a 0-d fp32 tensor, so no backend divides by a constant's reciprocal)."""
    diff = 2 * counts.to(torch.float32) - w
    return torch.sign(diff) if vote == "majority" else diff / w


def row_counts(rows: torch.Tensor) -> torch.Tensor:
    """(W, bytes) uint8 gathered vote bytes -> (bytes,) int64 words whose byte k counts the
    rows' bit k (at most W <= 255 per byte: no carry between bytes). Each byte widens through
    int32 inside the kernel: straight to int64 it ran 3-6x slower, and widening W rows eagerly
    first allocates 8 bytes per vote byte (30 ms of page faults at W=16, 4M elements)."""
    total = None
    for k in range(rows.shape[0]):
        kept = (rows[k].to(torch.int32).to(torch.int64) * SPREAD8) & BIT_K_OF_BYTE_K
        ones = (((kept + LOW7) & HIGH_BITS) >> 7) & SPREAD8  # arithmetic shift: mask to the low bits
        total = ones if total is None else total + ones
    assert total is not None
    return total


@cache
def lane_counts_fn(lane_bits: int):
    """Summed count-lane bytes (uint8) -> one count per byte: 8 / 4 / 2 lanes of 1 / 2 / 4 bits
    (int64 / int32 / int16 words, lane k in byte k)."""

    def lane_counts(lanes: torch.Tensor) -> torch.Tensor:
        if lane_bits == 1:
            return row_counts(lanes.unsqueeze(0))
        c = lanes.to(torch.int32)
        if lane_bits == 2:
            v = (c | (c << 12)) & 0x000F000F
            return (v | (v << 6)) & 0x03030303
        return ((c | (c << 4)) & 0x0F0F).to(torch.int16)

    return lane_counts


@cache
def voted_fn(vote: str):
    """Per-element counts (uint8) as votes times `scale`, into `out`."""

    def voted(out: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> None:
        out.copy_(_vote(counts[: out.shape[0]], w, vote) * scale)

    return voted


# ---- the stages (called by the reducers; None: run eager) -------------------------------------
def encode(x: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """The vote containers of `x` (compiled), or None when compiling failed."""
    flat = x.reshape(-1)
    n = flat.numel()
    whole = -(-n // 8) * 8
    votes = torch.empty(whole, dtype=torch.uint8, device=x.device)
    votes[n:].zero_()  # the last word's padding: zero lanes, as `lanes.pack` pads
    if fusion.run(votes_into, votes[:n], flat) is None and fusion.failed():
        return None
    if not swar(layout):
        return fusion.run(qsum_fused.pack_fn(layout), votes[:n])
    words = fusion.run(lanes_fn(layout.lane_bits), votes.view(torch.int64))
    return None if words is None else words.view(torch.uint8)[: layout.containers_for(n)]


def decode(reduced: torch.Tensor, gathered: bool, layout: LaneLayout, vote: str, world_size: int,
           scale: torch.Tensor, numel: int, out: torch.Tensor | None) -> torch.Tensor | None:
    """The decoded votes (fp32, into `out` when given) times `scale` (1 element: the segment's mean
    scale, or 1.0 for unit votes that the caller scales per segment): `reduced` is the W gathered
    rows (`gathered`, a (W, bytes) tensor of 1-bit lanes) or the summed count lanes. None when
    compiling failed."""
    dev = reduced.device
    res = out.view(-1) if out is not None else torch.empty(numel, dtype=torch.float32, device=dev)
    w, s = fusion.constant(float(world_size), dev), scale.reshape(-1)[:1].to(torch.float32)
    if gathered or swar(layout):  # words of count bytes, read as bytes
        words = (fusion.run(row_counts, reduced) if gathered
                 else fusion.run(lane_counts_fn(layout.lane_bits), reduced.reshape(-1)))
        counts = None if words is None else words.view(torch.uint8)
    else:  # count lanes of int32/int64 containers: unpacked block by block (bytes up to 8-bit lanes)
        counts = qsum_fused.unpack(reduced, layout)
    if counts is None:
        return None
    fusion.run(voted_fn(vote), res, counts, w, s)
    return None if fusion.failed() else res
