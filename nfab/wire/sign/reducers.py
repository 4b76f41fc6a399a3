"""Sign reducers: 1-bit votes counted exactly, as lane sums (signcount) or gathered bits (signgather)."""

from __future__ import annotations

import torch

from nfab.wire.contract import (
    Capacity,
    Encoded,
    Reducer,
    all_gather_flat,
    allgather_factor,
    allreduce_factor,
    allreduce_future,
    decode_scaled,
)
from nfab.wire.qsum.lanes import LaneLayout, count_lane_bits, layout_for
from nfab.wire.sign import codec as sign_codec
from nfab.wire.sign import ops as sign_ops
from nfab.wire.slices import Slices


def count_lane_capacity(name: str, world_size: int) -> Capacity:
    """Sign counts of W ranks fit one lane of `ceil(log2(W+1))` bits; a container holds at most 63."""
    bits = count_lane_bits(world_size)
    if bits > 63:
        return Capacity(name, world_size, False, bits, reason="count lanes wider than 63 bits")
    return Capacity(name, world_size, True, lane_bits=bits)


class _SignReducer(Reducer):
    """Shared decode for sign votes: a positive count per element -> vote x mean scale."""

    route = "sign"

    def __init__(self, vote: str = "majority") -> None:
        sign_codec.vote_table(2, vote)  # validate early
        self.vote = vote

    def _vote_values(self, layout: LaneLayout, world_size: int, device: torch.device) -> torch.Tensor:
        """Vote per lane value, padded with 0 to the lane's range (sums above W never occur)."""
        table = torch.zeros(layout.max_value + 1, dtype=torch.float32, device=device)
        table[: world_size + 1] = sign_codec.vote_table(world_size, self.vote, device)
        return table

    def _decode_containers(self, containers, layout, scale_mean, numel, lengths, world_size, out=None):
        """Count lanes -> vote x mean scale, by table (one lookup per group of lanes on CPU)."""
        assert scale_mean is not None
        return decode_scaled(containers, layout, numel, self._vote_values(layout, world_size, containers.device),
                              scale_mean, lengths, out)


class SignCount(_SignReducer):
    """Compact sign-count aggregation: lane-packed 1-counts in ONE integer SUM all-reduce.

    Each rank puts its positive votes (0/1) into lanes of ceil(log2(W+1)) bits; the SUM
    of the containers yields, per element, how many ranks voted positive, c in [0, W].
    """

    name = "signcount"

    def layout(self, world_size: int) -> LaneLayout:
        return layout_for(count_lane_bits(world_size))

    def capacity(self, world_size: int) -> Capacity:
        return count_lane_capacity(self.name, world_size)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        lay = self.layout(world_size)
        return lay.containers_for(numel) * lay.storage_bits // 8

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return (allreduce_factor(world_size) * self.payload_bytes(numel, world_size)
                + allgather_factor(world_size) * 4 * segments)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None, tie=0) -> Encoded:
        return sign_ops.ops(x.device).encode(x, list(lengths), self.layout(world_size), tie)

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

    def link_bytes(self, numel: int, world_size: int, segments: int = 1) -> dict[str, float]:
        return {"allgather": self.wire_bytes(numel, world_size, segments)}

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return allgather_factor(world_size) * (self.payload_bytes(numel, world_size) + 4 * segments)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None, tie=0) -> Encoded:
        return sign_ops.ops(x.device).encode(x, list(lengths), self._layout, tie)

    def reads_sq(self, buffer: torch.Tensor) -> bool:
        return sign_ops.ops(buffer.device).reads_sq(buffer)

    def encode_views(self, views, lengths, world_size, with_sq: bool = False, tie: int = 0) -> Encoded:
        lengths = list(lengths)
        if not isinstance(views, Slices):
            views = list(views)
        if not (views and lengths):
            return super().encode_views(list(views), lengths, world_size, tie=tie)
        device = views.buffer.device if isinstance(views, Slices) else views[0].device
        return sign_ops.ops(device).encode_views(views, lengths, self._layout, with_sq, tie)

    def launch(self, payload, world_size, group):
        out = torch.empty(world_size * payload.numel(), dtype=payload.dtype, device=payload.device)
        work = all_gather_flat(out, payload, group=group, async_op=True)
        return work.get_future().then(lambda _: out)

    def combine(self, payloads):
        if isinstance(payloads, torch.Tensor) and payloads.dim() == 2:  # the W rows of a coalesced all-gather
            return payloads  # decoded as they are: a view of the gathered rows, no copy
        return torch.cat(list(payloads))

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None):
        """`reduced`: the W packed rows end to end, or as a (W, bytes) tensor whose rows may be
        spaced apart (each row's bytes contiguous)."""
        rows = reduced if reduced.dim() == 2 else reduced.view(world_size, -1)
        assert scale_mean is not None
        return sign_ops.ops(reduced.device).decode_rows(rows, scale_mean, numel, list(lengths), world_size,
                                                        self.vote, self._layout, out)
