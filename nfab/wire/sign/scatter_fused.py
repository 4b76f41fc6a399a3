"""signscatter's stages as traced functions for `torch.compile` (opt-in; see `wire/fusion.py`).

Why: eager, signscatter's owner step and decode are a dozen full passes of int64 digit
arithmetic (unpack the count lanes, compare, weigh 5 trits per byte; then 5 divisions and
remainders per byte back): 55 ms for 4M elements at W=2, 0.01x a copy. Compiled:

- encode: `sign.fused`'s vote bytes into the W zero-padded shards at once, packed as whole
  words (`qsum/words.py`): a shard is a multiple of 40 elements, so of every uint8 lane count,
  and packing the W shards together gives the containers of packing them one by one (int32 and
  int64 containers: shard by shard, `qsum.fused.pack`);
- owner step: the shard's count lanes unpacked one count per byte (`qsum.fused.unpack`), then
  the majority per element -- a bit (c > W/2) packed as words at odd W; a trit (0 negative,
  1 tie, 2 positive) at even W, one per byte (`trits_into`), then each group's 5 planes of 8
  trits, read as 5 int64 words, weighed into its 8 trit bytes (`trit_words`, no carries);
- decode: the gathered bits as count bytes (`words.row_counts`), or the trit bytes read as int64
  words and split into their 5 planes of digit bytes by SWAR division (`digit_words`); then the
  digit's value (-1, 0, +1, or -1 / +1) times the segment's scale (`digit_values_into`).

Per 4M elements on one CPU core (W=2, `cost.codec_work` stage by stage), the trit
decode went from 3.2 ms (5 digits per byte as a stack of 5 strided fp32 columns) to 0.35 + 0.8 ms,
and the owner's trit bytes from 1.2 ms (Horner's rule over strided byte columns) to 0.25 + 0.13.

The same containers, majority bytes and decoded values as the eager path and the host kernels,
bit for bit (`tests/wire/test_compiled.py`).
"""

from __future__ import annotations

import torch

from nfab.wire import fusion
from nfab.wire.digits import word_aligned
from nfab.wire.qsum import fused as qsum_fused
from nfab.wire.qsum import words
from nfab.wire.qsum.lanes import LaneLayout, layout_for
from nfab.wire.sign import fused as sign_fused

TRITS_PER_BYTE = 5


