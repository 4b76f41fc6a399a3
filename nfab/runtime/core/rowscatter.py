"""Exact low-bit reduce-scatter of one group's rows: what FSDP2's reduce-scatter becomes under nfab.

The input is (W, C): row r is what rank r receives the mean of (a group's share of the FSDP2
chunk: the chunk itself when the group is all of it, read where it lies; sign reads its segments
where they lie in the chunk, whole group or not). Each codec reuses the DDP reducers' own parts
(`BlockQScatter`, `SignScatter`, `QSum`); only the first half runs, and each rank decodes only its row:

- block-scaled qsum (bqN): the agreed uint8 block codes (one blocking MAX all-reduce, the same
  codes as on DDP), the stratified levels of `BlockQSum.encode`, each row packed densely at one
  rank's width (`BlockQScatter.pack_levels`), one `all_to_all_single`, and the row's owner sums the
  W ranks' levels exactly (`owner_step`) and decodes its row (`BlockQSum.decode`): the same values
  the all-reduce of `BlockQSum` gives for that row, bit for bit;
- sign: count lanes sized for W per row (`SignScatter.encode_rows`: the votes of each row's
  segments read where they lie, laid out in rows padded to whole vote bytes, with no padded copy of
  the rows), one SUM `reduce_scatter_tensor`, the owner's majority (`owner_step`) times the
  rank-mean of each segment's mean |x|;
- exact qsum (q8/q4/q2): its lanes leave headroom for W summands (M = floor((2^bits - 1) / W) steps
  a rank), so the W ranks' packed levels sum exactly elementwise: the scales agreed per segment of
  every row (one blocking fp32 MAX all-reduce, as `QSum.reduce` agrees them), `QSum.encode` of the
  rows (each row in whole containers), one SUM `reduce_scatter_tensor` of the containers, and
  `QSum.decode` of the owner's row: the all-reduce of `QSum` on that row, bit for bit.

Every rank encodes every row with the same segment table (`shards.row_segments`), so the scale
codes and the sign scales of row r are the same vector on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch
import torch.distributed as dist

from nfab.runtime.control.moment import rounding_variance
from nfab.wire import noise
from nfab.wire.blockq.reducer import BlockQSum
from nfab.wire.blockq.scatter import BlockQScatter, consecutive
from nfab.wire.contract import (
    ScaleAgreement,
    allgather_factor,
    allreduce_factor,
    gather_scales,
    reduce_scatter_flat,
)
from nfab.wire.qsum.reducer import QSum
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
    levels = red.round_levels(x, flat_lengths, codes, noise.Stratum(noise.Seeds(seeds), rank, w))
    if padded != c:  # level 0 in each row's tail: never decoded
        full = torch.zeros(w, padded, dtype=levels.dtype, device=levels.device)
        full[:, :c] = levels.view(w, c)
        levels = full.view(-1)
    payload = red.pack_levels(levels, w)  # each row at one rank's width
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


def sign_reduce_scatter(red: SignScatter, flat: torch.Tensor, sources: Sequence[tuple[int, int]],
                        segments: Sequence[Sequence[int]], numel: int, rank: int, group: dist.ProcessGroup | None,
                        out: torch.Tensor | None = None, step: int = 0) -> RowResult:
    """Majority sign of row `rank` (its first `numel` elements) over the W ranks' rows, times the
    rank-mean of each segment's mean |x| (all-gathered: every rank's scales, averaged in rank order
    as on DDP). The rows' segments (`segments[r]`: row r's table, padded to whole vote bytes) are
    read where they lie in `flat` (`sources`: `shards.row_sources`). `out` (`numel` fp32): decoded
    into directly."""
    w = len(segments)
    padded = sum(segments[0])
    enc = red.encode_rows(flat, sources, padded, w, tie=rank + step)  # zeros cancel as on DDP
    counts = red.scatter(enc.payload, w, group)  # SUM reduce-scatter of count lanes: my row's counts
    majority = red.owner_step(counts, w)
    scales = gather_scales(enc.scales.to(flat.device), w, group)
    first = sum(len(seg) for seg in segments[:rank])
    mine = list(segments[rank])
    if sum(mine) > numel:  # the row's tail (never read, never decoded)
        mine.pop()
    row_scales = scales[first : first + len(mine)]
    mean = red.decode(majority, row_scales, numel, mine, w, out)
    nbytes = (reduce_scatter_factor(w) * enc.payload.numel() * enc.payload.element_size()
              + allgather_factor(w) * enc.scales.numel() * 4)
    return RowResult(mean, nbytes, 2)


def qsum_reduce_scatter(red: QSum, rows: torch.Tensor, segments: Sequence[Sequence[int]], seeds: np.ndarray,
                        rank: int, group: dist.ProcessGroup | None, out: torch.Tensor | None = None) -> RowResult:
    """Mean of row `rank` over the W ranks' `rows` (W, C) by exact qsum: `segments[r]` is row r's
    segment table, `seeds` one noise seed per segment of all rows (this rank's own: ranks round
    independently, as on DDP). Rows are encoded where they lie; a row whose levels do not fill whole
    containers (q4/q2, C not a multiple of 2/4) is encoded on its own, so each row starts a container.
    `out` (C fp32 elements): decoded into directly."""
    w, c = rows.shape
    flat_lengths = [n for seg in segments for n in seg]
    shared = red.agree(red.local_scale(rows.reshape(-1), flat_lengths), group)  # blocking fp32 MAX, per segment
    firsts = list(accumulate([0, *(len(seg) for seg in segments)]))
    if c % red.lane_layout.lanes == 0:  # the rows' packings, end to end, are the whole input's
        payload = red.encode(rows.reshape(-1), flat_lengths, w, shared, noise.Seeds(seeds)).payload
    else:
        payload = torch.cat([red.encode(rows[r], segments[r], w, shared[firsts[r] : firsts[r + 1]],
                                        noise.Seeds(seeds[firsts[r] : firsts[r + 1]])).payload for r in range(w)])
    sums = torch.empty(payload.numel() // w, dtype=payload.dtype, device=payload.device)
    reduce_scatter_flat(sums, payload, op=dist.ReduceOp.SUM, group=group)  # exact: lanes hold W summands
    mean = red.decode(sums, shared[firsts[rank] : firsts[rank + 1]], c, list(segments[rank]), w, out)
    nbytes = (reduce_scatter_factor(w) * payload.numel() * payload.element_size()
              + allreduce_factor(w) * shared.numel() * shared.element_size())
    return RowResult(mean, nbytes, 2)


def row_numel(red: BlockQScatter | SignScatter | QSum, numel: int, world_size: int) -> int:
    """Elements of a group's row as its codec's segment tables cover it (`Reducer.row_numel`): sign
    pads each row to whole vote bytes (its tail a segment of its own); block routes and qsum take the
    row as it is."""
    return red.row_numel(numel, world_size)


def lossy_bytes(red: BlockQScatter | SignScatter | QSum, segments: Sequence[Sequence[int]],
                world_size: int) -> float:
    """Bytes one rank sends reducing a group's rows (`segments`: every row's table, as the codec's
    call gets it) by `block_reduce_scatter` / `sign_reduce_scatter` / `qsum_reduce_scatter`,
    computed without running them. The scales' bytes follow how the codec agrees them
    (`Reducer.scale_agreement`)."""
    w = world_size
    nseg = sum(len(seg) for seg in segments)
    agreement = red.scale_agreement
    if agreement is ScaleAgreement.PER_SLICE:  # whole containers per row (uint8), one fp32 scale per segment MAX-agreed
        return reduce_scatter_factor(w) * w * red.payload_bytes(sum(segments[0]), w) + allreduce_factor(w) * 4 * nseg
    payload = red.payload_bytes(w * padded_row(red, sum(segments[0]), w), w)
    if agreement is ScaleAgreement.PER_BLOCK:  # one uint8 code per block of every row, MAX-agreed
        blocks = sum(red.blocks_for(n) for seg in segments for n in seg)
        return reduce_scatter_factor(w) * payload + allreduce_factor(w) * blocks
    return reduce_scatter_factor(w) * payload + allgather_factor(w) * nseg * 4  # every segment's scale, all-gathered


def plain_bytes(numel: int, world_size: int, element_size: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter of a (W, numel) input: (W-1)/W of it."""
    return reduce_scatter_factor(world_size) * world_size * numel * element_size
