"""The hook's two-level path: a bucket's lossy groups go node-local -> across nodes -> node-local.

`attach(..., hierarchy=...)` turns it on (the forms are `hierarchy.Hierarchy`'s). Per bucket,
in the hook body, each lossy group runs `hierarchy`'s three levels — node-local SUM
reduce-scatter in the bucket's dtype, the group's reducer on this rank's shard across nodes
(the cross group, W = nodes), node-local all-gather — and its mean is written into the bucket
before the bucket's other groups and its control word are launched as on the flat path:

- FP32 slices stay one plain all-reduce over all ranks (exact, what DDP sends);
- the control word still travels over all ranks, so non-finite flags, loss and grad norm are
  agreed as on the flat path, and a non-finite bucket is NaN on every rank by the
  callback (over the two-level result too);
- the two levels block the hook body: the cross level cannot encode before the node sums
  exist, and no collective may be launched from a callback (callbacks run in different
  orders on different ranks). FP32 groups and control words still overlap backward.

Routes are decided at W = nodes (capacity, lane widths, the cheapest sign reducer and the
cost gate all see the cross level, where the lossy bytes go). A block route may pick
blockqscatter there: `cross` runs any reducer's agree / encode / launch / decode, so its
all-to-all and all-gather both go out on the cross group from the hook body, and it rounds
stratified as blockq does (`Reducer.stratified_rounding`; tests/runtime/test_hierarchy_dist.py:
blockq's bits).
qsum's shared scale is agreed exactly across nodes every step (`qsum_scale` applies to the
flat path only), and the fidelity probe samples only groups the flat path sends.

Error feedback per shard: the lossy step is the cross level's encoding of this rank's shard
of its node mean, so what it drops, r = shard - decoded own contribution, lives on the one
rank of each node that owns the shard. It is kept per parameter as L * r (zero outside the
shard) and added to the gradient BEFORE the node reduce-scatter: the node sum then carries
L * r and the node mean r, wherever the shard boundaries fall next step. A slice that goes
back to FP32 flushes it through the plain all-reduce, which then adds mean over nodes of r —
exactly what was owed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from nfab.errors import NfabError
from nfab.runtime.control import word as control
from nfab.runtime.control.controller import Group
from nfab.runtime.core import encode
from nfab.runtime.core import hierarchy as hier
from nfab.runtime.core.handoff import EncodedGroup, Launch, LevelSent
from nfab.wire import noise
from nfab.wire.registry import REDUCERS, Reducer, gather_scales

log = logging.getLogger(__name__)


class TwoLevel:
    """One runtime's node-local and cross groups (made once, at attach)."""

    def __init__(self, groups: hier.Groups) -> None:
        self.groups = groups
        self.topology = groups.topology

    @property
    def nodes(self) -> int:
        return self.topology.nodes

    def reduce_group(self, ctx: encode.EncodeContext, buffer: torch.Tensor, group: Group) -> LevelSent:
        """Reduce one lossy group through the two levels into the bucket (blocking)."""
        topo, red = self.topology, REDUCERS[group.key]
        x = buffer if group.whole else torch.cat(encode.views(buffer, group))
        if ctx.error_feedback:
            encode.add_residuals(ctx.residuals, x, group, ctx.ef_off, ctx.loss_scale)
        node_mean, start, shard = hier.scatter(x, self.groups)
        lengths = hier.shard_lengths(group.lengths, start, start + shard)
        gen = _noise(ctx, group, x.device, start, topo) if red.needs_shared_scale else None
        mean, local, calls = cross(node_mean, red, lengths, self.groups.cross, topo.nodes, gen, ctx.error_feedback,
                                   ctx.step)
        residuals: tuple[tuple[str, torch.Tensor], ...] = ()
        if ctx.error_feedback and local is not None:
            owed = encode.unscaled(node_mean.sub_(local).mul_(topo.local_world), ctx.loss_scale)
            residuals = _owed(group, owed, start, ctx.ef_off)
        out = hier.gather(mean, x, self.groups)
        if group.whole:
            buffer.copy_(out)
        else:
            for s, part in zip(group.slices, out.split(group.lengths), strict=True):
                buffer[s.offset : s.offset + s.numel].copy_(part)
        lb = hier.level_bytes(group.numel, red, topo.nodes, topo.local_world, buffer.element_size(), len(lengths))
        return LevelSent(lb.local, lb.cross, 2 + calls, residuals)


