"""The sign codec's compiled CPU path: tensors in, `bit_kernels`, `vote_kernels` and
`trit_kernels` on their memory.

Votes packed with each segment's |x| sum on one read, their count lanes, the gathered rows'
count-and-look-up and majority decodes, and the scatter's shard majority (bits or trits).
Each function here has a torch reference (`nfab.wire.sign.codec`, `nfab.wire.qsum.lanes`,
`nfab.wire.sign.ops.SignOps`) that every other device runs and that gives the same bits;
`nfab.wire.sign.ops.HostSignOps` calls them, on the CPU and on inputs they read.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from nfab.wire.host_slices import HALF, segment_bounds, span_here, targets
from nfab.wire.qsum import host as qsum_host
from nfab.wire.qsum.lanes import LaneLayout

try:
    from nfab.wire.qsum import lane_kernels
    from nfab.wire.sign import bit_kernels, trit_kernels, vote_kernels
except ImportError:  # numba missing: `dispatch.AVAILABLE` is False and the torch reference runs
    bit_kernels = lane_kernels = trit_kernels = vote_kernels = None  # type: ignore[assignment]


def sign_votes(x: torch.Tensor, lengths: Sequence[int], tie: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(votes packed 1 bit per element little-endian, float64 |x| sum per segment): `codec.sign_bits`'
    votes, a zero positive when `tie` is even.

    One pass over `x`; bf16 and fp16 are read as they are (no fp32 copy).
    """
    return sign_votes_views([x], lengths, split=True, tie=tie)


_NO_SQ = np.empty(0, dtype=np.float64)


