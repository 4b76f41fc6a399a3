"""blockqscatter: block-scaled qsum's exact sum, sent as an all-to-all of own levels and an all-gather of sums.

A ring all-reduce is a reduce-scatter followed by an all-gather, and both halves of
`BlockQSum`'s carry lanes sized for the W-rank sum: base-(W*M+1) digits, ~4.9 bits per
element for bq2 at W=8, so its wire bits per element grow with W. This reducer sends the
first half at the width of ONE rank's levels instead:

1. the same scale codes (blocking uint8 MAX all-reduce) and the same stratified levels as
   `BlockQSum.encode` (inherited: the same bits);
2. each rank packs its own levels densely (the W = 1 packing of M + 1 values: bit lanes for
   2**bits levels, 2 bits per element for bq2; base-5 or base-6 digits of an int64 for bl5 and
   bl6, 2.37 and 2.67 bits) in W shards of `shard_numel` elements, the tail padded
   with level 0 (never decoded), and `all_to_all_single` hands rank r every rank's levels
   of shard r;
3. rank r (the shard's owner) adds the W ranks' levels exactly (integers) and packs the
   sums in `BlockQSum`'s own layout for W (`layout(W)`);
4. an all-gather gives every rank every shard's sums: the same integers `BlockQSum`'s
   all-reduce yields, decoded by its decode (same values, same bits).

Bytes per rank per element ~ (W-1)/W * (stage-1 bits + sum bits) + codes: bq2 at W=8
0.875 * (2 + 4.9) = 6.0 bits (blockq 2 * 0.875 * 4.9 = 8.6); fewer at every W >= 2 for a
tensor of a few shards' worth (`wire_bytes`; the controller compares them per group).

Two payload collectives: `launch` waits for the all-to-all, sums, and launches the
all-gather before it returns, so both are launched from the caller (the hook body, in
bucket order), never from a future callback.

Pricing: the all-to-all is priced as a "reducescatter" link. Each rank sends (W-1)/W of
its payload either way (the same per-rank byte pattern; gloo runs both as pairwise
exchanges), so the measured reduce-scatter line is the nearest one the cost model has;
a separate "alltoall" measurement would add a kind to every saved cost-model file for a
difference the current files cannot show. The codes' MAX all-reduce is the "blocking"
kind: its bytes at the all-reduce bandwidth, its latency the blocking round's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from nfab.wire.blockq import ops as blockq_ops
from nfab.wire.blockq.radix import RadixLayout
from nfab.wire.blockq.reducer import BlockQSum
from nfab.wire.contract import TwoPhaseReducer, allgather_factor, allreduce_factor, write_into
from nfab.wire.qsum import host as qsum_host
from nfab.wire.qsum.lanes import LaneLayout


def per_container(layout: LaneLayout | RadixLayout) -> int:
    """Elements one container holds."""
    return layout.lanes if isinstance(layout, LaneLayout) else layout.digits


def consecutive(layout: LaneLayout | RadixLayout) -> bool:
    """Whether element i sits in container i // per_container (radix digits, or bit lanes in one
    block of <= 8): then shards of whole containers, concatenated, are the whole tensor's packing."""
    return isinstance(layout, RadixLayout) or len(layout.blocks) == 1


