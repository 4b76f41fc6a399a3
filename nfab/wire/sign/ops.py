"""The sign codec's ops: the operations whose implementations differ by device.

`SignOps` is the torch reference (every device; on the CPU the path `host_paths(False)` and a
machine without numba take); `HostSignOps` the compiled CPU path (`nfab.wire.sign.host`), the
same bits. `ops(device)` gives the one `nfab.wire.dispatch` chose for a device; the reducers
(`reducers.py`, `scatter.py`) call it and never ask which it is. A host op whose kernel cannot
read its inputs (memory not 1-D and contiguous, another dtype, no elements) runs the torch one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nfab.wire import dispatch, host_slices, segments
from nfab.wire.contract import Encoded, Out, finish_segments, split_out, write_into
from nfab.wire.qsum.lanes import LaneLayout, layout_for, pack, unpack
from nfab.wire.sign import codec
from nfab.wire.sign import host as sign_host
from nfab.wire.slices import Slices


def decode_counts(counts: torch.Tensor, scale_mean: torch.Tensor, lengths: Sequence[int], world_size: int,
                  vote: str, out: Out = None) -> Any:
    """A positive count per element -> vote x mean scale (the torch decode every path matches)."""
    table = codec.vote_table(world_size, vote, counts.device)
    one, dests = split_out(out)
    res = table[counts.to(torch.int64)]
    return finish_segments(res if dests is not None else write_into(one, res), scale_mean, lengths, out)


class SignOps:
    """The torch reference of the sign codec's ops."""

    def encode(self, x: torch.Tensor, lengths: list[int], layout: LaneLayout, tie: int) -> Encoded:
        """Votes packed into `layout`, per-segment mean |x|, and (lazily) this rank's ±scale values
        (an exact zero votes by `tie`: `codec.sign_bits`)."""
        scales = segments.segment_mean_abs(x, lengths)
        bits = codec.sign_bits(x, tie)
        return Encoded(pack(bits, layout), scales, make_local=lambda: codec.sign_values(bits, scales, lengths))

    def reads_sq(self, buffer: torch.Tensor) -> bool:
        """Whether `encode_views` takes |x|^2 on its read of `buffer`."""
        return False

    def encode_views(self, views: Sequence[torch.Tensor], lengths: list[int], layout: LaneLayout,
                     with_sq: bool, tie: int) -> Encoded:
        """`encode` of the concatenated `views` (1-bit lanes)."""
        return self.encode(torch.cat(list(views)), lengths, layout, tie)

    def decode_rows(self, rows: torch.Tensor, scale_mean: torch.Tensor, numel: int, lengths: list[int],
                    world_size: int, vote: str, layout: LaneLayout, out: Out) -> Any:
        """W gathered 1-bit rows ((W, bytes), each row contiguous) -> vote x mean scale."""
        counts = torch.zeros(numel, dtype=torch.uint8 if world_size <= 255 else torch.int32, device=rows.device)
        for r in range(world_size):
            counts += unpack(rows[r], layout, numel)
        return decode_counts(counts, scale_mean, lengths, world_size, vote, out)

    # ---- signscatter ----------------------------------------------------------------------
    def encode_shards(self, x: torch.Tensor, lengths: list[int], shard: int, world_size: int,
                      layout: LaneLayout, tie: int) -> Encoded:
        """Votes in W shards of `shard` elements (zero-padded), each lane-packed on its own."""
        n = x.numel()
        scales = segments.segment_mean_abs(x, lengths)
        votes = torch.zeros(world_size * shard, dtype=torch.bool, device=x.device)
        votes[:n] = codec.sign_bits(x.reshape(-1), tie)
        payload = torch.cat([pack(v, layout) for v in votes.view(world_size, shard)])
        own = votes[:n]
        return Encoded(payload, scales, make_local=lambda: codec.sign_values(own, scales, lengths))

    def encode_rows(self, flat: torch.Tensor, sources: Sequence[tuple[int, int]], padded: int, world_size: int,
                    layout: LaneLayout, tie: int) -> Encoded:
        """`SignScatter.encode_rows`: one segment at a time, where it lies."""
        lengths = [n for _, n in sources]
        votes = torch.zeros(world_size * padded, dtype=torch.bool, device=flat.device)
        sums, pos = [], 0
        for start, n in sources:
            if start >= 0:
                part = flat[start : start + n]
                votes[pos : pos + n] = codec.sign_bits(part, tie)
                sums.append(segments.abs_sum(part))
            else:
                sums.append(flat.new_zeros((), dtype=torch.float64))
            pos += n
        payload = torch.cat([pack(v, layout) for v in votes.view(world_size, padded)])
        return Encoded(payload, segments.means(torch.stack(sums), lengths))

    def shard_majority(self, containers: torch.Tensor, layout: LaneLayout, shard: int, half: int,
                       ternary: bool) -> torch.Tensor:
        """A shard's summed count lanes -> its packed majority: bits, or trits (`codec.pack_trits`)."""
        counts = unpack(containers, layout, shard).to(torch.int64)
        if not ternary:
            return pack(counts > half, layout_for(1))
        trits = (counts >= half).to(torch.uint8) + (counts > half).to(torch.uint8)  # 0 neg, 1 tie, 2 pos
        return codec.pack_trits(trits)

    def decode_majority(self, reduced: torch.Tensor, scale_mean: torch.Tensor, numel: int, lengths: list[int],
                        ternary: bool, out: Out) -> Any:
        """The gathered majority (bits or trits) -> vote x mean scale."""
        one, dests = split_out(out)
        if ternary:
            digits = codec.unpack_trits(reduced, numel)
        else:
            digits = unpack(reduced, layout_for(1), numel)
        # the digit's value, computed where it lies: {-1, 0, 1} for trits, {-1, 1} for bits (exact)
        unit = digits.to(torch.float32) - 1.0 if ternary else digits.to(torch.float32) * 2.0 - 1.0
        if dests is not None:
            return finish_segments(unit, scale_mean, lengths, out)
        return write_into(one, finish_segments(unit, scale_mean, lengths, None))