def sign_votes_views(views: Sequence[torch.Tensor], lengths: Sequence[int], split: bool = False,
                     sqs: np.ndarray | None = None, tie: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`sign_votes` of the concatenation of `views` (one segment each, or `lengths` over one
    view when `split`), read in place: a mixed bucket's slices need no gathered copy. With
    `sqs` (float64, one per segment), each segment's x^2 sum is taken on the same read."""
    lengths = list(lengths)
    n = sum(lengths)
    words = np.zeros(n // 64 + 2, dtype=np.uint64)  # whole words, one of room for a shifted store
    sums = np.zeros(len(lengths), dtype=np.float64)
    sq = _NO_SQ if sqs is None else sqs
    starts, ends = segment_bounds(lengths)
    if split:
        _sign_kernel(views[0], starts, ends, np.zeros(len(lengths), dtype=np.int64), words, sums, sq, tie)
        return words.view(np.uint8)[: -(-n // 8)], sums
    span = span_here(views)
    if span is not None:  # the slices where they lie in the bucket: one call for all of them
        x, at = span
        _sign_kernel(x, at, at + (ends - starts), starts - at, words, sums, sq, tie)
    else:
        zero = np.zeros(1, dtype=np.int64)
        for si, v in enumerate(views):  # each view alone, its votes at its place in the concatenation
            _sign_kernel(v, zero, ends[si : si + 1] - starts[si], starts[si : si + 1], words, sums[si : si + 1],
                         sq[si : si + 1], tie)
    return words.view(np.uint8)[: -(-n // 8)], sums


def sign_votes_at(x: torch.Tensor, starts: np.ndarray, ends: np.ndarray, bases: np.ndarray,
                  nbits: int, tie: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(votes packed in `nbits` bits, float64 |x| sum per segment) of segments x[starts[s] : ends[s]]
    of a 1-D `x`, element i of segment s voting at bit bases[s] + i: rows read where they lie land
    at their place in padded shards (bits no segment writes stay 0). One pass, no copy of `x`."""
    words = np.zeros(nbits // 64 + 2, dtype=np.uint64)  # whole words, one of room for a shifted store
    sums = np.zeros(starts.size, dtype=np.float64)
    _sign_kernel(x, starts, ends, bases, words, sums, _NO_SQ, tie)
    return words.view(np.uint8)[: -(-nbits // 8)], sums


def _sign_kernel(x: torch.Tensor, starts, ends, bases, words, sums, sqs, tie: int) -> None:
    """Segment s = x[starts[s] : ends[s]]; element j's vote goes to bit bases[s] + j (a zero votes
    positive when `tie` is even); x^2 sums into `sqs` unless it is empty."""
    assert bit_kernels is not None
    if x.dtype == torch.float32:
        bit_kernels.sign_bits_f32(x.numpy(), starts, ends, bases, words, sums, sqs, tie & 1)
    else:
        bit_kernels.sign_bits_half(x.view(torch.int16).numpy().view(np.uint16), HALF[x.dtype], starts, ends, bases,
                                   words, sums, sqs, tie & 1)


@lru_cache(maxsize=1)
def _expand() -> np.ndarray:
    assert bit_kernels is not None
    return bit_kernels.count_expand_table()


_NP = {torch.uint8: np.uint8, torch.int32: np.int32, torch.int64: np.int64}


def votes_to_lanes(bits: np.ndarray, numel: int, layout: LaneLayout) -> torch.Tensor:
    """Packed votes -> count lane containers: the same tensor as `lanes.pack(x >= 0, layout)`."""
    assert lane_kernels is not None
    out = np.empty(layout.containers_for(numel), dtype=_NP[layout.container])
    padded = np.zeros(bits.size + 2, dtype=np.uint8)  # two zero bytes: the kernel reads 16-bit windows
    padded[: bits.size] = bits
    qsum_host.bits_to_lanes(padded, numel, layout, out)
    return torch.from_numpy(out)


def votes_to_shard_lanes(bits: np.ndarray, numel: int, shard: int, world_size: int,
                         layout: LaneLayout) -> torch.Tensor:
    """Packed votes of `numel` elements, zero-padded to W shards of `shard` elements (a multiple
    of 8), each lane-packed on its own and laid end to end: the tensor of
    `torch.cat([votes_to_lanes(shard r's votes, shard, layout) for r in range(W)])`, written in
    place (one buffer, no per-shard copies or concatenation)."""
    assert lane_kernels is not None and shard % 8 == 0
    step, m = shard // 8, layout.containers_for(shard)
    padded = np.zeros(world_size * step + 2, dtype=np.uint8)  # two zero bytes: the kernel reads 16-bit windows
    padded[: bits.size] = bits
    out = np.empty(world_size * m, dtype=_NP[layout.container])
    for r in range(world_size):  # a shard's window may read 2 bytes of the next: masked off by `shard`
        qsum_host.bits_to_lanes(padded[r * step : (r + 1) * step + 2], shard, layout, out[r * m : (r + 1) * m])
    return torch.from_numpy(out)


def decode_bit_rows(rows: np.ndarray, start: int, numel: int, table: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = table[how many of the W (<= 255) packed bit rows have bit start + i set]."""
    assert bit_kernels is not None
    bit_kernels.decode_bit_rows(rows, start, numel, table.astype(np.float32, copy=False), out, _expand())
    return out


_UNITS = np.array([-1.0, 0.0, 1.0], dtype=np.float32)


def majority_bit_rows(rows: np.ndarray, start: int, numel: int, world_size: int, scale: float,
                      out: np.ndarray) -> np.ndarray:
    """`decode_bit_rows` with the majority table times `scale` (sign(2c - W) * s, a tie 0 * s),
    by bit-sliced counting: out (fp32) gets the same bits."""
    assert vote_kernels is not None
    vote_kernels.majority_rows(rows, start, numel, world_size // 2, world_size % 2 == 0, _UNITS, np.float32(scale),
                               out.view(np.uint32))
    return out


def majority_into(rows: np.ndarray, lengths: Sequence[int], world_size: int, scales: np.ndarray,
                  out: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    """`majority_bit_rows` of every segment (scale scales[s]) into `out` (one fp32 tensor of all
    segments, or `Slices`) in one compiled call; False otherwise (the caller then decodes
    segment by segment)."""
    assert vote_kernels is not None
    span = targets(out, lengths)
    if span is None:
        return False
    starts, ends = segment_bounds(lengths)
    vote_kernels.majority_segments(rows, starts, ends - starts, world_size // 2, world_size % 2 == 0, _UNITS,
                                   np.ascontiguousarray(scales, dtype=np.float32), span[0].numpy().view(np.uint32),
                                   span[1])
    return True


@lru_cache(maxsize=1)
def _trit_digits() -> np.ndarray:
    b = np.arange(256, dtype=np.int64)[:, None]
    return ((b // np.array([1, 3, 9, 27, 81])[None, :]) % 3).astype(np.uint8)


def decode_trits(packed: np.ndarray, start: int, numel: int, table: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = table[trit start + i of `packed`] (`scatter.pack_trits`'s order: element 8k + e of a
    group of 40 is digit k of the group's byte e). A byte's value at each digit position comes from
    a 5 x 256 table (`table` looked up by the digits once per call)."""
    assert trit_kernels is not None
    columns = np.ascontiguousarray(table.astype(np.float32, copy=False)[_trit_digits()].T).view(np.uint32)
    trit_kernels.decode_trits(packed, start, numel, columns, out.view(np.uint32))
    return out


@lru_cache(maxsize=64)
def _digit_tables(lane_bits: int, half: int, ternary: bool) -> tuple[np.ndarray, ...]:
    """The owner's tables for uint8 count lanes: count -> digit, and its trit or bit tables."""
    assert trit_kernels is not None
    counts = np.arange(1 << lane_bits)
    digit = (counts > half).astype(np.uint8)
    if ternary:
        digit += (counts >= half).astype(np.uint8)  # 0 neg, 1 tie, 2 pos
    if lane_bits <= 4 and 8 % lane_bits == 0:  # whole counts per container byte: a 256-row table
        fused = (trit_kernels.plane_table(digit, lane_bits) if ternary else trit_kernels.bit_table(digit, lane_bits),)
    else:
        fused = ()
    for t in (digit, *fused):
        t.flags.writeable = False  # shared by every call of this world size
    return (digit, *fused)


def shard_majority(containers: torch.Tensor, layout: LaneLayout, shard: int, half: int,
                   ternary: bool) -> torch.Tensor:
    """A shard's summed count lanes -> its packed majority (uint8): bit i = count > half (odd W,
    `lanes.pack` of 1-bit lanes), or 5 trits a byte (even W, 0 below half, 1 at it, 2 above, in
    `scatter.pack_trits`'s order),
    `shard` a multiple of 40. uint8 lanes that fill the byte go straight from container bytes
    to digit bytes by table (one pass); others decode to digits first (the table decode)."""
    assert lane_kernels is not None and trit_kernels is not None and shard % 40 == 0
    digit, *fused = _digit_tables(layout.lane_bits, half, ternary)
    src = containers.numpy()
    out = np.empty(shard // 5 if ternary else shard // 8, dtype=np.uint8)
    if src.dtype == np.uint8 and fused:
        if ternary:
            trit_kernels.byte_lanes_to_trits(src, layout.lane_bits, fused[0], out)
        else:
            trit_kernels.byte_lanes_to_bits(src, layout.lane_bits, fused[0], out)
        return torch.from_numpy(out)
    if src.dtype == np.uint8:
        digits = np.empty(shard, dtype=np.uint8)
        lane_kernels.byte_lane_digits(src, layout.lane_bits, layout.lanes, shard, digit, digits)
    elif ternary:  # wide containers (W=4, W >= 16): the table decode with uint32 digits (its pairs
        # move as uint64 words as fp32 values do), packed from there (no float pass or narrowing copy)
        wide = np.empty(shard, dtype=np.uint32)
        lane_kernels.decode_wide_lanes(src, layout.lane_bits, layout.lanes, shard, digit.astype(np.uint32), wide)
        lane_kernels.pack_trits(wide, out)
        return torch.from_numpy(out)
    else:
        values = torch.from_numpy(digit.astype(np.float32))
        digits = qsum_host.decode_table(containers, layout, shard, values).numpy().astype(np.uint8)
    if not ternary:
        return torch.from_numpy(np.packbits(digits, bitorder="little"))  # 1-bit lanes: lane l = bit l
    lane_kernels.pack_trits(digits, out)
    return torch.from_numpy(out)
