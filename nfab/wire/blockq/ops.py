"""Block-scaled qsum's ops: the operations whose implementations differ by device.

`BlockQOps` is the torch reference (every device; on the CPU the path `host_paths(False)` and a
machine without numba take): it runs the reducers' own torch code. `HostBlockQOps` is the
compiled CPU path (`nfab.wire.blockq.kernels`), the same bits. `ops(device)` gives the one
`nfab.wire.dispatch` chose for a device; `BlockQSum` and `BlockQScatter` call it and never ask
which it is. A host op whose kernel cannot read its inputs (memory not 1-D and contiguous,
another dtype) runs the torch one. Ops that need the reducer's geometry (its block, its steps)
or its torch code take it as `red`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from nfab.wire import dispatch, host_slices
from nfab.wire.blockq import radix
from nfab.wire.blockq.radix import RadixLayout
from nfab.wire.blockq.table import CODE_OFFSET, CODES_PER_OCTAVE, SCALES
from nfab.wire.contract import Out, split_out, write_into
from nfab.wire.noise import Stratum
from nfab.wire.qsum import host as qsum_host
from nfab.wire.qsum.lanes import LaneLayout, pack, unpack

BlockQSum = Any  # `nfab.wire.blockq.reducer.BlockQSum` (which imports this module)
BlockQScatter = Any  # `nfab.wire.blockq.scatter.BlockQScatter`
try:
    from nfab.wire.blockq import kernels as blockkernels
    from nfab.wire.qsum import chunk_kernels, lane_kernels
except ImportError:  # numba missing or unusable: the torch reference runs instead
    blockkernels = chunk_kernels = lane_kernels = None  # type: ignore[assignment]

_OCTAVE_BITS = SCALES[CODE_OFFSET : CODE_OFFSET + CODES_PER_OCTAVE].numpy().view(np.uint32).copy()
"""The bits of the octave [1, 2)'s four scales, for the CPU kernel's `scale_codes`."""


@lru_cache(maxsize=16)
def scales_on(device: torch.device) -> torch.Tensor:
    """SCALES on `device`, copied once (no copy in the hook body after the first step)."""
    return SCALES.to(device, non_blocking=True)


@lru_cache(maxsize=256)
def block_bounds(lengths: tuple[int, ...], block: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets (int64, read-only) of every block, in `grid.block_index`'s numbering."""
    seg_starts, seg_ends = host_slices.segment_bounds(lengths)
    per_segment = [np.arange(a, e, block, dtype=np.int64) for a, e in zip(seg_starts, seg_ends, strict=True)]
    first = np.concatenate(per_segment) if per_segment else np.empty(0, dtype=np.int64)
    last = np.minimum(first + block, np.repeat(seg_ends, [len(p) for p in per_segment]))
    first.flags.writeable = last.flags.writeable = False
    return first, last


def _flat(*tensors: torch.Tensor) -> bool:
    """Whether the kernels read these tensors as they are: 1-D and contiguous."""
    return all(t.dim() == 1 and t.is_contiguous() for t in tensors)


