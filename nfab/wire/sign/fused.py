"""sign's stages as traced functions for `torch.compile` (opt-in; see `wire/fusion.py`).

Why: eager, the votes are a compare pass, a zero-padded copy and one shift-or pass per lane;
the decode an unpack per rank row, a count, a table gather and a scaling pass. Compiled:

- encode: x >= 0, shifted into its lane and summed per container, in one kernel that reads x
  and writes the containers (the per-segment mean |x| stays the eager reduction: a float sum
  whose order a compiled kernel would change, and with it the scale's last bit);
- decode: every rank row's vote bits counted (signgather) or the count lanes unpacked
  (signcount), the count looked up in the vote table and times the one segment's scale, stored
  into the bucket slice: one kernel. Several segments: the vote values in one kernel, then the
  eager per-segment scaling (fl(v * s) either way: the same bits).
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


@cache
def gathered_fn(layout: LaneLayout):
    """Counted votes of the W gathered rows (W, bytes) of 1-bit lanes, looked up and scaled into `out`."""

    def gathered(out: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, scale: torch.Tensor) -> None:
        w, m = rows.shape
        shifts = torch.arange(8, dtype=torch.int32, device=rows.device)
        counts = ((rows.to(torch.int32).unsqueeze(2) >> shifts) & 1).sum(0).view(m * 8)[: out.shape[0]]
        out.copy_(table[counts.to(torch.int64)] * scale)

    return gathered


@cache
def counted_fn(layout: LaneLayout):
    """The count lanes of a SUM all-reduce, looked up in the vote table and scaled into `out`."""

    def counted(out: torch.Tensor, c: torch.Tensor, table: torch.Tensor, scale: torch.Tensor) -> None:
        counts = unpacked(c, layout, out.shape[0])
        out.copy_(table[counts.to(torch.int64)] * scale)

    return counted


def encode(x: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """The vote containers of `x` (compiled), or None when compiling failed."""
    return fusion.run(votes_fn(layout), x.reshape(-1))


def decode(reduced: torch.Tensor, gathered: bool, layout: LaneLayout, table: torch.Tensor, scale: torch.Tensor,
           numel: int, out: torch.Tensor | None) -> torch.Tensor | None:
    """The decoded votes (fp32, into `out` when given) times `scale` (1 element: the segment's mean
    scale, or 1.0 for unit votes that the caller scales per segment): `reduced` is the W gathered
    rows (`gathered`) or the summed count lanes. None when compiling failed."""
    res = out.view(-1) if out is not None else torch.empty(numel, dtype=torch.float32, device=reduced.device)
    fn = gathered_fn(layout) if gathered else counted_fn(layout)
    fusion.run(fn, res, reduced if gathered else reduced.reshape(-1), table, scale.reshape(-1)[:1].to(torch.float32))
    return None if fusion.failed() else res
