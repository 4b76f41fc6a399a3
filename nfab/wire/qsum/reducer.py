"""qsum: stochastically rounded levels, lane-packed and summed exactly."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from nfab.wire import host_slices, noise
from nfab.wire.contract import (
    Capacity,
    Encoded,
    Out,
    Reducer,
    ScaleAgreement,
    allreduce_factor,
    allreduce_future,
    finish_segments,
)
from nfab.wire.qsum import ops as qsum_ops
from nfab.wire.qsum.lanes import LaneLayout, layout_for
from nfab.wire.slices import Slices


class QSum(Reducer):
    """Stochastically rounded levels, offset to non-negative, lane-packed and summed exactly.

    Lanes are `bits` wide. For the W-rank sum to fit, each rank gets M = floor((2^bits-1)/W)
    steps, i.e. M+1 levels spanning [-s, s] with s the per-segment max |x| agreed across
    ranks (all-reduce MAX). Levels shrink as W grows; below 2 levels (M < 1) the reducer
    is over capacity.
    """

    name = "qsum"
    scale_agreement = ScaleAgreement.PER_SLICE
    """One fp32 max |x| per slice: the W ranks' levels sum exactly only on one shared grid."""
    own_scale_when_gathered = True
    """A gathered bucket sums nothing on the wire: each rank rounds in its own max |x|
    (`encode_own_views`), and the rows decode with their ranks' scales (`decode_gathered`)."""

    def __init__(self, bits: int) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"qsum supports 2, 4 or 8 bit lanes, got {bits}")
        self.bits = bits
        self.route = f"q{bits}"
        self._layout = layout_for(bits)

    @property
    def lane_layout(self) -> LaneLayout:
        """How the levels are packed: `bits`-wide lanes in uint8 containers (1, 2 or 4 a byte)."""
        return self._layout

    def max_level(self, world_size: int) -> int:
        return ((1 << self.bits) - 1) // world_size

    def capacity(self, world_size: int) -> Capacity:
        m = self.max_level(world_size)
        if m < 1:
            return Capacity(self.name, world_size, False, self.bits, m + 1,
                            reason=f"{self.bits}-bit lanes leave fewer than 2 levels per rank")
        return Capacity(self.name, world_size, True, lane_bits=self.bits, levels=m + 1)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        return self._layout.containers_for(numel) * self._layout.storage_bits // 8

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        # the MAX all-reduce of scales is a ring all-reduce of `segments` fp32 values
        return allreduce_factor(world_size) * (self.payload_bytes(numel, world_size) + 4 * segments)

    def level_values(self, world_size: int, count: int, device: torch.device) -> torch.Tensor:
        """Lane value (a sum of `count` ranks' levels) -> mean value in units of the scale.
        Made once per (lanes, W, count, device) and shared: callers read it, never write it."""
        return _level_values(self._layout.max_value, self.max_level(world_size), count, device)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None, tie=0) -> Encoded:
        assert shared_scale is not None, "qsum needs the shared (MAX) scale"
        m = self.max_level(world_size)
        lengths = list(lengths)
        safe = torch.where(shared_scale > 0, shared_scale, torch.ones_like(shared_scale)).to(torch.float32)
        keys = noise.draw_keys(generator, len(lengths), x.device)  # one per segment: see nfab.wire.noise
        levels, payload = qsum_ops.ops(x.device).levels(x, safe, lengths, m, keys, self._layout)
        values = self.level_values(world_size, 1, x.device)

        def local() -> torch.Tensor:  # from the levels (one-lane: the payload itself; read before launch)
            return finish_segments(values[levels.long()], shared_scale, lengths, None)

        return Encoded(payload, None, make_local=local)

    def reads_sq(self, buffer: torch.Tensor) -> bool:
        return qsum_ops.ops(buffer.device).reads_sq(buffer, self._layout)

    def encode_own_views(self, views: Sequence[torch.Tensor], lengths: Sequence[int], world_size: int,
                         generator: Any = None, with_sq: bool = False) -> tuple[Encoded, torch.Tensor]:
        """(`encode` of the concatenated `views` in their OWN per-segment scale, that scale).

        A gathered bucket sums nothing on the wire, so a rank rounds in its own max |x| and
        needs no agreement (`decode_gathered` decodes each row with its rank's scales). On
        the host, q8 `Slices` of an fp32 bucket are read where they lie and rounded in one
        compiled call that takes the max, the keys (from `noise.Seeds`) and, with `with_sq`
        (when `reads_sq`), their x^2 sum (`Encoded.sq`); elsewhere: gather, `local_scale`,
        `encode` — the same bits."""
        lengths = list(lengths)
        if isinstance(views, Slices) and isinstance(generator, noise.Seeds):
            fast = qsum_ops.ops(views.buffer.device).own_levels(views, generator.values, self.max_level(world_size),
                                                                self._layout, with_sq)
            if fast is not None:
                levels, own, sq = fast
                values = self.level_values(world_size, 1, levels.device)
                enc = Encoded(levels, None,
                              make_local=lambda: finish_segments(values[levels.long()], own, lengths, None))
                enc.sq = sq
                return enc, own
        x = host_slices.concat(views) if isinstance(views, Slices) else torch.cat(list(views))
        own = self.local_scale(x, lengths)
        return self.encode(x, lengths, world_size, own, generator), own

    def _levels_reference(self, x, safe, lengths, m, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """(levels, containers) in torch ops on any device: the definition the fast path matches."""
        return qsum_ops.levels_reference(x, safe, list(lengths), m, keys, self._layout)

    def launch(self, payload, world_size, group):
        return allreduce_future(payload, group)

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None):
        assert scale_mean is not None
        return qsum_ops.ops(reduced.device).decode_summed(
            reduced, self._layout, numel, self.level_values(world_size, world_size, reduced.device),
            self.max_level(world_size), world_size, scale_mean, list(lengths), out)

    def decode_gathered(
        self, payloads: Sequence[torch.Tensor], scales: torch.Tensor, numel: int, lengths: Sequence[int],
        out: Out = None,
    ) -> Any:
        """The mean of W gathered payloads, each encoded with its OWN rank's scales.

        When the payloads travel in an all-gather (a coalesced bucket) nothing needs to be
        summed on the wire, so ranks need not agree on a scale first: each encodes with
        its own per-segment max |x| (no blocking round, no saturation, finer levels) and
        every rank decodes each row with that row's scales (`scales`: W x segments) and
        adds them in rank order — the same bits on every rank.
        """
        stacked = isinstance(payloads, torch.Tensor)  # a (W, n) tensor of rows, or a sequence of rows
        w = payloads.shape[0] if stacked else len(payloads)
        lengths = list(lengths)
        device = payloads.device if stacked else payloads[0].device
        values = self.level_values(w, 1, device)
        return qsum_ops.ops(device).decode_gathered(payloads, self._layout, numel, values, scales, lengths, out)


@lru_cache(maxsize=64)
def _level_values(max_value: int, m: int, count: int, device: torch.device) -> torch.Tensor:
    levels = torch.arange(max_value + 1, dtype=torch.float32, device=device)
    return levels * (2.0 / (m * count)) - 1.0