class BlockQOps:
    """The torch reference of block-scaled qsum's ops."""

    def scale_codes(self, block_max: torch.Tensor) -> torch.Tensor:
        """Smallest code whose scale covers each (fp32, contiguous) block max: `reducer.scale_codes`."""
        block_max = torch.nan_to_num(block_max, nan=0.0)  # a binary search sends NaN past the top
        codes = torch.searchsorted(scales_on(block_max.device), block_max)
        return codes.clamp_(max=255).to(torch.uint8)

    def block_scales(self, codes: torch.Tensor) -> torch.Tensor:
        """The scale of each uint8 code (fp32; 0 for code 0)."""
        return scales_on(codes.device)[codes.long()].contiguous()

    def local_scale(self, red: BlockQSum, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """`BlockQSum.local_scale`: max |x| per block, block 0 NaN when any element is non-finite."""
        return red.local_scale_reference(x, lengths)

    def levels(self, red: BlockQSum, x: torch.Tensor, lengths: list[int], shared: torch.Tensor,
               stratum: Stratum) -> torch.Tensor:
        """Stochastically rounded levels (uint8) against the agreed block scales."""
        return red._levels(x, lengths, shared, stratum)

    def pack(self, values: torch.Tensor, layout: LaneLayout | RadixLayout) -> torch.Tensor:
        """Non-negative integers packed in bit lanes or radix digits (`pack_any`)."""
        return pack_any(values, layout, False)

    def decode(self, red: BlockQSum, reduced: torch.Tensor, scale_mean: torch.Tensor, numel: int,
               lengths: list[int], layout: LaneLayout | RadixLayout, world_size: int, out: Out) -> Any:
        """Summed lanes or digits -> their mean, times the block scales."""
        return red.decode_reference(reduced, scale_mean, numel, lengths, layout, world_size, out)

    # ---- blockqscatter ------------------------------------------------------------------
    def pack_lane_shards(self, levels: torch.Tensor, layout: LaneLayout, world_size: int,
                         shard: int) -> torch.Tensor:
        """Levels in W shards of `shard` elements (the tail level 0), each packed on its own."""
        padded = torch.zeros(world_size * shard, dtype=torch.uint8, device=levels.device)
        padded[: levels.numel()] = levels
        return torch.cat([pack(v, layout) for v in padded.view(world_size, shard)])

    def pack_digit_shards(self, levels: torch.Tensor, layout: RadixLayout, padded: int) -> torch.Tensor:
        """Levels padded with 0 to `padded` elements (W whole shards), packed as base-L digits: digits
        are consecutive and a shard is whole containers, so this is the shards' packings, concatenated."""
        full = torch.zeros(padded, dtype=torch.uint8, device=levels.device)
        full[: levels.numel()] = levels
        return radix.pack(full, layout)

    def owner_sums(self, received: torch.Tensor, world_size: int, own: LaneLayout | RadixLayout,
                   layout: LaneLayout | RadixLayout, shard: int) -> torch.Tensor:
        """The W ranks' own-layout containers of one shard -> their exact sums, packed in `layout`."""
        rows = received.view(world_size, received.numel() // world_size)
        sums = torch.zeros(shard, dtype=torch.int64, device=received.device)
        for row in rows:
            sums += (radix.unpack(row, own, shard) if isinstance(own, RadixLayout) else unpack(row, own, shard)
                     ).to(torch.int64)
        return pack_any(sums, layout, False)

    def scale_blocks_(self, red: BlockQScatter, mean: torch.Tensor, scale_mean: torch.Tensor,
                      lengths: list[int]) -> None:
        """`mean` (fp32, every element) times its block's agreed scale, in place."""
        mean.mul_(red.element_scales(scale_mean, lengths))


class HostBlockQOps(BlockQOps):
    """The compiled CPU path (`blockkernels`)."""

    def scale_codes(self, block_max: torch.Tensor) -> torch.Tensor:
        if not _flat(block_max):
            return super().scale_codes(block_max)
        # the same exponent arithmetic, compiled for the CPU (NaN read there too)
        codes = torch.empty(block_max.numel(), dtype=torch.uint8, device="cpu")  # compiled: CPU
        blockkernels.scale_codes(block_max.numpy().view(np.uint32), _OCTAVE_BITS, codes.numpy())
        return codes

    def block_scales(self, codes: torch.Tensor) -> torch.Tensor:
        if not _flat(codes):
            return super().block_scales(codes)
        out = torch.empty(codes.numel(), dtype=torch.float32, device="cpu")  # compiled: CPU
        blockkernels.scales_of_codes(codes.numpy(), SCALES.numpy(), out.numpy())
        return out

    def local_scale(self, red: BlockQSum, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """One compiled pass; a non-finite element flags block 0 with NaN as the reference does
        (read here from the block maxima: any inf or NaN makes one non-finite)."""
        if not host_slices.flat_float(x):
            return super().local_scale(red, x, lengths)
        starts, ends = block_bounds(tuple(lengths), red.block)
        bits = np.empty(starts.size, dtype=np.uint32)
        x32 = x.detach().to(torch.float32)  # widening bf16/fp16 is exact (the reference widens too)
        blockkernels.block_max_bits(x32.view(torch.int32).numpy().view(np.uint32), starts, ends, bits)
        out = torch.from_numpy(bits.view(np.float32))
        if bits.size and int(bits.max()) >= 0x7F800000:
            out[0] = np.nan
        return out

    def levels(self, red: BlockQSum, x: torch.Tensor, lengths: list[int], shared: torch.Tensor,
               stratum: Stratum) -> torch.Tensor:
        """One compiled pass (the noise computed there, never stored)."""
        if not (host_slices.flat_float(x) and _flat(shared)):
            return super().levels(red, x, lengths, shared, stratum)
        m = red.steps
        starts, ends = host_slices.segment_bounds(lengths)
        levels = torch.empty(x.numel(), dtype=torch.uint8, device="cpu")  # compiled: CPU
        keys = stratum.keys(len(lengths), x.device).contiguous()
        blockkernels.block_levels(x.detach().to(torch.float32).numpy(), keys.numpy(), stratum.shift, starts, ends,
                                  red.block, red.block_scales(shared).numpy(), np.float32(1.0),
                                  np.float32(0.5 * m), m, levels.numpy())
        return levels

    def pack(self, values: torch.Tensor, layout: LaneLayout | RadixLayout) -> torch.Tensor:
        if not values.is_contiguous():
            return super().pack(values, layout)
        return pack_any(values, layout, True)

    def decode(self, red: BlockQSum, reduced: torch.Tensor, scale_mean: torch.Tensor, numel: int,
               lengths: list[int], layout: LaneLayout | RadixLayout, world_size: int, out: Out) -> Any:
        """Digits, value table and block scales in one compiled pass (chunked bit lanes: the table's
        arithmetic, `values`' entries, with unit 2 / `total`; plain bit lanes: the compiled table
        decode, then the block scales in place)."""
        if not _flat(reduced, scale_mean):
            return super().decode(red, reduced, scale_mean, numel, lengths, layout, world_size, out)
        values = red.sum_values(layout, world_size, reduced.device)
        one, _ = split_out(out)  # a bucket slice is decoded into directly; slices or bf16 by a copy
        direct = one if one is not None and _flat(one) and one.dtype == torch.float32 else None
        total = red.steps * world_size
        res = torch.empty(numel, dtype=torch.float32, device="cpu") if direct is None else direct  # compiled: CPU
        starts, ends = block_bounds(tuple(lengths), red.block)
        block_scale = red.block_scales(scale_mean).numpy()
        if isinstance(layout, RadixLayout) and layout.chunk:
            blockkernels.radix_decode_chunked(reduced.numpy(), layout.radix, layout.digits, layout.chunk,
                                              numel, values.numpy(), starts, ends, block_scale, res.numpy())
        elif isinstance(layout, RadixLayout):
            blockkernels.radix_decode_blocks(reduced.numpy(), layout.radix, layout.digits, numel, values.numpy(),
                                             starts, ends, block_scale, res.numpy())
        elif layout.chunk:  # the table's arithmetic per row, then the block scales, in one pass
            blockkernels.lanes_decode_chunked(reduced.numpy(), layout.lane_bits, layout.lanes,
                                              layout.chunk, numel, np.float32(2.0 / total), starts, ends,
                                              block_scale, res.numpy())
        else:
            qsum_host.decode_table(reduced, layout, numel, values, out=res)
            blockkernels.scale_blocks(res.numpy(), starts, ends, block_scale)
        return res if direct is not None else write_into(out, res)

    # ---- blockqscatter ------------------------------------------------------------------
    def pack_lane_shards(self, levels: torch.Tensor, layout: LaneLayout, world_size: int,
                         shard: int) -> torch.Tensor:
        if not levels.is_contiguous():
            return super().pack_lane_shards(levels, layout, world_size, shard)
        out = torch.empty(world_size, shard // layout.lanes, dtype=layout.container, device="cpu")
        blockkernels.pack_lane_shards(levels.numpy(), levels.numel(), shard, layout.lane_bits, layout.lanes,
                                      out.numpy())
        return out.view(-1)

    def pack_digit_shards(self, levels: torch.Tensor, layout: RadixLayout, padded: int) -> torch.Tensor:
        if not levels.is_contiguous():
            return super().pack_digit_shards(levels, layout, padded)
        out = torch.empty(padded // layout.digits, dtype=torch.int64, device="cpu")  # missing digits pack as 0
        blockkernels.radix_pack(levels.numpy(), layout.radix, layout.digits, out.numpy())
        return out

    def owner_sums(self, received: torch.Tensor, world_size: int, own: LaneLayout | RadixLayout,
                   layout: LaneLayout | RadixLayout, shard: int) -> torch.Tensor:
        if not _flat(received):
            return super().owner_sums(received, world_size, own, layout, shard)
        rows = received.view(world_size, received.numel() // world_size).numpy()
        sums = np.empty(shard, dtype=np.int32)
        if isinstance(own, RadixLayout):
            _sum_digit_rows(rows, own, sums)
        else:
            blockkernels.sum_lane_rows(rows, own.lane_bits, own.lanes, sums)
        if isinstance(layout, RadixLayout):
            return pack_any(torch.from_numpy(sums), layout, True)
        out = torch.empty(1, shard // layout.lanes, dtype=layout.container, device="cpu")
        blockkernels.pack_lane_shards(sums, shard, shard, layout.lane_bits, layout.lanes, out.numpy())
        return out.view(-1)

    def scale_blocks_(self, red: BlockQScatter, mean: torch.Tensor, scale_mean: torch.Tensor,
                      lengths: list[int]) -> None:
        if not _flat(mean, scale_mean):
            return super().scale_blocks_(red, mean, scale_mean, lengths)
        starts, ends = block_bounds(tuple(lengths), red.block)
        blockkernels.scale_blocks(mean.numpy(), starts, ends, red.block_scales(scale_mean).numpy())
        return None


def _sum_digit_rows(rows: np.ndarray, layout: RadixLayout, out: np.ndarray) -> None:
    """out[e] = sum over rows of digit e of the row's containers (exact integers): the owner's
    sum of W ranks' own levels packed as base-L digits."""
    digits = np.empty(out.size, dtype=np.uint8)
    out[:] = 0
    for row in rows:
        blockkernels.radix_digits(row, layout.radix, layout.digits, out.size, digits)
        out += digits


def pack_any(values: torch.Tensor, layout: LaneLayout | RadixLayout, compiled: bool) -> torch.Tensor:
    """`values` (non-negative integers) packed in bit lanes or radix digits; `compiled`: by the CPU
    kernels (same containers)."""
    if not isinstance(layout, RadixLayout):
        return _pack_lanes_host(values, layout) if compiled else pack(values, layout)
    if compiled:
        assert blockkernels is not None
        payload = torch.empty(layout.containers_for(values.numel()), dtype=torch.int64, device="cpu")
        if layout.chunk:
            blockkernels.radix_pack_chunked(values.reshape(-1).numpy(), layout.radix, layout.digits, layout.chunk,
                                            payload.numpy())
        else:
            blockkernels.radix_pack(values.numpy(), layout.radix, layout.digits, payload.numpy())
        return payload
    return radix.pack(values, layout)


def _pack_lanes_host(values: torch.Tensor, layout: LaneLayout) -> torch.Tensor:
    """`lanes.pack` of `values` (uint8 levels, or the owner's integer sums) by the CPU kernels. 1-, 2-
    and 4-bit lanes of uint8 containers fold whole words of 8 levels in a register
    (`lane_kernels.pack_bytes`); wider containers go by `pack_lane_shards` on their whole containers,
    read in place, the last, partial one from a padded copy of its few values. Why: padding the
    values to whole containers first copied all of them (1 ms per 4M on one core, beside a 2.8 ms
    pack), and the lane loops over uint8 containers took 2.8 ms where the word folds take 0.25."""
    assert blockkernels is not None and lane_kernels is not None  # `lanes.pack` is one shard of `pack_lane_shards`
    n, lanes = values.numel(), layout.lanes
    v = values.reshape(-1).numpy()
    payload = torch.empty(layout.containers_for(n), dtype=layout.container, device="cpu")
    out = payload.numpy()
    if layout.chunk:  # contiguous rows, read in place
        assert chunk_kernels is not None
        chunk_kernels.pack_chunked(v, n, layout.lane_bits, lanes, layout.chunk, out)
        return payload
    if layout.container == torch.uint8 and layout.lane_bits in (1, 2, 4) and v.dtype == np.uint8:
        lane_kernels.pack_bytes(v, layout.lane_bits, out)
        return payload
    if lanes > 8:  # several blocks: element order depends on the container count, so pad to whole ones
        whole = out.size * lanes
        padded = np.zeros(whole, dtype=v.dtype)
        padded[:n] = v
        blockkernels.pack_lane_shards(padded, whole, whole, layout.lane_bits, lanes, out.reshape(1, -1))
        return payload
    full = n // lanes
    if full:
        blockkernels.pack_lane_shards(v, full * lanes, full * lanes, layout.lane_bits, lanes, out[:full].reshape(1, -1))
    if full < out.size:
        tail = np.zeros(lanes, dtype=v.dtype)
        tail[: n - full * lanes] = v[full * lanes :]
        blockkernels.pack_lane_shards(tail, lanes, lanes, layout.lane_bits, lanes, out[full:].reshape(1, -1))
    return payload


_HOST = HostBlockQOps if blockkernels is not None else None


def ops(device: torch.device) -> BlockQOps:
    """The block-scaled qsum ops for `device` (`dispatch.ops`: chosen once per device)."""
    return dispatch.ops(device, BlockQOps, _HOST)
