"""Sign reducers: 1-bit votes counted exactly, as lane sums (signcount) or gathered bits (signgather)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nfab.wire import dispatch, host_slices, segments
from nfab.wire.contract import (
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
from nfab.wire.qsum.lanes import LaneLayout, count_lane_bits, layout_for, pack, unpack
from nfab.wire.sign import codec as sign_codec
from nfab.wire.sign import host as sign_host
from nfab.wire.slices import Slices


def mean_abs_of_sums(sums: np.ndarray, lengths: Sequence[int]) -> torch.Tensor:
    """Per-segment mean |x| (fp32) from the float64 |x| sums of the fused encoders."""
    return torch.from_numpy((sums / np.maximum(np.asarray(lengths, dtype=np.float64), 1)).astype(np.float32))



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

    def _sign_encode(self, x: torch.Tensor, lengths: Sequence[int], layout: LaneLayout, tie: int) -> Encoded:
        """Votes packed into `layout`, per-segment mean |x|, and (lazily) this rank's ±scale values
        (an exact zero votes by `tie`: `codec.sign_bits`).

        On CPU one compiled pass reads `x` (fp32, bf16 or fp16, no fp32 copy) for votes and
        scales; elsewhere the torch reference does (same payload bits).
        """
        lengths = list(lengths)
        n = x.numel()
        if n and sign_host.sign_supports(x):
            bits, sums = sign_host.sign_votes(x, lengths, tie)
            return self._encoded(bits, sums, n, lengths, layout)
        scales = segments.segment_mean_abs(x, lengths)
        bits = sign_codec.sign_bits(x, tie)
        return Encoded(pack(bits, layout), scales, make_local=lambda: sign_codec.sign_values(bits, scales, lengths))

    @staticmethod
    def _encoded(bits: np.ndarray, sums: np.ndarray, n: int, lengths: list[int], layout: LaneLayout) -> Encoded:
        """Packed votes -> the payload in `layout` (the bits themselves for 1-bit lanes)."""
        scales = mean_abs_of_sums(sums, lengths)
        if layout.lane_bits == 1:
            payload = torch.from_numpy(bits)
            bits = bits.copy()  # this rank's own decode never reads the payload (an in-place collective may write it)
        else:
            payload = sign_host.votes_to_lanes(bits, n, layout)
        return Encoded(payload, scales, make_local=lambda: sign_codec.sign_values_packed(bits, n, scales, lengths))

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

    def _decode_counts(self, counts, scale_mean, lengths, world_size, out: Out = None) -> Any:
        table = sign_codec.vote_table(world_size, self.vote, counts.device)
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
        return count_lane_capacity(self.name, world_size)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        lay = self.layout(world_size)
        return lay.containers_for(numel) * lay.storage_bits // 8

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return (allreduce_factor(world_size) * self.payload_bytes(numel, world_size)
                + allgather_factor(world_size) * 4 * segments)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None, tie=0) -> Encoded:
        return self._sign_encode(x, lengths, self.layout(world_size), tie)

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
        return self._sign_encode(x, lengths, self._layout, tie)

    def reads_sq(self, buffer: torch.Tensor) -> bool:
        return sign_host.sign_supports(buffer)  # the compiled votes read each value once for both

    def encode_views(self, views, lengths, world_size, with_sq: bool = False, tie: int = 0) -> Encoded:
        lengths = list(lengths)
        if isinstance(views, Slices):  # one check of the bucket instead of one per slice
            fast = sign_host.sign_supports(views.buffer)
        else:
            views = list(views)
            fast = bool(views) and all(sign_host.sign_supports(v) for v in views)
        if not fast or not lengths:
            return super().encode_views(list(views), lengths, world_size, tie=tie)
        sqs = np.empty(len(lengths), dtype=np.float64) if with_sq else None
        bits, sums = sign_host.sign_votes_views(views, lengths, sqs=sqs, tie=tie)
        enc = self._encoded(bits, sums, sum(lengths), lengths, self._layout)
        if sqs is not None:
            enc.sq = host_slices.sq_total(sqs)
        return enc

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
        if (numel and world_size <= 255 and self.vote == "majority" and _rows_on_host(rows)
                and dispatch.on_host(scale_mean)):  # one compiled call for every segment
            target = torch.empty(numel, dtype=torch.float32, device=reduced.device) if out is None else out
            if sign_host.majority_into(rows.numpy(), lengths, world_size, scale_mean.numpy().reshape(-1), target):
                return target
        one, dests = split_out(out)
        targets = dests if dests is not None else [one] if one is not None else None
        if (numel and world_size <= 255 and _rows_on_host(rows)
                and (targets is None or all(dispatch.supports(d) and d.dtype == torch.float32 for d in targets))):
            return self._decode_rows(rows.numpy(), scale_mean, numel, list(lengths), world_size, one, dests)
        counts = torch.zeros(numel, dtype=torch.uint8 if world_size <= 255 else torch.int32, device=reduced.device)
        for r in range(world_size):
            counts += unpack(rows[r], self._layout, numel)
        return self._decode_counts(counts, scale_mean, lengths, world_size, out)

    def _decode_rows(self, rows: np.ndarray, scale_mean, numel: int, lengths: list[int], world_size: int,
                     one: torch.Tensor | None, dests: list[torch.Tensor] | None) -> Any:
        """Compiled CPU decode: count the W bit rows and look up vote x scale, per segment
        straight into its destination (the scale folded into the table: fl(v * s) either way)."""
        assert scale_mean is not None
        res = torch.empty(numel, dtype=torch.float32, device="cpu") if one is None and dests is None else one
        targets = dests if dests is not None else None
        scales = scale_mean.reshape(-1)
        vals = sign_codec.vote_table(world_size, self.vote, torch.device("cpu")).numpy()
        start = 0
        for i, (n, s) in enumerate(zip(lengths, scales.tolist(), strict=True)):
            dst = targets[i] if targets is not None else res[start : start + n]  # type: ignore[index]
            if self.vote == "majority":
                sign_host.majority_bit_rows(rows, start, n, world_size, s, dst.view(-1).numpy())
            else:
                table = (vals * np.float32(s)).astype(np.float32)
                sign_host.decode_bit_rows(rows, start, n, table, dst.view(-1).numpy())
            start += n
        return dests if dests is not None else res


def _rows_on_host(rows: torch.Tensor) -> bool:
    """Whether the compiled decode reads these (W, bytes) rows: on the host, each row contiguous."""
    return dispatch.AVAILABLE and dispatch.on_host(rows) and rows.stride(-1) == 1
