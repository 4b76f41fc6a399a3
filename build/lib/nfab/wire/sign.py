"""Sign reducers: 1-bit votes counted exactly, as lane sums (signcount) or gathered bits (signgather)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nfab.wire import codecs
from nfab.wire import lanes as _lanes
from nfab.wire.lanes import LaneLayout, count_lane_bits, layout_for, pack, unpack
from nfab.wire.reducer import (
    Capacity,
    Encoded,
    Out,
    Reducer,
    all_gather_flat,
    allgather_factor,
    allreduce_factor,
    allreduce_future,
    decode_scaled,
    finish_segments,
    split_out,
    write_into,
)


def _mean_abs(sums: np.ndarray, lengths: Sequence[int]) -> torch.Tensor:
    """Per-segment mean |x| (fp32) from the float64 |x| sums of the fused encoders."""
    return torch.from_numpy((sums / np.maximum(np.asarray(lengths, dtype=np.float64), 1)).astype(np.float32))


class _SignReducer(Reducer):
    """Shared decode for sign votes: a positive count per element -> vote x mean scale."""

    route = "sign"

    def __init__(self, vote: str = "majority") -> None:
        codecs.vote_table(2, vote)  # validate early
        self.vote = vote

    def _sign_encode(self, x: torch.Tensor, lengths: Sequence[int], layout: LaneLayout) -> Encoded:
        """Votes packed into `layout`, per-segment mean |x|, and (lazily) this rank's ±scale values."""
        lengths = list(lengths)
        n = x.numel()
        if n and _lanes.sign_pack_supported(x, layout):
            gather = layout.lane_bits == 1  # the payload is the packed votes themselves
            payload, sums, packed = _lanes.sign_pack(x, lengths, layout, want_bits=not gather)
            scales = _mean_abs(sums, lengths)
            bits = payload.numpy().copy() if gather else packed
            return Encoded(payload, scales, make_local=lambda: codecs.sign_values_packed(bits, n, scales, lengths))
        bits = codecs.sign_bits(x)
        scales = codecs.segment_mean_abs(x, lengths)
        return Encoded(pack(bits, layout), scales, make_local=lambda: codecs.sign_values(bits, scales, lengths))

    def _vote_values(self, layout: LaneLayout, world_size: int, device: torch.device) -> torch.Tensor:
        """Vote per lane value, padded with 0 to the lane's range (sums above W never occur)."""
        table = torch.zeros(layout.max_value + 1, dtype=torch.float32, device=device)
        table[: world_size + 1] = codecs.vote_table(world_size, self.vote, device)
        return table

    def _decode_containers(self, containers, layout, scale_mean, numel, lengths, world_size, out=None):
        """Count lanes -> vote x mean scale, by table (one lookup per group of lanes on CPU)."""
        assert scale_mean is not None
        return decode_scaled(containers, layout, numel, self._vote_values(layout, world_size, containers.device),
                              scale_mean, lengths, out)

    def _decode_counts(self, counts, scale_mean, lengths, world_size, out: Out = None) -> Any:
        table = codecs.vote_table(world_size, self.vote, counts.device)
        one, dests = split_out(out)
        res = table[counts.to(torch.int64)]
        assert scale_mean is not None
        return finish_segments(res if dests is not None else write_into(one, res), scale_mean, lengths, out)


class SignCount(_SignReducer):
    """Compact sign-count aggregation: lane-packed 1-counts in ONE integer SUM all-reduce.

    Each rank puts its positive votes (0/1) into lanes of ceil(log2(W+1)) bits; the SUM
    of the containers yields, per element, how many ranks voted positive, c in [0, W].
    """

    name = "signcount"

    def layout(self, world_size: int) -> LaneLayout:
        return layout_for(count_lane_bits(world_size))

    def capacity(self, world_size: int) -> Capacity:
        bits = count_lane_bits(world_size)
        if bits > 63:
            return Capacity(self.name, world_size, False, bits, reason="count lanes wider than 63 bits")
        return Capacity(self.name, world_size, True, lane_bits=bits)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        lay = self.layout(world_size)
        return lay.containers_for(numel) * lay.storage_bits // 8

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return (allreduce_factor(world_size) * self.payload_bytes(numel, world_size)
                + allgather_factor(world_size) * 4 * segments)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None) -> Encoded:
        return self._sign_encode(x, lengths, self.layout(world_size))

    def launch(self, payload, world_size, group):
        return allreduce_future(payload, group)

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None):
        return self._decode_containers(reduced, self.layout(world_size), scale_mean, numel, lengths, world_size, out)


