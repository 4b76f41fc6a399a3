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

import torch
import torch.distributed as dist

from nfab.wire.contract import (
    Capacity,
    Encoded,
    Reducer,
    TwoPhaseReducer,
    allgather_factor,
    reduce_scatter_flat,
)
from nfab.wire.qsum.lanes import LaneLayout, count_lane_bits, layout_for
from nfab.wire.sign import ops as sign_ops
from nfab.wire.sign.codec import TRITS_PER_BYTE, pack_trits, unpack_trits  # noqa: F401  (the trit order, here documented)
from nfab.wire.sign.reducers import count_lane_capacity

_SHARD_ALIGN = 40  # shard sizes are whole vote bytes (8) and whole trit groups (40 trits in 8 bytes)


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
        return shard // TRITS_PER_BYTE if self.ternary(world_size) else shard // 8

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
        return sign_ops.ops(x.device).encode_shards(x, lengths, shard, world_size, lay, tie)

    def encode_rows(self, flat: torch.Tensor, sources: Sequence[tuple[int, int]], padded: int,
                    world_size: int, tie: int = 0) -> Encoded:
        """`encode` of W rows of `padded` elements each (one shard per row), their segments read where
        they lie in `flat`: sources[k] = (start, length) of segment k (rows in rank order), start -1
        for a segment with nothing to read (a row's tail: scale 0, votes never decoded). FSDP2's
        reduce-scatter input is read in place, with no copy of its rows padded to whole vote bytes.
        A zero votes by `tie` (`codec.sign_bits`)."""
        w, lay = world_size, self.layout(world_size)
        assert padded == self.shard_numel(w * padded, w), "a row must be one whole shard"
        return sign_ops.ops(flat.device).encode_rows(flat, sources, padded, w, lay, tie)

    # ---- the owner's step ---------------------------------------------------------------------
    def owner_step(self, counts_shard: torch.Tensor, world_size: int) -> torch.Tensor:
        """A shard's summed count lanes -> its majority, packed (uint8): bits, or trits at even W."""
        lay = self.layout(world_size)
        # the shard size is the one multiple of 40 within `lanes` (< 40) of the containers' room
        shard = lay.lanes * counts_shard.numel()
        shard -= shard % _SHARD_ALIGN
        return sign_ops.ops(counts_shard.device).shard_majority(counts_shard, lay, shard, world_size // 2,
                                                                 self.ternary(world_size))

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
        return sign_ops.ops(reduced.device).decode_majority(reduced, scale_mean, numel, list(lengths),
                                                            self.ternary(world_size), out)
