"""Exact low-bit reduce-scatter of one group's rows: what FSDP2's reduce-scatter becomes under nfab.

The input is (W, C): row r is what rank r receives the mean of (a group's share of the FSDP2
chunk: the chunk itself when the group is all of it, read where it lies; sign copies its rows
padded to whole vote bytes). Each codec reuses the DDP lanes' own halves
(`BlockQScatter`, `SignScatter`); only the first half runs, and each rank decodes only its row:

- block-scaled qsum (bqN): the agreed uint8 block codes (one blocking MAX all-reduce, the same
  codes as on DDP), the stratified levels of `BlockQSum.encode`, each row packed densely at one
  rank's width (`BlockQScatter.pack_levels`), one `all_to_all_single`, and the row's owner sums the
  W ranks' levels exactly (`owner_step`) and decodes its row (`BlockQSum.decode`): the same values
  the all-reduce of `BlockQSum` gives for that row, bit for bit;
- sign: count lanes sized for W per row (`SignScatter.encode`), one SUM `reduce_scatter_tensor`,
  the owner's majority (`owner_step`) times the rank-mean of each segment's mean |x|.

Every rank encodes every row with the same segment table (`shards.row_segments`), so the scale
codes and the sign scales of row r are the same vector on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from nfab.runtime.control.moment import rounding_variance
from nfab.wire import noise
from nfab.wire.blockq.reducer import BlockQSum
from nfab.wire.blockq.scatter import BlockQScatter, consecutive
from nfab.wire.contract import allgather_factor, allreduce_factor, gather_scales
from nfab.wire.sign.scatter import SignScatter, reduce_scatter_factor


@dataclass(frozen=True, slots=True)
class RowResult:
    """This rank's row of the mean (fp32, `padded` elements) and what it cost on the wire."""

    mean: torch.Tensor
    wire_bytes: float
    collectives: int
    variance: torch.Tensor | None = None
    """Block routes: the rounding variance of each element of the row's mean (`control/moment.py`)."""


def padded_row(red: BlockQScatter | SignScatter, numel: int, world_size: int) -> int:
    """Elements a row of `numel` is padded to: whole containers of the codec's shards."""
    return red.shard_numel(world_size * numel, world_size)


def block_reduce_scatter(red: BlockQScatter, rows: torch.Tensor, segments: Sequence[Sequence[int]],
                         seeds: np.ndarray, rank: int, group: dist.ProcessGroup | None,
                         out: torch.Tensor | None = None, with_variance: bool = False) -> RowResult:
    """Mean of row `rank` over the W ranks' `rows` (W, C), block-scaled: `segments[r]` is row r's
    segment table (summing to C), `seeds` one noise seed per segment of all rows (the same on every
    rank). The rows are read where they lie; only their uint8 levels are padded to whole containers.
    `out` (C fp32 elements): decoded into directly (no row buffer) where the sums' packing is consecutive.
    `with_variance`: also the row's rounding variance per element, from its agreed codes."""
    w, c = rows.shape
    padded = padded_row(red, c, w)
    flat_lengths = [n for seg in segments for n in seg]
    x = rows.reshape(-1)
    codes = red.agree(red.local_scale(x, flat_lengths), group)  # blocking uint8 MAX, as on DDP
    levels, compiled = red.round_levels(x, flat_lengths, codes, noise.Stratum(noise.Seeds(seeds), rank, w))
    if padded != c:  # level 0 in each row's tail: never decoded
        full = torch.zeros(w, padded, dtype=levels.dtype, device=levels.device)
        full[:, :c] = levels.view(w, c)
        levels = full.view(-1)
    payload = red.pack_levels(levels, w, compiled)  # each row at one rank's width
    received = red.scatter(payload, w, group)  # all_to_all_single: every rank's levels of my row
    sums = red.owner_step(received, w)  # exact integer sums, packed in layout(W)
    before = sum(red.blocks_for(n) for seg in segments[:rank] for n in seg)
    row_lengths = list(segments[rank])
    row_codes = codes[before : before + sum(red.blocks_for(n) for n in row_lengths)]
    variance = rounding_variance(red, row_codes, row_lengths, w, None) if with_variance else None
    if padded == c or consecutive(red.layout(w)):  # the row's first C sums are its elements: decode those
        mean = BlockQSum.decode(red, sums, row_codes, c, row_lengths, w, out)
    else:  # bit lanes of several blocks: decode the padded row; the tail (code 0, all-zero block) is 0
        row_lengths.append(padded - c)
        row_codes = torch.cat([row_codes, row_codes.new_zeros(red.blocks_for(padded - c))])
        mean = BlockQSum.decode(red, sums, row_codes, padded, row_lengths, w)[:c]
    nbytes = (reduce_scatter_factor(w) * payload.numel() * payload.element_size()
              + allreduce_factor(w) * codes.numel())
    return RowResult(mean, nbytes, 2, variance)


def sign_reduce_scatter(red: SignScatter, rows: torch.Tensor, segments: Sequence[Sequence[int]], rank: int,
                        group: dist.ProcessGroup | None) -> RowResult:
    """Majority sign of row `rank` over the W ranks' `rows`, times the rank-mean of each segment's
    mean |x| (all-gathered: every rank's scales, averaged in rank order as on DDP)."""
    w, cp = rows.shape
    flat_lengths = [n for seg in segments for n in seg]
    enc = red.encode(rows.reshape(-1), flat_lengths, w)
    counts = red.scatter(enc.payload, w, group)  # SUM reduce-scatter of count lanes: my row's counts
    majority = red.owner_step(counts, w)
    scales = gather_scales(enc.scales.to(rows.device), w, group)
    first = sum(len(seg) for seg in segments[:rank])
    row_scales = scales[first : first + len(segments[rank])]
    mean = red.decode(majority, row_scales, cp, list(segments[rank]), w)
    nbytes = (reduce_scatter_factor(w) * enc.payload.numel() * enc.payload.element_size()
              + allgather_factor(w) * enc.scales.numel() * 4)
    return RowResult(mean, nbytes, 2)


def lossy_bytes(red: BlockQScatter | SignScatter, segments: Sequence[Sequence[int]], world_size: int) -> float:
    """Bytes one rank sends reducing a group's rows (`segments`: every row's table, as the codec's
    call gets it) by `block_reduce_scatter` / `sign_reduce_scatter`, computed without running them."""
    w = world_size
    payload = red.payload_bytes(w * padded_row(red, sum(segments[0]), w), w)
    if isinstance(red, BlockQScatter):
        blocks = sum(red.blocks_for(n) for seg in segments for n in seg)
        return reduce_scatter_factor(w) * payload + allreduce_factor(w) * blocks
    return reduce_scatter_factor(w) * payload + allgather_factor(w) * sum(len(seg) for seg in segments) * 4


def plain_bytes(numel: int, world_size: int, element_size: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter of a (W, numel) input: (W-1)/W of it."""
    return reduce_scatter_factor(world_size) * world_size * numel * element_size
