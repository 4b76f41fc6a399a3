"""signscatter: sign counts summed by a reduce-scatter, the majority all-gathered in 1-2 bits.

A ring all-reduce is a reduce-scatter followed by an all-gather. signcount sends count
lanes through both halves; this reducer sends them only through the first:

1. each rank lane-packs its votes (count lanes of ceil(log2(W+1)) bits, as signcount)
   in W shards of S elements; a SUM reduce-scatter leaves rank r with the exact
   positive count of every element of shard r;
2. rank r (the shard's owner) decodes the majority of its shard: one bit per element
   at odd W, one trit (negative / tie / positive, 5 per byte) at even W, where a tie
   decodes to 0 as on every other sign path. Trits go by groups of 40 elements in 8
   bytes: element 8k + e of a group is base-3 digit k of the group's byte e (`pack_trits`),
   so a byte's 5 digits are 5 planes of 8 consecutive elements. Why: read as one int64
   word, a group's byte e holds digit k of element 8k + e, so digit k of all 8 bytes at once
   (SWAR) is the 8 consecutive elements of plane k, and every load and store of the codec
   is contiguous (5 consecutive digits per byte made the decode a stack of 5 strided
   columns: 3.2 ms per 4M elements on one core against 1.1 ms now);
3. an all-gather gives every rank every shard's majority; each rank multiplies by the
   per-segment mean scale (averaged across ranks like signcount's).

Bytes per rank per element ~ (W-1)/W * (lane bits + 1 or 1.6): 4.4 at W=8 (signcount
7.0), 12.3 at W=512 (21.3). Two collectives: `launch` waits for the reduce-scatter
and launches the all-gather before it returns, so both are launched from the caller
(the hook body, in bucket order), never from a future callback. Majority vote only:
the mean vote needs the whole count on every rank (that is signcount).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nfab.wire import dispatch, segments
from nfab.wire.contract import (
    Capacity,
    Encoded,
    Reducer,
    TwoPhaseReducer,
    allgather_factor,
    finish_segments,
    reduce_scatter_flat,
    split_out,
    write_into,
)
from nfab.wire.qsum.lanes import LaneLayout, count_lane_bits, layout_for, pack, unpack
from nfab.wire.sign import codec as sign_codec
from nfab.wire.sign import host as sign_host
from nfab.wire.sign.reducers import count_lane_capacity, mean_abs_of_sums

_SHARD_ALIGN = 40  # shard sizes are whole vote bytes (8) and whole trit groups (40 trits in 8 bytes)
_TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256
_TRIT_GROUP_BYTES = 8  # a group of 40 trits: 8 bytes, one int64 word (see the module docstring)


def reduce_scatter_factor(world_size: int) -> float:
    """Fraction of the payload each rank sends in a ring reduce-scatter: (W-1)/W."""
    return (world_size - 1) / world_size


class SignScatter(TwoPhaseReducer):
    """Majority sign via a lane-count reduce-scatter and a 1-bit (odd W) / trit (even W) all-gather."""

    name = "signscatter"
    route = "sign"

    # ---- geometry ------------------------------------------------------------------------
    def layout(self, world_size: int) -> LaneLayout:
        return layout_for(count_lane_bits(world_size))

    @staticmethod
    def shard_numel(numel: int, world_size: int) -> int:
        """Elements per shard: numel / W rounded up to whole vote and trit bytes."""
        per = -(-numel // world_size)
        return -(-per // _SHARD_ALIGN) * _SHARD_ALIGN

    def row_numel(self, numel: int, world_size: int) -> int:
        """A row padded to whole shards (`shard_numel` of W rows): each row's votes start on a whole
        vote byte, and the padding is a segment of its own in every row's table (never decoded)."""
        return self.shard_numel(world_size * numel, world_size)

    @staticmethod
    def ternary(world_size: int) -> bool:
        """Even W can tie: the majority needs three values (trits) instead of one bit."""
        return world_size % 2 == 0

    def majority_bytes(self, shard: int, world_size: int) -> int:
        """Bytes of one shard's decoded majority."""
        return shard // _TRITS_PER_BYTE if self.ternary(world_size) else shard // 8

    def capacity(self, world_size: int) -> Capacity:
        return count_lane_capacity(self.name, world_size)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        lay = self.layout(world_size)
        return world_size * lay.containers_for(self.shard_numel(numel, world_size)) * lay.storage_bits // 8

    def link_bytes(self, numel: int, world_size: int, segments: int = 1) -> dict[str, float]:
        shard = self.shard_numel(numel, world_size)
        return {
            "reducescatter": reduce_scatter_factor(world_size) * self.payload_bytes(numel, world_size),
            "allgather": allgather_factor(world_size) * (self.majority_bytes(shard, world_size) + 4 * segments),
        }

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return sum(self.link_bytes(numel, world_size, segments).values())

    def collective_factor(self, world_size: int) -> float:
        """Wire bytes per payload byte (both collectives, scales aside), for the runtime's accounting."""
        n = 1 << 20
        return (self.wire_bytes(n, world_size, 0)) / self.payload_bytes(n, world_size)

    # ---- encode ------------------------------------------------------------------------------
    def encode(self, x, lengths, world_size, shared_scale=None, generator=None, tie=0) -> Encoded:
        lengths = list(lengths)
        n = x.numel()
        lay = self.layout(world_size)
        shard = self.shard_numel(n, world_size)
        if n and sign_host.sign_supports(x):
            bits, sums = sign_host.sign_votes(x, lengths, tie)
            payload = sign_host.votes_to_shard_lanes(bits, n, shard, world_size, lay)
            scales = mean_abs_of_sums(sums, lengths)
            kept = bits.copy()
            return Encoded(payload, scales, make_local=lambda: sign_codec.sign_values_packed(kept, n, scales, lengths))
        scales = segments.segment_mean_abs(x, lengths)
        votes = torch.zeros(world_size * shard, dtype=torch.bool, device=x.device)
        votes[:n] = sign_codec.sign_bits(x.reshape(-1), tie)
        payload = torch.cat([pack(v, lay) for v in votes.view(world_size, shard)])
        own = votes[:n]
        return Encoded(payload, scales, make_local=lambda: sign_codec.sign_values(own, scales, lengths))

    def encode_rows(self, flat: torch.Tensor, sources: Sequence[tuple[int, int]], padded: int,
                    world_size: int, tie: int = 0) -> Encoded:
        """`encode` of W rows of `padded` elements each (one shard per row), their segments read where
        they lie in `flat`: sources[k] = (start, length) of segment k (rows in rank order), start -1
        for a segment with nothing to read (a row's tail: scale 0, votes never decoded). FSDP2's
        reduce-scatter input is read in place, with no copy of its rows padded to whole vote bytes.
        A zero votes by `tie` (`codec.sign_bits`)."""
        w, lay = world_size, self.layout(world_size)
        assert padded == self.shard_numel(w * padded, w), "a row must be one whole shard"
        lengths = [n for _, n in sources]
        if sign_host.sign_supports(flat):
            lens = np.asarray(lengths, dtype=np.int64)
            dest = np.cumsum(lens) - lens  # each segment's place in the W padded rows
            at = np.array([max(start, 0) for start, _ in sources], dtype=np.int64)
            read = np.where(np.array([start >= 0 for start, _ in sources]), lens, 0)
            bits, sums = sign_host.sign_votes_at(flat, at, at + read, dest - at, w * padded, tie)
            payload = sign_host.votes_to_shard_lanes(bits, w * padded, padded, w, lay)
            scales = mean_abs_of_sums(sums, lengths)
            return Encoded(payload, scales)
        votes = torch.zeros(w * padded, dtype=torch.bool, device=flat.device)
        sums, pos = [], 0
        for start, n in sources:  # the torch reference: one segment at a time, where it lies
            if start >= 0:
                part = flat[start : start + n]
                votes[pos : pos + n] = sign_codec.sign_bits(part, tie)
                sums.append(segments.abs_sum(part))
            else:
                sums.append(flat.new_zeros((), dtype=torch.float64))
            pos += n
        payload = torch.cat([pack(v, lay) for v in votes.view(w, padded)])
        return Encoded(payload, segments.means(torch.stack(sums), lengths))

    # ---- the owner's step ---------------------------------------------------------------------
    def owner_step(self, counts_shard: torch.Tensor, world_size: int) -> torch.Tensor:
        """A shard's summed count lanes -> its majority, packed (uint8): bits, or trits at even W."""
        lay = self.layout(world_size)
        # the shard size is the one multiple of 40 within `lanes` (< 40) of the containers' room
        shard = lay.lanes * counts_shard.numel()
        shard -= shard % _SHARD_ALIGN
        half = world_size // 2
        if dispatch.supports(counts_shard):
            return sign_host.shard_majority(counts_shard, lay, shard, half, self.ternary(world_size))
        counts = unpack(counts_shard, lay, shard).to(torch.int64)
        if not self.ternary(world_size):
            return pack(counts > half, layout_for(1))
        trits = (counts >= half).to(torch.uint8) + (counts > half).to(torch.uint8)  # 0 neg, 1 tie, 2 pos
        return pack_trits(trits)

    def scatter(self, payload, world_size, group):
        """The SUM reduce-scatter of the count lanes: this rank's shard of exact counts."""
        shard = torch.empty(payload.numel() // world_size, dtype=payload.dtype, device=payload.device)
        reduce_scatter_flat(shard, payload, op=dist.ReduceOp.SUM, group=group)
        return shard

    def owner_share(self, payloads, rank):
        """Shard `rank`'s count lanes summed over the W payloads: what the reduce-scatter leaves there."""
        w = len(payloads)
        return Reducer.combine(self, [p.view(w, -1)[rank] for p in payloads])

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None) -> Any:
        assert scale_mean is not None
        lengths = list(lengths)
        one, dests = split_out(out)
        targets = dests if dests is not None else [one] if one is not None else None
        ternary = self.ternary(world_size)
        values = np.array([-1.0, 0.0, 1.0] if ternary else [-1.0, 1.0], dtype=np.float32)
        if numel and dispatch.supports(reduced) and (
                targets is None or all(dispatch.supports(d) and d.dtype == torch.float32 for d in targets)):
            res = torch.empty(numel, dtype=torch.float32, device="cpu") if one is None and dests is None else one
            packed = reduced.numpy()
            start = 0
            for i, (n, s) in enumerate(zip(lengths, scale_mean.reshape(-1).tolist(), strict=True)):
                dst = dests[i] if dests is not None else res[start : start + n]  # type: ignore[index]
                table = values * np.float32(s)
                if ternary:
                    sign_host.decode_trits(packed, start, n, table, dst.view(-1).numpy())
                else:
                    sign_host.majority_bit_rows(packed.reshape(1, -1), start, n, 1, s, dst.view(-1).numpy())
                start += n
            return dests if dests is not None else res
        if ternary:
            digits = unpack_trits(reduced, numel)
        else:
            digits = unpack(reduced, layout_for(1), numel)
        # the digit's value, computed where it lies: {-1, 0, 1} for trits, {-1, 1} for bits (exact)
        unit = digits.to(torch.float32) - 1.0 if ternary else digits.to(torch.float32) * 2.0 - 1.0
        if dests is not None:
            return finish_segments(unit, scale_mean, lengths, out)
        return write_into(one, finish_segments(unit, scale_mean, lengths, None))


def _pow3(device: torch.device) -> torch.Tensor:
    """3**0..3**4 as int32 on `device`, computed there (no host-to-device copy)."""
    return torch.pow(3, torch.arange(_TRITS_PER_BYTE, dtype=torch.int32, device=device))


def pack_trits(trits: torch.Tensor) -> torch.Tensor:
    """Values in {0, 1, 2} (length a multiple of 40) -> trit bytes: in each group of 40 values and 8
    bytes, byte e = sum over k of value (8k + e) times 3**k (the module's trit order)."""
    grid = trits.reshape(-1, _TRITS_PER_BYTE, _TRIT_GROUP_BYTES).to(torch.int32)
    weights = _pow3(trits.device).view(1, -1, 1)
    return (grid * weights).sum(1).reshape(-1).to(torch.uint8)


def unpack_trits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_trits`: the first `numel` digits (int32)."""
    weights = _pow3(packed.device).view(1, -1, 1)
    digits = (packed.to(torch.int32).reshape(-1, 1, _TRIT_GROUP_BYTES) // weights) % 3
    return digits.reshape(-1)[:numel]