def mean_abs_of_sums(sums: np.ndarray, lengths: Sequence[int]) -> torch.Tensor:
    """Per-segment mean |x| (fp32) from the float64 |x| sums of the fused encoders."""
    return torch.from_numpy((sums / np.maximum(np.asarray(lengths, dtype=np.float64), 1)).astype(np.float32))


def _f32_targets(out: Out) -> tuple[torch.Tensor | None, list[torch.Tensor] | None, bool]:
    """(one, dests, whether every destination is contiguous fp32: the compiled decodes write there)."""
    one, dests = split_out(out)
    targets = dests if dests is not None else [one] if one is not None else None
    return one, dests, targets is None or all(d.is_contiguous() and d.dtype == torch.float32 for d in targets)


class HostSignOps(SignOps):
    """The compiled CPU path: one read of `x` for votes and scales (fp32, bf16 or fp16 as they are),
    count-and-look-up decodes of the gathered rows and the scatter's shards."""

    def encode(self, x: torch.Tensor, lengths: list[int], layout: LaneLayout, tie: int) -> Encoded:
        n = x.numel()
        if not (n and host_slices.flat_float(x)):
            return super().encode(x, lengths, layout, tie)
        bits, sums = sign_host.sign_votes(x, lengths, tie)
        return self._encoded(bits, sums, n, lengths, layout)

    @staticmethod
    def _encoded(bits: np.ndarray, sums: np.ndarray, n: int, lengths: list[int], layout: LaneLayout) -> Encoded:
        """Packed votes -> the payload in `layout` (the bits themselves for 1-bit lanes)."""
        scales = mean_abs_of_sums(sums, lengths)
        if layout.lane_bits == 1:
            payload = torch.from_numpy(bits)
            bits = bits.copy()  # this rank's own decode never reads the payload (an in-place collective may write it)
        else:
            payload = sign_host.votes_to_lanes(bits, n, layout)
        return Encoded(payload, scales, make_local=lambda: codec.sign_values_packed(bits, n, scales, lengths))

    def reads_sq(self, buffer: torch.Tensor) -> bool:
        return host_slices.flat_float(buffer)  # the compiled votes read each value once for both

    def encode_views(self, views: Sequence[torch.Tensor], lengths: list[int], layout: LaneLayout,
                     with_sq: bool, tie: int) -> Encoded:
        if isinstance(views, Slices):  # one check of the bucket instead of one per slice
            fast = host_slices.flat_float(views.buffer)
        else:
            views = list(views)
            fast = all(host_slices.flat_float(v) for v in views)
        if not fast:
            return super().encode_views(views, lengths, layout, with_sq, tie)
        sqs = np.empty(len(lengths), dtype=np.float64) if with_sq else None
        bits, sums = sign_host.sign_votes_views(views, lengths, sqs=sqs, tie=tie)
        enc = self._encoded(bits, sums, sum(lengths), lengths, layout)
        if sqs is not None:
            enc.sq = host_slices.sq_total(sqs)
        return enc

    def decode_rows(self, rows: torch.Tensor, scale_mean: torch.Tensor, numel: int, lengths: list[int],
                    world_size: int, vote: str, layout: LaneLayout, out: Out) -> Any:
        if not (numel and world_size <= 255 and rows.stride(-1) == 1):
            return super().decode_rows(rows, scale_mean, numel, lengths, world_size, vote, layout, out)
        if vote == "majority":  # one compiled call for every segment
            target = torch.empty(numel, dtype=torch.float32, device=rows.device) if out is None else out
            if sign_host.majority_into(rows.numpy(), lengths, world_size, scale_mean.numpy().reshape(-1), target):
                return target
        one, dests, f32 = _f32_targets(out)
        if not f32:
            return super().decode_rows(rows, scale_mean, numel, lengths, world_size, vote, layout, out)
        return self._decode_rows(rows.numpy(), scale_mean, numel, lengths, world_size, vote, one, dests)

    @staticmethod
    def _decode_rows(rows: np.ndarray, scale_mean: torch.Tensor, numel: int, lengths: list[int], world_size: int,
                     vote: str, one: torch.Tensor | None, dests: list[torch.Tensor] | None) -> Any:
        """Count the W bit rows and look up vote x scale, per segment straight into its
        destination (the scale folded into the table: fl(v * s) either way)."""
        res = torch.empty(numel, dtype=torch.float32, device="cpu") if one is None and dests is None else one
        vals = codec.vote_table(world_size, vote, torch.device("cpu")).numpy()
        start = 0
        for i, (n, s) in enumerate(zip(lengths, scale_mean.reshape(-1).tolist(), strict=True)):
            dst = dests[i] if dests is not None else res[start : start + n]  # type: ignore[index]
            if vote == "majority":
                sign_host.majority_bit_rows(rows, start, n, world_size, s, dst.view(-1).numpy())
            else:
                table = (vals * np.float32(s)).astype(np.float32)
                sign_host.decode_bit_rows(rows, start, n, table, dst.view(-1).numpy())
            start += n
        return dests if dests is not None else res

    # ---- signscatter ----------------------------------------------------------------------
    def encode_shards(self, x: torch.Tensor, lengths: list[int], shard: int, world_size: int,
                      layout: LaneLayout, tie: int) -> Encoded:
        n = x.numel()
        if not (n and host_slices.flat_float(x)):
            return super().encode_shards(x, lengths, shard, world_size, layout, tie)
        bits, sums = sign_host.sign_votes(x, lengths, tie)
        payload = sign_host.votes_to_shard_lanes(bits, n, shard, world_size, layout)
        scales = mean_abs_of_sums(sums, lengths)
        kept = bits.copy()
        return Encoded(payload, scales, make_local=lambda: codec.sign_values_packed(kept, n, scales, lengths))

    def encode_rows(self, flat: torch.Tensor, sources: Sequence[tuple[int, int]], padded: int, world_size: int,
                    layout: LaneLayout, tie: int) -> Encoded:
        if not host_slices.flat_float(flat):
            return super().encode_rows(flat, sources, padded, world_size, layout, tie)
        lengths = [n for _, n in sources]
        lens = np.asarray(lengths, dtype=np.int64)
        dest = np.cumsum(lens) - lens  # each segment's place in the W padded rows
        at = np.array([max(start, 0) for start, _ in sources], dtype=np.int64)
        read = np.where(np.array([start >= 0 for start, _ in sources]), lens, 0)
        bits, sums = sign_host.sign_votes_at(flat, at, at + read, dest - at, world_size * padded, tie)
        payload = sign_host.votes_to_shard_lanes(bits, world_size * padded, padded, world_size, layout)
        return Encoded(payload, mean_abs_of_sums(sums, lengths))

    def shard_majority(self, containers: torch.Tensor, layout: LaneLayout, shard: int, half: int,
                       ternary: bool) -> torch.Tensor:
        if not containers.is_contiguous():
            return super().shard_majority(containers, layout, shard, half, ternary)
        return sign_host.shard_majority(containers, layout, shard, half, ternary)

    def decode_majority(self, reduced: torch.Tensor, scale_mean: torch.Tensor, numel: int, lengths: list[int],
                        ternary: bool, out: Out) -> Any:
        one, dests, f32 = _f32_targets(out)
        if not (numel and reduced.is_contiguous() and f32):
            return super().decode_majority(reduced, scale_mean, numel, lengths, ternary, out)
        values = np.array([-1.0, 0.0, 1.0] if ternary else [-1.0, 1.0], dtype=np.float32)
        res = torch.empty(numel, dtype=torch.float32, device="cpu") if one is None and dests is None else one
        packed = reduced.numpy()
        start = 0
        for i, (n, s) in enumerate(zip(lengths, scale_mean.reshape(-1).tolist(), strict=True)):
            dst = dests[i] if dests is not None else res[start : start + n]  # type: ignore[index]
            if ternary:
                sign_host.decode_trits(packed, start, n, values * np.float32(s), dst.view(-1).numpy())
            else:
                sign_host.majority_bit_rows(packed.reshape(1, -1), start, n, 1, s, dst.view(-1).numpy())
            start += n
        return dests if dests is not None else res


def ops(device: torch.device) -> SignOps:
    """The sign ops for `device` (`dispatch.ops`: chosen once per device)."""
    return dispatch.ops(device, SignOps, HostSignOps)