# ---- encode ----------------------------------------------------------------------------------
def encode(x: torch.Tensor, shard: int, world_size: int, layout: LaneLayout,
           summed: bool = False, tie: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(the W shards' count-lane payload of `x`'s votes, the vote bytes of `x`: flat, or one row per
    shard, read as `.reshape(-1)[:numel]`, and with `summed` sum |x| in float64 from the votes' graph
    where the shards are whole words, else None) compiled, or None when compiling failed."""
    if words.fits(layout) and shard % layout.lanes == 0:
        got = sign_fused.vote_buffer(x, world_size * shard, summed, tie)  # the shards' padding votes nothing
        payload = None if got is None else words.pack(got[0], layout)
        return None if got is None or payload is None else (payload, got[0][: x.numel()], got[1])
    # int32/int64 containers: shard by shard, each row the shard's votes then zeros to whole containers,
    # starting on a whole word (`qsum.fused.pack` reads 8 votes as one int64, without a padding copy)
    per = layout.containers_for(shard) * layout.lanes
    rows = qsum_fused.shard_rows(world_size, per, x.device, x.numel(), shard)
    ties = sign_fused.tie_of(tie, x.device)
    for dst, src in qsum_fused.shard_parts(rows, x.reshape(-1), shard):
        if src.numel() and fusion.run(sign_fused.votes_into, dst, src, ties) is None and fusion.failed():
            return None
    payload = qsum_fused.pack_rows(rows, shard, layout)
    return None if payload is None else (payload, rows[:, :shard], None)


# ---- the owner's step ------------------------------------------------------------------------
def majority_bits(counts: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """uint8 1 where count > half, else 0 (integer arithmetic: the sign bit of half - count)."""
    return (((half - counts.to(torch.int32)) >> 31) & 1).to(torch.uint8)


def trits_into(out: torch.Tensor, counts: torch.Tensor, half: torch.Tensor) -> None:
    """out (uint8) = each count's trit, (count >= half) + (count > half): 0 negative, 1 tie, 2 positive
    (integer arithmetic: sign bits of differences, no bool tensors)."""
    c = counts[: out.shape[0]].to(torch.int32)
    out.copy_(((1 - (((c - half) >> 31) & 1)) + (((half - c) >> 31) & 1)).to(torch.uint8))


def trit_words(planes: torch.Tensor) -> torch.Tensor:
    """(groups, 5) int64 words of trit bytes (plane k: digit k of the group's 8 bytes) -> each group's
    8 trit bytes as one int64 word, sum of plane k times 3^k by Horner's rule: every byte's sum is at
    most 242, so no carry crosses a byte (`scatter.pack_trits`'s bytes)."""
    acc = planes[:, 4]
    for k in range(3, -1, -1):
        acc = acc * 3 + planes[:, k]
    return acc


def owner_step(counts_shard: torch.Tensor, layout: LaneLayout, shard: int, world_size: int,
               ternary: bool) -> torch.Tensor | None:
    """A shard's summed count lanes -> its packed majority (compiled), or None when compiling failed."""
    counts = qsum_fused.unpack(counts_shard, layout)
    if counts is None:
        return None
    half = fusion.int_constant(world_size // 2, counts_shard.device)
    if ternary:  # a trit a byte, then read as words (an int64 view of the bytes: two graphs)
        trits = torch.empty(shard, dtype=torch.uint8, device=counts_shard.device)
        if fusion.run(trits_into, trits, counts, half) is None and fusion.failed():
            return None
        got = fusion.run(trit_words, trits.view(torch.int64).view(-1, TRITS_PER_BYTE))
        return None if got is None else got.view(torch.uint8)
    bits = fusion.run(majority_bits, counts[:shard], half)
    return None if bits is None else words.pack(bits, layout_for(1))


# ---- decode ----------------------------------------------------------------------------------
_EVEN_BYTES = 0x00FF00FF00FF00FF
_QUOTIENT_BITS = 0x007F007F007F007F


def digit_words(packed: torch.Tensor) -> torch.Tensor:
    """(groups,) int64 words of 8 trit bytes -> (groups, 5) int64 words, word k the 8 bytes' digit k:
    the groups' 40 digits as bytes in element order (`scatter.pack_trits`).

    SWAR: the even and the odd bytes apart, each in a 16-bit field (value v <= 255), v // 3 is
    (v * 171) >> 9 for every such v (171 / 512 exceeds 1/3 by 1/1536, so v * 171 / 512 lies less than
    1/6 above v / 3, whose fraction is at most 2/3; 171 * 255 < 2^16, so no field carries into the
    next, and the 7 bits kept drop what the shift brought down from it) and
    v - 3 * (v // 3) the digit: four divisions give digits 0-3, the last quotient digit 4 (a trit
    byte is at most 242). All 243 bytes in every position are checked in tests/wire/test_fused_eager.py."""
    lo, hi = packed & _EVEN_BYTES, (packed >> 8) & _EVEN_BYTES
    planes = []
    for _ in range(TRITS_PER_BYTE - 1):
        qlo, qhi = ((lo * 171) >> 9) & _QUOTIENT_BITS, ((hi * 171) >> 9) & _QUOTIENT_BITS
        planes.append((lo - 3 * qlo) | ((hi - 3 * qhi) << 8))
        lo, hi = qlo, qhi
    planes.append(lo | (hi << 8))
    return torch.stack(planes, 1)


def digit_values_into(out: torch.Tensor, digits: torch.Tensor, scale: torch.Tensor,
                      index: torch.Tensor | None = None) -> None:
    """out[i] = (digit i - 1) * its scale (`sign_fused.scale_of`): -s, 0 or +s, the eager path's fl(v * s)."""
    out.copy_((digits[: out.shape[0]].to(torch.float32) - 1.0) * sign_fused.scale_of(scale, index))


def bit_values_into(out: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor,
                    index: torch.Tensor | None = None) -> None:
    """out[i] = (2 * bit i - 1) * its scale (`sign_fused.scale_of`) from the bits as count bytes."""
    out.copy_((counts[: out.shape[0]].to(torch.float32) * 2.0 - 1.0) * sign_fused.scale_of(scale, index))


def decode(reduced: torch.Tensor, numel: int, ternary: bool, scale: torch.Tensor,
           out: torch.Tensor | None, index: torch.Tensor | None = None) -> torch.Tensor | None:
    """The gathered majority as values times their scale (`sign_fused.scale_of`: the one segment's, or
    each element's segment's through `index`), into `out` when given; None when compiling failed."""
    dev = reduced.device
    res = out.view(-1) if out is not None else torch.empty(numel, dtype=torch.float32, device=dev)
    s = sign_fused.per_segment(scale, index)
    if ternary:  # the digits as bytes (whole words: a shard is whole groups), then their values
        digits = fusion.run(digit_words, word_aligned(reduced).view(torch.int64))
        if digits is None:
            return None
        fusion.run(digit_values_into, res, digits.view(torch.uint8).view(-1), s, index)
    else:
        counted = fusion.run(words.row_counts, reduced.reshape(1, -1))
        if counted is None:
            return None
        fusion.run(bit_values_into, res, counted.view(torch.uint8), s, index)
    return None if fusion.failed() else res