class BlockQScatter(TwoPhaseReducer, BlockQSum):
    """`BlockQSum`'s result bit for bit: own levels all-to-all'd densely, the owners' exact sums all-gathered."""

    name = "blockqscatter"

    # ---- geometry ------------------------------------------------------------------------
    def layout(self, world_size: int) -> LaneLayout | RadixLayout:
        """`BlockQSum.layout` in the plain (unchunked) element order: an owner packs one shard of
        sums, and shards concatenate to the whole packing only in that order (`consecutive`)."""
        lay = super().layout(world_size)
        return dataclasses.replace(lay, chunk=0) if lay.chunk else lay

    def own_layout(self) -> LaneLayout | RadixLayout:
        """One rank's levels: the W = 1 packing, the denser of bit lanes and base-L digits (L = M + 1
        levels): bit lanes for 2**bits levels (they fill them exactly), int64 digits for bl5 (27
        base-5 digits: 2.37 bits per element against 3-bit lanes) and bl6 (24 base-6: 2.67)."""
        return self.layout(1)

    def shard_numel(self, numel: int, world_size: int) -> int:
        """Elements per shard: numel / W rounded up to whole containers of both packings, so an
        owner's sums fill whole containers and the gathered shards read as one packing."""
        align = math.lcm(per_container(self.own_layout()), per_container(self.layout(world_size)))
        per = -(-numel // world_size)
        return -(-per // align) * align

    def payload_bytes(self, numel: int, world_size: int) -> int:
        """This rank's all-to-all payload: its own levels for all W shards."""
        lay = self.own_layout()
        return world_size * (self.shard_numel(numel, world_size) // per_container(lay)) * lay.storage_bits // 8

    def sums_bytes(self, numel: int, world_size: int) -> int:
        """One owner's packed sums (the all-gather's per-rank part)."""
        lay = self.layout(world_size)
        return self.shard_numel(numel, world_size) // per_container(lay) * lay.storage_bits // 8

    def link_bytes(self, numel: int, world_size: int, segments: int = 1) -> dict[str, float]:
        w = world_size
        return {
            "reducescatter": (w - 1) / w * self.payload_bytes(numel, w),  # the all-to-all (module docstring)
            "allgather": allgather_factor(w) * self.sums_bytes(numel, w),
            "blocking": allreduce_factor(w) * self.blocks_for(numel, segments),  # codes, as BlockQSum counts them
        }

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return sum(self.link_bytes(numel, world_size, segments).values())

    def collective_factor(self, world_size: int) -> float:
        """Payload-collective bytes per payload byte (codes aside, the hook counts them): (W-1)/W
        for the all-to-all, plus the sums' all-gather relative to it (exact for any shard)."""
        own, sums = self.own_layout(), self.layout(world_size)
        return (world_size - 1) / world_size * (1.0 + sums.bits_per_element / own.bits_per_element)

    # ---- encode: BlockQSum's levels, packed per shard --------------------------------------
    def pack_levels(self, levels: torch.Tensor, world_size: int) -> torch.Tensor:
        """Own levels in W shards of `shard_numel`, each packed in `own_layout` (the tail is level 0)."""
        lay, n = self.own_layout(), levels.numel()
        shard = self.shard_numel(n, world_size)
        if isinstance(lay, RadixLayout):
            return blockq_ops.ops(levels.device).pack_digit_shards(levels, lay, world_size * shard)
        return blockq_ops.ops(levels.device).pack_lane_shards(levels, lay, world_size, shard)

    # ---- the owner's step -------------------------------------------------------------------
    def owner_step(self, received: torch.Tensor, world_size: int) -> torch.Tensor:
        """The W ranks' own-layout containers of one shard (rank order) -> their exact level sums,
        packed in `layout(W)`."""
        own, lay = self.own_layout(), self.layout(world_size)
        shard = received.numel() // world_size * per_container(own)
        return blockq_ops.ops(received.device).owner_sums(received, world_size, own, lay, shard)

    def scatter(self, payload, world_size, group):
        """The all-to-all: every rank's own levels of this rank's shard."""
        received = torch.empty_like(payload)
        dist.all_to_all_single(received, payload, group=group)
        return received

    def owner_share(self, payloads, rank):
        """Every rank's containers of shard `rank`, in rank order: what the all-to-all hands its owner."""
        w = len(payloads)
        return torch.cat([p.reshape(w, p.numel() // w)[rank] for p in payloads])

    # ---- decode ------------------------------------------------------------------------------
    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None) -> Any:
        """`BlockQSum.decode` of the gathered sums: directly where the shards' containers read as one
        packing (`consecutive`), else shard by shard (bit lanes of several blocks), then the scales."""
        layout = self.layout(world_size)
        if consecutive(layout):
            return super().decode(reduced, scale_mean, numel, lengths, world_size, out)
        assert scale_mean is not None, "block-scaled qsum decodes with the agreed block scales"
        assert isinstance(layout, LaneLayout)
        rows = reduced.view(world_size, reduced.numel() // world_size)
        shard = rows.shape[1] * layout.lanes
        values = self.sum_values(layout, world_size, reduced.device)
        mean = torch.empty(numel, dtype=torch.float32, device=reduced.device)
        for r in range(min(world_size, -(-numel // max(shard, 1)))):
            a, b = r * shard, min((r + 1) * shard, numel)
            qsum_host.decode_table(rows[r], layout, b - a, values, out=mean[a:b])  # compiled on CPU
        blockq_ops.ops(mean.device).scale_blocks_(self, mean, scale_mean, list(lengths))
        return write_into(out, mean)


def scatter_reducers(block_reducers: dict[str, BlockQSum]) -> dict[str, BlockQScatter]:
    """A `blockqscatter-<route>` for every registered `blockq-<route>`, same bits and block."""
    out = {}
    for red in block_reducers.values():
        scatter = BlockQScatter(levels=red.levels, block=red.block)
        out[f"blockqscatter-{scatter.route}"] = scatter
    return out
