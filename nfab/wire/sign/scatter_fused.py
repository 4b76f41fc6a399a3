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
  1 tie, 2 positive) at even W, 5 per byte by Horner's rule over the columns of a (bytes, 5) view;
- decode: the gathered bits as count bytes (`words.row_counts`), or each trit read from its byte
  by exact fp32 arithmetic (`trit_values_into`), then the digit's value (-1, 0, +1, or -1 / +1)
  times the segment's scale.

The same containers, majority bytes and decoded values as the eager path and the host kernels,
bit for bit (`tests/wire/test_compiled.py`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from nfab.wire import fusion
from nfab.wire.qsum import fused as qsum_fused
from nfab.wire.qsum import words
from nfab.wire.qsum.lanes import LaneLayout, layout_for
from nfab.wire.sign import fused as sign_fused

TRITS_PER_BYTE = 5


# ---- encode ----------------------------------------------------------------------------------
def encode(x: torch.Tensor, shard: int, world_size: int,
           layout: LaneLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the W shards' count-lane payload of `x`'s votes, the vote bytes of `x`: flat, or one row per
    shard, read as `.reshape(-1)[:numel]`) compiled, or None when compiling failed."""
    if words.fits(layout) and shard % layout.lanes == 0:
        votes = sign_fused.vote_buffer(x, world_size * shard)  # the shards' padding votes nothing
        payload = None if votes is None else words.pack(votes, layout)
        return None if payload is None else (payload, votes[: x.numel()])
    # int32/int64 containers: shard by shard, each row the shard's votes then zeros to whole containers,
    # starting on a whole word (`qsum.fused.pack` reads 8 votes as one int64, without a padding copy)
    per = layout.containers_for(shard) * layout.lanes
    rows = qsum_fused.shard_rows(world_size, per, x.device, x.numel(), shard)
    for dst, src in qsum_fused.shard_parts(rows, x.reshape(-1), shard):
        if src.numel() and fusion.run(sign_fused.votes_into, dst, src) is None and fusion.failed():
            return None
    payload = qsum_fused.pack_rows(rows, shard, layout)
    return None if payload is None else (payload, rows[:, :shard])


# ---- the owner's step ------------------------------------------------------------------------
def majority_bits(counts: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """uint8 1 where count > half, else 0 (integer arithmetic: the sign bit of half - count)."""
    return (((half - counts.to(torch.int32)) >> 31) & 1).to(torch.uint8)


def trit_bytes(counts: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """5 trits per byte, digit i times 3^i: trit = (count >= half) + (count > half), i.e. 0 negative,
    1 tie, 2 positive (`len(counts)` a multiple of 5)."""
    c = counts.to(torch.int32)
    t = (1 - (((c - half) >> 31) & 1)) + (((half - c) >> 31) & 1)
    grid = t.reshape(-1, TRITS_PER_BYTE)
    acc = grid[:, 4]
    for k in range(3, -1, -1):  # Horner's rule, one strided column at a time
        acc = acc * 3 + grid[:, k]
    return acc.to(torch.uint8)


def owner_step(counts_shard: torch.Tensor, layout: LaneLayout, shard: int, world_size: int,
               ternary: bool) -> torch.Tensor | None:
    """A shard's summed count lanes -> its packed majority (compiled), or None when compiling failed."""
    counts = qsum_fused.unpack(counts_shard, layout)
    if counts is None:
        return None
    half = fusion.int_constant(world_size // 2, counts_shard.device)
    if ternary:
        return fusion.run(trit_bytes, counts[:shard], half)
    bits = fusion.run(majority_bits, counts[:shard], half)
    return None if bits is None else words.pack(bits, layout_for(1))


# ---- decode ----------------------------------------------------------------------------------
@lru_cache(maxsize=16)
def _inverse_powers(device: torch.device) -> torch.Tensor:
    """fl(1 / 3^k) for k = 0..4 (fp32, made once per device, entering the graph as a tensor)."""
    return torch.tensor([3.0**-k for k in range(TRITS_PER_BYTE)], dtype=torch.float32, device="cpu").to(
        device, non_blocking=True)


def trit_values_into(out: torch.Tensor, packed: torch.Tensor, inverse: torch.Tensor, scale: torch.Tensor,
                     index: torch.Tensor | None = None) -> None:
    """out[i] = (trit i - 1) * scale, trit i = floor(byte / 3^k) mod 3 of byte i // 5, k = i % 5:
    fl(1 / 3^k) rounds up for every k <= 4 and a byte's quotient b / 3^k lies at least 1/81 below
    the next integer, so floor(b * fl(1 / 3^k)) is b // 3^k for every byte (all 243 checked in
    tests/wire/test_fused_eager.py); the same for the quotient's own floor(q * fl(1/3))."""
    b = packed.to(torch.float32)
    values = []
    for k in range(TRITS_PER_BYTE):  # a column per digit, stacked (a broadcast over 5 ran scalar, 8x slower)
        q = (b * inverse[k]).floor()  # floor(byte / 3^k), exact
        v = q - 3.0 * (q * (1.0 / 3.0)).floor() - 1.0
        values.append(v * scale if index is None else v)  # several segments: scaled after the stack
    unit = torch.stack(values, 1).view(-1)[: out.shape[0]]
    out.copy_(unit if index is None else unit * sign_fused.scale_of(scale, index))


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
    if ternary:
        fusion.run(trit_values_into, res, reduced.reshape(-1), _inverse_powers(dev), s, index)
    else:
        counted = fusion.run(words.row_counts, reduced.reshape(1, -1))
        if counted is None:
            return None
        fusion.run(bit_values_into, res, counted.view(torch.uint8), s, index)
    return None if fusion.failed() else res