def setup(spec: hier.Hierarchy | str | int | None, process_group: dist.ProcessGroup | None) -> TwoLevel | None:
    """The two-level path for `attach(hierarchy=spec)`, or None (flat). A collective call: every
    rank makes the same groups in the same order. One node, or one rank per node, is flat."""
    h = hier.parse(spec)
    if h is None:
        return None
    world = dist.get_world_size(process_group)
    if world != dist.get_world_size():
        raise NfabError("hierarchy= needs the DDP model on the default process group (all ranks)")
    topo = h.topology(world, dist.get_rank())
    if topo.nodes == 1 or topo.local_world == 1:
        log.info("hierarchy %d x %d has one level: the flat path runs", topo.nodes, topo.local_world)
        return None
    return TwoLevel(hier.make_groups(topo))


def encode_bucket(two: TwoLevel | None, ctx: encode.EncodeContext, buffer: torch.Tensor, groups: Sequence[Group],
                  word: control.Builder, probe_parts: list[torch.Tensor],
                  blocking: encode.Blocking) -> tuple[list[EncodedGroup], LevelSent | None]:
    """The bucket's groups to launch; with a hierarchy its lossy groups are reduced here first."""
    if two is None or not any(g.lossy for g in groups):
        return [encode.encode_group(ctx, buffer, g, word, probe_parts, blocking) for g in groups], None
    sent = [two.reduce_group(ctx, buffer, g) for g in groups if g.lossy]
    encoded = [encode.encode_group(ctx, buffer, g, word, probe_parts, blocking) for g in groups if not g.lossy]
    levels = LevelSent(sum(s.intra_bytes for s in sent), sum(s.inter_bytes for s in sent),
                       sum(s.collectives for s in sent), tuple(r for s in sent for r in s.residuals))
    return encoded, levels


def with_levels(launch: Launch, levels: LevelSent | None) -> Launch:
    """The bucket's `Launch` with its two-level bytes and collectives counted in."""
    if levels is None:
        return launch
    return dataclasses.replace(launch, levels=levels, wire_bytes=launch.wire_bytes + levels.intra_bytes
                               + levels.inter_bytes, collectives=launch.collectives + levels.collectives)


def cross(x: torch.Tensor, red: Reducer, lengths: Sequence[int], group: dist.ProcessGroup, nodes: int,
          generator: torch.Generator | noise.Stratum | None,
          want_local: bool, step: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Level 2, `Reducer.reduce`'s arithmetic at W = nodes, plus this rank's own decoded
    contribution (error feedback) and the collectives it took (a sign route's zeros tie by node
    index + step: `Reducer.encode`)."""
    calls, shared = red.payload_collectives, None
    if red.needs_shared_scale:  # blockq agrees uint8 codes, as its cross-level bytes count them
        shared = red.agree(red.local_scale(x, lengths), group)
        calls += 1
    enc = red.encode(x, lengths, nodes, shared, generator, tie=dist.get_rank(group) + step)
    local = enc.local if want_local else None  # from encode's state: the payload may be reduced in place
    fut = red.launch(enc.payload, nodes, group)
    scale_mean = shared
    if enc.scales is not None:
        scale_mean = gather_scales(enc.scales, nodes, group)
        calls += 1
    return red.decode(fut.wait(), scale_mean, x.numel(), lengths, nodes), local, calls


def _owed(group: Group, shard_owed: torch.Tensor, start: int,
          ef_off: frozenset[str]) -> tuple[tuple[str, torch.Tensor], ...]:
    """This rank's owed values (L * r on its shard, zero elsewhere) split per slice, except in
    regions whose error feedback the drift monitor switched off."""
    full = torch.zeros(group.numel, dtype=torch.float32, device=shard_owed.device)
    end = min(start + shard_owed.numel(), group.numel)
    if end > start:
        full[start:end] = shard_owed[: end - start]
    return tuple((s.name, part) for s, part in zip(group.slices, full.split(group.lengths), strict=True)
                 if s.region not in ef_off)


def _noise(ctx: encode.EncodeContext, group: Group, device: torch.device, start: int,
           topo: hier.Topology) -> torch.Generator | noise.Stratum:
    """One rounding-noise generator for this rank's shard, seeded by (seed, rank, step, the group's
    first parameter): the same schedule on every rank, independent noise per rank. A reducer that
    rounds stratified (`Reducer.stratified_rounding`: block-scaled qsum) does so across the cross
    group (the ranks holding this shard on every node): the seed names the shard instead of the
    rank, and the stratum is this rank's node."""
    g = torch.Generator(device=device)
    first = ctx.param_index[group.slices[0].name]
    if REDUCERS[group.key].stratified_rounding:
        g.manual_seed(hash((ctx.seed, -1, ctx.step, first, 2, start)) & 0x7FFF_FFFF_FFFF)
        return noise.Stratum(g, topo.node, topo.nodes)
    g.manual_seed(hash((ctx.seed, ctx.rank, ctx.step, first, 2)) & 0x7FFF_FFFF_FFFF)
    return g
