"""qsum's compiled CPU path: tensors in, `level_kernels` and `lane_kernels` on their memory.

Stochastic rounding fused with the noise and the lane packing, the summed and gathered
decodes, and the lane containers' pack (`bits_to_lanes`, also the sign votes' count lanes)
and table decode. Each function here has a torch reference (`nfab.wire.qsum.ops.QSumOps`,
`nfab.wire.qsum.lanes`) that every other device runs and that gives the same bits;
`nfab.wire.qsum.ops.HostQSumOps` calls them, on the CPU, and each checks only what its kernel
reads (returning None or False otherwise). `decode_table` (every codec's) has its own small
pair, `TableOps` and `HostTableOps`: `contract` imports it from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from nfab.wire import dispatch
from nfab.wire.host_slices import HALF, as_f32, segment_bounds, sq_total, targets
from nfab.wire.qsum import lanes
from nfab.wire.qsum.lanes import LaneLayout
from nfab.wire.slices import Slices

try:
    from nfab.wire.qsum import lane_kernels, level_kernels
except ImportError:  # numba missing: `dispatch.AVAILABLE` is False and the torch reference runs
    lane_kernels = level_kernels = None  # type: ignore[assignment]


@lru_cache(maxsize=64)
def _spread(lane_bits: int) -> np.ndarray:
    assert lane_kernels is not None
    return lane_kernels.spread_table(lane_bits)


_NP = {torch.uint8: np.uint8, torch.int32: np.int32, torch.int64: np.int64}


def bits_to_lanes(padded: np.ndarray, numel: int, layout: LaneLayout, out: np.ndarray) -> None:
    """The compiled spread of `numel` votes into `out` (every container written, so it may come
    from np.empty): the uint8 kernel or the wide one."""
    assert lane_kernels is not None
    spread = _spread(layout.lane_bits)
    if out.itemsize == 1:
        lane_kernels.bits_to_byte_lanes(padded, numel, layout.lanes, out, spread)
    else:
        lane_kernels.bits_to_wide_lanes(padded, numel, layout.lane_bits, layout.lanes, out, spread,
                                        _whole_groups(padded, numel, layout, out, spread))


def _whole_groups(padded: np.ndarray, numel: int, layout: LaneLayout, out: np.ndarray, spread: np.ndarray) -> int:
    """Fill the leading whole containers of the W = 4..7 and 16..31 layouts a group at a time
    (one pass, scalar byte-table lookups); how many it wrote (0 for other layouts)."""
    assert lane_kernels is not None
    m = out.size
    if layout.lane_bits == 3 and layout.lanes == 21 and numel > 16 * m:
        done = min(m, (numel - 16 * m) // 5) & ~7  # the last block's elements all below numel
        lane_kernels.spread_21x3(padded, m, done, spread, out)
        return done
    if layout.lane_bits == 5 and layout.lanes == 6:
        done = min(m, numel // 6) & ~3
        lane_kernels.spread_6x5(padded, done, spread, out)
        return done
    return 0


def gathered_levels(rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
                    out: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    """qsum's gathered decode for one-lane uint8 levels: the mean of the W rows, each decoded
    with its own rank's scales (`scales`: W x segments), written into `out` (one fp32 tensor of
    all segments, or `Slices`) in one compiled pass; False when it does not apply (the caller
    then decodes by table, rank by rank: the same bits). Only the segments' columns of `rows`
    are read: a row may run on past them."""
    if not (rows.dtype == torch.uint8 and rows.dim() == 2):
        return False
    span = targets(out, lengths)
    if span is None:
        return False
    assert level_kernels is not None
    starts, ends = segment_bounds(lengths)
    level_kernels.gathered_levels(rows.numpy(), as_f32(values), as_f32(scales), starts, ends,
                                  np.float32(1.0 / rows.shape[0]), span[0].numpy(), span[1])
    return True


def decode_table(containers: torch.Tensor, layout: LaneLayout, numel: int, values: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """`lanes.decode_table`: one compiled pass on CPU, the torch reference elsewhere (same values:
    the device's `TableOps`)."""
    return dispatch.ops(containers.device, TableOps, HostTableOps).decode(containers, layout, numel, values, out)


class TableOps:
    """The lane containers' table decode (every codec's `contract.decode_scaled`): the torch reference."""

    def decode(self, containers: torch.Tensor, layout: LaneLayout, numel: int, values: torch.Tensor,
               out: torch.Tensor | None) -> torch.Tensor:
        return lanes.decode_table(containers, layout, numel, values, out)


class HostTableOps(TableOps):
    """The compiled table decode, where its kernels read the containers."""

    def decode(self, containers: torch.Tensor, layout: LaneLayout, numel: int, values: torch.Tensor,
               out: torch.Tensor | None) -> torch.Tensor:
        res = decode_table_here(containers, layout, numel, values, out)
        return res if res is not None else super().decode(containers, layout, numel, values, out)


def decode_table_here(containers: torch.Tensor, layout: LaneLayout, numel: int, values: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor | None:
    """`decode_table` compiled; None where it does not apply. The kernels read the plain lane
    order; a chunked layout (blockq's, which decodes by `blockq.kernels.lanes_decode_chunked`)
    takes the reference."""
    fast = containers.is_contiguous() and not layout.chunk and values.numel() == layout.max_value + 1 and (
        out is None or (out.is_contiguous() and out.dtype == torch.float32))
    if not fast:
        return None
    assert lane_kernels is not None
    res = torch.empty(numel, dtype=torch.float32, device="cpu") if out is None else out  # compiled: CPU
    if numel == 0:
        return res
    table = values.detach().to(torch.float32).contiguous().numpy()
    decode = lane_kernels.decode_byte_lanes if containers.element_size() == 1 else lane_kernels.decode_wide_lanes
    decode(containers.numpy(), layout.lane_bits, layout.lanes, numel, table, res.view(-1).numpy())
    return res


def decode_levels(levels: torch.Tensor, step: float, scales: torch.Tensor, lengths: Sequence[int],
                  out: torch.Tensor | None) -> torch.Tensor | None:
    """Summed one-lane (uint8) qsum levels -> (level * step - 1) * segment scale, fp32, on the
    CPU into `out` (or a new tensor); None when the compiled path does not apply (the caller
    then decodes by table: the same bits, `fl(fl(fl(l * step) - 1) * s)` either way)."""
    if not (levels.is_contiguous() and levels.dtype == torch.uint8
            and (out is None or (out.is_contiguous() and out.dtype == torch.float32))):
        return None
    n = sum(lengths)
    assert level_kernels is not None and levels.numel() >= n
    res = torch.empty(n, dtype=torch.float32, device="cpu") if out is None else out  # compiled: CPU
    starts, ends = segment_bounds(lengths)
    level_kernels.decode_levels(levels.numpy(), starts, ends, np.float32(step), np.float32(1.0),
                                scales.reshape(-1).to(torch.float32).numpy(), res.view(-1).numpy())
    return res


def qsum_levels(x: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
                max_level: int, layout: LaneLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels uint8, lane containers) of qsum's stochastic rounding, fused in one pass.

    `keys` are the segments' noise keys (`nfab.wire.noise`; the noise is computed in the
    kernel, never stored), `scales` the safe (non-zero) per-segment scales; bf16/fp16 are
    read as they are. Same bits as the torch reference.
    """
    assert level_kernels is not None
    n = x.numel()
    starts, ends = segment_bounds(lengths)
    levels = np.empty(n, dtype=np.uint8)
    k = keys.numpy()
    sc = scales.to(torch.float32).contiguous().numpy()
    one, half_m = np.float32(1.0), np.float32(0.5 * max_level)
    if x.dtype == torch.float32:
        level_kernels.qsum_levels(x.numpy(), k, starts, ends, sc, one, half_m, max_level, levels)
    else:
        level_kernels.qsum_levels_half(x.view(torch.int16).numpy().view(np.uint16), HALF[x.dtype], k, starts, ends, sc,
                                       one, half_m, max_level, levels)
    if layout.lanes == 1:  # one-lane containers are the levels: the payload is `levels` itself
        lv = torch.from_numpy(levels)
        return lv, lv
    containers = np.empty(layout.containers_for(n), dtype=np.uint8)
    assert lane_kernels is not None
    lane_kernels.pack_bytes(levels, layout.lane_bits, containers)
    return torch.from_numpy(levels), torch.from_numpy(containers)


def qsum_own_levels(slices: Slices, seeds: np.ndarray, max_level: int,
                    with_sq: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(levels uint8, own scales fp32, x^2 sum fp32 0-d or None) of fp32 `slices` read where they
    lie, each segment rounded in its own max |x| with the key its seed draws first
    (`level_kernels.qsum_own_scale`: one call for the group); None off the host or for other dtypes."""
    b = slices.buffer
    if not (b.is_contiguous() and b.dim() == 1 and b.dtype == torch.float32):
        return None
    assert level_kernels is not None
    lengths = np.asarray(slices.lengths, dtype=np.int64)
    levels = np.empty(int(lengths.sum()), dtype=np.uint8)
    amax = np.empty(lengths.size, dtype=np.uint32)
    sqs = np.empty(lengths.size if with_sq else 0, dtype=np.float64)
    level_kernels.qsum_own_scale(b.numpy(), slices.offsets, lengths, seeds, np.float32(1.0),
                                 np.float32(0.5 * max_level), max_level, levels, amax, amax.view(np.float32), sqs)
    sq = sq_total(sqs) if with_sq else None
    return torch.from_numpy(levels), torch.from_numpy(amax.view(np.float32)), sq
