"""qsum's ops: the operations whose implementations differ by device.

`QSumOps` is the torch reference (every device; on the CPU the path `host_paths(False)` and a
machine without numba take); `HostQSumOps` the compiled CPU path (`nfab.wire.qsum.host`), the
same bits. `ops(device)` gives the one `nfab.wire.dispatch` chose for a device; `QSum` calls it
and never asks which it is (the lane table decode: `qsum.host.TableOps`). A host op whose kernel cannot read
its inputs (memory not 1-D and contiguous, another dtype, a chunked layout) runs the torch one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nfab.wire import dispatch, host_slices, noise, segments
from nfab.wire.contract import Out, decode_scaled, split_out, write_into
from nfab.wire.qsum import host as qsum_host
from nfab.wire.qsum.lanes import LaneLayout, pack
from nfab.wire.slices import Slices


def levels_reference(x: torch.Tensor, safe: torch.Tensor, lengths: list[int], m: int, keys: torch.Tensor,
                     layout: LaneLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels, containers) in torch ops on any device: the definition the compiled path matches."""
    if len(lengths) == 1:
        t = torch.div(x.to(torch.float32), safe.reshape(-1)[0])
    else:  # one division for all segments (a bucket's norms and biases are many small ones)
        t = torch.div(x.to(torch.float32),
                      torch.repeat_interleave(safe, segments.segment_counts(lengths, x.device), output_size=x.numel()))
    t.add_(1.0).mul_(0.5 * m)  # level coordinate in [0, m] for |x| <= scale
    t.add_(noise.uniform(keys, lengths))
    levels = t.floor_().clamp_(0, m).to(torch.uint8)  # unbiased stochastic rounding
    return levels, pack(levels, layout)


class QSumOps:
    """The torch reference of qsum's ops."""

    def levels(self, x: torch.Tensor, safe: torch.Tensor, lengths: list[int], m: int, keys: torch.Tensor,
               layout: LaneLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(levels uint8, lane containers) of the stochastic rounding of `x` in the safe scales."""
        return levels_reference(x, safe, lengths, m, keys, layout)

    def reads_sq(self, buffer: torch.Tensor, layout: LaneLayout) -> bool:
        """Whether `own_levels` reads `buffer` (and so takes its x^2 on the same read)."""
        return False

    def own_levels(self, slices: Slices, seeds: np.ndarray, m: int, layout: LaneLayout,
                   with_sq: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """(levels, own scales, x^2 sum or None) of `slices` read where they lie, each rounded in
        its own max |x| in one pass; None where no such pass exists (gather, scale, `levels`)."""
        return None

    def decode_summed(self, reduced: torch.Tensor, layout: LaneLayout, numel: int, values: torch.Tensor,
                      m: int, world_size: int, scale_mean: torch.Tensor, lengths: list[int], out: Out) -> Any:
        """Summed lanes -> mean values x segment scale (`values`: lane value -> mean in scale units,
        the sum of W ranks' levels of M steps)."""
        return decode_scaled(reduced, layout, numel, values, scale_mean, lengths, out)

    def decode_gathered(self, payloads: torch.Tensor | Sequence[torch.Tensor], layout: LaneLayout, numel: int,
                        values: torch.Tensor, scales: torch.Tensor, lengths: list[int], out: Out) -> Any:
        """The mean of W gathered payloads, row r decoded with scales[r], added in rank order."""
        w = payloads.shape[0] if isinstance(payloads, torch.Tensor) else len(payloads)
        total = decode_scaled(payloads[0], layout, numel, values, scales[0], lengths)
        for r in range(1, w):
            total += decode_scaled(payloads[r], layout, numel, values, scales[r], lengths)
        total.mul_(1.0 / w)
        return write_into(out, total)


class HostQSumOps(QSumOps):
    """The compiled CPU path: the rounding fused with the noise and the packing, the one-lane
    (q8) decodes in one pass."""

    def levels(self, x: torch.Tensor, safe: torch.Tensor, lengths: list[int], m: int, keys: torch.Tensor,
               layout: LaneLayout) -> tuple[torch.Tensor, torch.Tensor]:
        if not (host_slices.flat_float(x) and safe.is_contiguous()):
            return super().levels(x, safe, lengths, m, keys, layout)
        # one compiled pass: divide, shift, add the noise (computed, never stored), round, clamp
        return qsum_host.qsum_levels(x, keys, safe.reshape(-1), lengths, m, layout)

    def reads_sq(self, buffer: torch.Tensor, layout: LaneLayout) -> bool:
        return layout.lanes == 1 and buffer.is_contiguous() and buffer.dtype == torch.float32

    def own_levels(self, slices: Slices, seeds: np.ndarray, m: int, layout: LaneLayout,
                   with_sq: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        if not self.reads_sq(slices.buffer, layout):
            return None
        return qsum_host.qsum_own_levels(slices, seeds, m, with_sq)

    def decode_summed(self, reduced: torch.Tensor, layout: LaneLayout, numel: int, values: torch.Tensor,
                      m: int, world_size: int, scale_mean: torch.Tensor, lengths: list[int], out: Out) -> Any:
        one, dests = split_out(out)
        if layout.lanes == 1 and dests is None and numel:  # q8: computed on the CPU, no table
            step = float(np.float32(2.0 / (m * world_size)))
            res = qsum_host.decode_levels(reduced, step, scale_mean, lengths, one)
            if res is not None:
                return res
        return super().decode_summed(reduced, layout, numel, values, m, world_size, scale_mean, lengths, out)

    def decode_gathered(self, payloads: torch.Tensor | Sequence[torch.Tensor], layout: LaneLayout, numel: int,
                        values: torch.Tensor, scales: torch.Tensor, lengths: list[int], out: Out) -> Any:
        if layout.lanes == 1 and out is not None and numel:  # one compiled pass into `out`
            rows = payloads if isinstance(payloads, torch.Tensor) else torch.stack(list(payloads))
            if qsum_host.gathered_levels(rows, values, scales, lengths, out):  # reads each row's first numel levels
                return out
        return super().decode_gathered(payloads, layout, numel, values, scales, lengths, out)


def ops(device: torch.device) -> QSumOps:
    """The qsum ops for `device` (`dispatch.ops`: chosen once per device)."""
    return dispatch.ops(device, QSumOps, HostQSumOps)
