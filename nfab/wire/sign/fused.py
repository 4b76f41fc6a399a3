"""sign's stages as traced functions for `torch.compile` (opt-in; see `wire/fusion.py`).

Why: the votes are one bit per element, and inductor's CPU code for a bool, for a column read
8 elements apart, or for a short inner dimension of 8 bit positions runs scalar (3.6 ms to
pack 4M votes, 2 ms to count them: 0.1x a copy). So the stages work on whole machine words,
each a kernel of contiguous vector loads and stores (SWAR: SIMD within a register):

- encode: each vote as a byte, 1 where x > 0, computed from x's bits by integer arithmetic
  (`vote_bytes`: NaN negative, an exact zero by the tie, as `codec.sign_bits`); then every 8 vote
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

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch

from nfab.wire import fusion, segments
from nfab.wire.contract import Out, split_out
from nfab.wire.qsum import fused as qsum_fused
from nfab.wire.qsum import words
from nfab.wire.qsum.lanes import LaneLayout


# ---- encode ----------------------------------------------------------------------------------
def vote_bytes(x: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """`codec.sign_bits(x, tie)` as uint8 (`tie`: a 1-element int32 tensor holding tie & 1), from x's
    fp32 bits: against = (negative and not +-0) or NaN or (+-0 and an odd tie), each term a sign bit
    by an arithmetic shift (no bool tensor: inductor stores those scalar)."""
    b = x.to(torch.float32).view(torch.int32)
    mag = b & 0x7FFFFFFF
    zero = (mag - 1) >> 31  # -1 only where mag is 0 (+-0)
    against = ((b >> 31) & ((-mag) >> 31)) | ((0x7F800000 - mag) >> 31) | (zero & tie)
    return (1 - (against & 1)).to(torch.uint8)


def votes_into(out: torch.Tensor, x: torch.Tensor, tie: torch.Tensor) -> None:
    """out (uint8) = `vote_bytes(x, tie)`."""
    out.copy_(vote_bytes(x, tie))


def tie_of(tie: int, device: torch.device) -> torch.Tensor:
    """The zeros' parity a vote stage takes (a tensor: one graph for either)."""
    return fusion.int_constant(tie & 1, device)


def votes_summed_into(out: torch.Tensor, x: torch.Tensor, tie: torch.Tensor) -> torch.Tensor:
    """`votes_into`, and sum |x| in float64 (`segments.abs_sum64`, the sign scale's sum) from the same
    read of x. Why: the votes and the scale each read the whole bucket; on a GPU one graph is a pass
    over it fewer (one CPU core, 4M elements: 1.33 ms against 1.41 and a stage call more)."""
    out.copy_(vote_bytes(x, tie))
    return segments.abs_sum64(x)


def vote_buffer(x: torch.Tensor, total: int, summed: bool = False, tie: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(`total` vote bytes (uint8, total >= x.numel()): x's `vote_bytes`, then zeros -- padding that
    votes nothing, zero lanes as `lanes.pack` pads; with `summed`, sum |x| in float64 from the same
    graph, else None); None when compiling failed."""
    flat = x.reshape(-1)
    n = flat.numel()
    votes = qsum_fused.lane_buffer(total, n, x.device)
    got = fusion.run(votes_summed_into if summed else votes_into, votes[:n], flat, tie_of(tie, x.device))
    if got is None and fusion.failed():
        return None
    return votes, got if summed else None


# ---- decode ----------------------------------------------------------------------------------
def _vote(counts: torch.Tensor, w: torch.Tensor, vote: str) -> torch.Tensor:
    """`codec.vote_table(W, vote)[counts]` computed per element by the table's own fp32 ops
    (`w`: W as a 0-d fp32 tensor, so no backend divides by a constant's reciprocal)."""
    diff = 2 * counts.to(torch.float32) - w
    return torch.sign(diff) if vote == "majority" else diff / w


def scale_of(scale: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """The scale each element is multiplied by: the one segment's (`scale`, 1 element), or with a
    per-element segment `index`, its segment's (`scale` then holds one per segment) -- fl(v * s)
    either way, the eager per-segment scaling's bits, without its expanded pass over the bucket."""
    return scale if index is None else scale[index.to(torch.int64)]


@cache
def voted_fn(vote: str):
    """Per-element counts (uint8) as votes times their scale (`scale_of`), into `out`."""

    def voted(out: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
              index: torch.Tensor | None = None) -> None:
        out.copy_(_vote(counts[: out.shape[0]], w, vote) * scale_of(scale, index))

    return voted


# ---- the stages (called by the reducers; None: run eager) -------------------------------------
def encode(x: torch.Tensor, layout: LaneLayout, summed: bool = False, tie: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(the vote containers of `x`, its vote bytes: this rank's own votes, kept for error feedback
    instead of unpacking them back from the payload, and with `summed` sum |x| in float64, else None)
    compiled, or None when compiling failed."""
    n = x.numel()
    got = vote_buffer(x, qsum_fused.padded_length(n, layout), summed, tie)  # packed in place: zero votes past n
    if got is None:
        return None
    votes, total = got
    payload = qsum_fused.pack_prefix(votes, n, layout)
    return None if payload is None else (payload, votes[:n], total)


def decode(reduced: torch.Tensor, gathered: bool, layout: LaneLayout, vote: str, world_size: int,
           scale: torch.Tensor, numel: int, out: torch.Tensor | None,
           index: torch.Tensor | None = None) -> torch.Tensor | None:
    """The decoded votes (fp32, into `out` when given) times their scale (`scale_of`: the one
    segment's, or each element's segment's through `index`): `reduced` is the W gathered rows
    (`gathered`, a (W, bytes) tensor of 1-bit lanes) or the summed count lanes. None when
    compiling failed."""
    dev = reduced.device
    res = out.view(-1) if out is not None else torch.empty(numel, dtype=torch.float32, device=dev)
    w, s = fusion.constant(float(world_size), dev), per_segment(scale, index)
    if gathered:  # words of count bytes, read as bytes
        counted = fusion.run(words.row_counts, reduced)
        counts = None if counted is None else counted.view(torch.uint8)
    else:  # the count lanes, one count per element (bytes up to 8-bit lanes)
        counts = qsum_fused.unpack(reduced, layout)
    if counts is None:
        return None
    fusion.run(voted_fn(vote), res, counts, w, s, index)
    return None if fusion.failed() else res


def per_segment(scale: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """The fp32 scale(s) a decode kernel takes: the first (one segment), or all (with an index)."""
    flat = scale.reshape(-1).to(torch.float32)
    return flat[:1] if index is None else flat


def decode_segments(decode: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor | None],
                    reduced: torch.Tensor, scale_mean: torch.Tensor, numel: int, lengths: Sequence[int],
                    out: Out) -> Any:
    """A sign reducer's compiled decode into `out`: `decode(scales, one, index)`, every element times
    its segment's scale in the decode kernel (several segments: through the per-element segment
    index, `qsum.fused.segment_index`); None when it does not run here (not switched on,
    per-segment destinations, an output that is not contiguous fp32)."""
    one, dests = split_out(out)
    if not numel or dests is not None or not fusion.active(reduced, scale_mean):
        return None
    if one is not None and (one.dtype != torch.float32 or not one.is_contiguous()):
        return None
    index = None if len(lengths) == 1 else qsum_fused.segment_index(tuple(lengths), reduced.device)[0]
    return decode(scale_mean, one, index)