class SignGather(_SignReducer):
    """Packed 1-bit signs via all-gather, counted locally: cheaper than signcount at small W."""

    name = "signgather"
    _layout = layout_for(1)

    def capacity(self, world_size: int) -> Capacity:
        return Capacity(self.name, world_size, ok=world_size >= 1, lane_bits=1)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        return self._layout.containers_for(numel)

    def collective_factor(self, world_size: int) -> float:
        return allgather_factor(world_size)

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return allgather_factor(world_size) * (self.payload_bytes(numel, world_size) + 4 * segments)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None) -> Encoded:
        return self._sign_encode(x, lengths, self._layout)

    def encode_views(self, views, lengths, world_size) -> Encoded:
        views, lengths = list(views), list(lengths)
        if not views or not all(_lanes.sign_pack_supported(v, self._layout) for v in views):
            return super().encode_views(views, lengths, world_size)
        payload, sums = _lanes.sign_bits_views(views)
        scales = _mean_abs(sums, lengths)
        bits = payload.numpy()  # an all-gather reads its input and never overwrites it
        n = sum(lengths)
        return Encoded(payload, scales, make_local=lambda: codecs.sign_values_packed(bits, n, scales, lengths))

    def launch(self, payload, world_size, group):
        out = torch.empty(world_size * payload.numel(), dtype=payload.dtype, device=payload.device)
        work = all_gather_flat(out, payload, group=group, async_op=True)
        return work.get_future().then(lambda _: out)

    def combine(self, payloads):
        return torch.cat(list(payloads))

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None):
        rows = reduced.view(world_size, -1)
        count_layout = layout_for(count_lane_bits(world_size))
        one, _ = split_out(out)
        if (_lanes._numpy_ok(reduced) and count_layout.lane_bits <= 4 and numel
                and (one is None or (one.dtype == torch.float32 and one.is_contiguous() and _lanes._numpy_ok(one)))):
            # bit-sliced counts, one table lookup per group of elements (vote x scale folded in)
            assert scale_mean is not None
            lengths = list(lengths)
            vals = self._vote_values(count_layout, world_size, reduced.device)
            if len(lengths) == 1:
                vals = vals * scale_mean.reshape(-1)[0]
            rows_np = rows.contiguous().numpy()
            starts = np.cumsum([0, *lengths[:-1]]).tolist()
            _, dests = split_out(out)
            if len(lengths) > 1 and all(a % 8 == 0 for a in starts) and (dests is not None or one is not None):
                # every segment starts on a whole byte: decode each with its scale folded
                # into the table, straight into its destination (no unit pass, no scaling pass)
                if dests is not None:
                    targets = dests
                else:
                    assert one is not None
                    targets = [one.view(-1)[a : a + n] for a, n in zip(starts, lengths, strict=True)]
                for a, n, s, d in zip(starts, lengths, scale_mean.tolist(), targets, strict=True):
                    _lanes.decode_bit_rows(rows_np[:, a // 8 : -(-(a + n) // 8)], n, vals.numpy(), d.numpy(), s)
                return out
            res = torch.empty(numel, dtype=torch.float32) if one is None else one
            _lanes.decode_bit_rows(rows_np, numel, vals.numpy(), res.view(-1).numpy())
            return res if len(lengths) == 1 else finish_segments(res, scale_mean, lengths, out)
        small = world_size <= 255
        counts = torch.zeros(numel, dtype=torch.uint8 if small else torch.int32, device=reduced.device)
        for r in range(world_size):
            counts += unpack(rows[r], self._layout, numel)
        if small and count_layout.container == torch.uint8:
            # re-lane the counts (one multiply per word) and decode a container per lookup
            return self._decode_containers(pack(counts, count_layout), count_layout, scale_mean, numel,
                                           lengths, world_size, out)
        return self._decode_counts(counts, scale_mean, lengths, world_size, out)


