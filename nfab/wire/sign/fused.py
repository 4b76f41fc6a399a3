"""sign's stages as traced functions for `torch.compile` (opt-in; see `wire/fusion.py`).

Why: eager, the votes are a compare pass, a zero-padded copy and one shift-or pass per lane;
the decode an unpack per rank row, a count, a table gather and a scaling pass. Compiled:

- encode: x >= 0, shifted into its lane and summed per container, in one kernel that reads x
  and writes the containers (the per-segment mean |x| stays the eager reduction: a float sum
  whose order a compiled kernel would change, and with it the scale's last bit);
- decode: every rank row's vote bits counted (signgather) or the count lanes unpacked
  (signcount), the count turned into its vote by the vote table's own arithmetic and times the
  one segment's scale, stored into the bucket slice: one kernel. Several segments: the vote
  values in one kernel, then the eager per-segment scaling (fl(v * s) either way: the same bits).
"""

from __future__ import annotations

from functools import cache

import torch

from nfab.wire import fusion
from nfab.wire.qsum.fused import packed, unpacked
from nfab.wire.qsum.lanes import LaneLayout


@cache
def votes_fn(layout: LaneLayout):
    """The payload of `lanes.pack(x >= 0, layout)` in one graph."""

    def votes(x: torch.Tensor) -> torch.Tensor:
        return packed((x >= 0).to(torch.int32), layout)

    return votes


def _vote(counts: torch.Tensor, w: torch.Tensor, vote: str) -> torch.Tensor:
    """`codec.vote_table(W, vote)[counts]` computed per element by the table's own fp32 ops
    (`w`: W as a 0-d fp32 tensor, so no backend divides by a constant's reciprocal)."""
    diff = 2 * counts.to(torch.float32) - w
    return torch.sign(diff) if vote == "majority" else diff / w


@cache
def gathered_fn(vote: str):
    """Counted votes of the W gathered rows (W, bytes) of 1-bit lanes, times `scale`, into `out`:
    a column per bit of a byte, stacked (one vectorised kernel; a table gather ran half as fast)."""

    def gathered(out: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> None:
        r = rows.to(torch.int32)
        cols = []
        for bit in range(8):
            count = (r[0] >> bit) & 1
            for k in range(1, rows.shape[0]):
                count = count + ((r[k] >> bit) & 1)
            cols.append(_vote(count, w, vote) * scale)
        out.copy_(torch.stack(cols, 1).view(-1)[: out.shape[0]])

    return gathered


@cache
def counted_fn(layout: LaneLayout, vote: str):
    """The count lanes of a SUM all-reduce as votes times `scale`, into `out`."""

    def counted(out: torch.Tensor, c: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> None:
        out.copy_(_vote(unpacked(c, layout, out.shape[0]), w, vote) * scale)

    return counted


def encode(x: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """The vote containers of `x` (compiled), or None when compiling failed."""
    return fusion.run(votes_fn(layout), x.reshape(-1))


def decode(reduced: torch.Tensor, gathered: bool, layout: LaneLayout, vote: str, world_size: int,
           scale: torch.Tensor, numel: int, out: torch.Tensor | None) -> torch.Tensor | None:
    """The decoded votes (fp32, into `out` when given) times `scale` (1 element: the segment's mean
    scale, or 1.0 for unit votes that the caller scales per segment): `reduced` is the W gathered
    rows (`gathered`, a (W, bytes) tensor) or the summed count lanes. None when compiling failed."""
    dev = reduced.device
    res = out.view(-1) if out is not None else torch.empty(numel, dtype=torch.float32, device=dev)
    fn = gathered_fn(vote) if gathered else counted_fn(layout, vote)
    fusion.run(fn, res, reduced if gathered else reduced.reshape(-1), fusion.constant(float(world_size), dev),
               scale.reshape(-1)[:1].to(torch.float32))
    return None if fusion.failed() else res
