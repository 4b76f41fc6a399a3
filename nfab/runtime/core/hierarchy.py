"""Two-level reduction: node-local reduce-scatter, low-bit across nodes, node-local all-gather.

Multi-node clusters have fast links inside a node and slow ones between nodes. A flat
low-bit route pays the slow link for W ranks' worth of lanes (sign counts need
ceil(log2(W+1))-bit lanes); the two-level path sends the slow link only what the nodes
disagree about:

1. **node-local reduce-scatter** in the bucket's dtype (SUM): local rank j of a node now
   owns shard j of the bucket, summed over the node's L ranks — exact up to the dtype's
   rounding, on the fast link;
2. **across nodes**, each shard goes through the route's reducer on the *cross group* (the
   same local rank on every node) with W = number of nodes, as the node mean (node sum / L);
   the reducer returns the mean over nodes of what it decodes;
3. **node-local all-gather** of the decoded shards: every rank holds the whole bucket.

Vote semantics (sign): each NODE votes once, with the sign of its node sum; the result is
the majority over nodes (ties -> 0) times the mean over nodes of each node's mean |node
mean| per segment. That is a majority of node sums, not of ranks: a node whose ranks split
3:1 votes with its 3, weighted like a node that agreed 4:0 — and a coordinate where a
minority of ranks holds large values can win its node's vote. With one rank per node it is
exactly the flat majority. qsum (q8/q4/q2) at W = nodes sums stochastically rounded node
means exactly: unbiased like the flat path, with levels per node chosen for W = nodes
(more levels than the flat path at W ranks), so capacity is checked at W = nodes.

Groups follow torchrun's layout: consecutive global ranks share a node (LOCAL_WORLD_SIZE
of them). `Topology.from_env()` reads it; `make_groups` creates the node-local and cross
groups (every rank must call it, in the same order, once).

Bytes per rank per level for `numel` elements (ring algorithms):
local reduce-scatter and all-gather (L-1)/L * numel * dtype bytes each, on the fast link;
cross `reducer.wire_bytes(numel / L, nodes)` on the slow one. Every node sends the slow
link L ranks' shards: about `reducer.wire_bytes(numel, nodes)` per node, against the flat
route's `reducer.wire_bytes(numel, W)` per rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nfab.errors import NfabError
from nfab.wire.contract import Capacity, Reducer, all_gather_flat


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Where this rank sits: `nodes` nodes of `local_world` consecutive ranks each."""

    nodes: int
    """Nodes in the job (the cross group's world size)."""
    local_world: int
    """Ranks per node (torchrun's LOCAL_WORLD_SIZE; the node-local group's size)."""
    rank: int
    """This rank's global rank."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.local_world < 1:
            raise NfabError(f"a hierarchy needs >= 1 node and >= 1 rank per node, got {self.nodes} x "
                            f"{self.local_world}")
        if not 0 <= self.rank < self.world_size:
            raise NfabError(f"rank {self.rank} is outside {self.nodes} nodes x {self.local_world} ranks")

    @property
    def world_size(self) -> int:
        return self.nodes * self.local_world

    @property
    def node(self) -> int:
        return self.rank // self.local_world

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of one node (its node-local group)."""
        return list(range(node * self.local_world, (node + 1) * self.local_world))

    def cross_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with this local rank on every node (one cross group)."""
        return [n * self.local_world + local_rank for n in range(self.nodes)]

    @classmethod
    def from_env(cls, world_size: int | None = None, rank: int | None = None) -> Topology:
        """torchrun's layout: LOCAL_WORLD_SIZE ranks per node, consecutive global ranks per node."""
        world = dist.get_world_size() if world_size is None else world_size
        me = dist.get_rank() if rank is None else rank
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if local < 1 or world % local:
            raise NfabError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}: "
                            "a hierarchy needs the same number of ranks on every node")
        return cls(nodes=world // local, local_world=local, rank=me)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hierarchy:
    """How `attach(..., hierarchy=)` splits the ranks into nodes (consecutive global ranks per node).

    `attach` also takes the short forms `parse` reads: "auto" (torchrun's LOCAL_WORLD_SIZE),
    an int (ranks per node), "NODESxLOCAL" (e.g. "64x8", checked against the world size),
    or None / "flat" (no hierarchy).
    """

    local_world: int | None = None
    """Ranks per node; None: torchrun's LOCAL_WORLD_SIZE (the whole world when unset)."""
    nodes: int | None = None
    """Nodes; when given, nodes x ranks per node must be the world size (a check, not a choice)."""

    def topology(self, world_size: int, rank: int) -> Topology:
        """This rank's place; a layout that does not fit the world size is refused in one line."""
        if self.local_world is None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        else:
            local = self.local_world
        if local < 1 or world_size % local:
            raise NfabError(f"hierarchy: {local} ranks per node do not divide the world size {world_size} "
                            "(every node needs the same number of ranks)")
        if self.nodes is not None and self.nodes * local != world_size:
            raise NfabError(f"hierarchy: {self.nodes} nodes x {local} ranks is not the world size {world_size}")
        return Topology(nodes=world_size // local, local_world=local, rank=rank)


def parse(spec: Hierarchy | str | int | None) -> Hierarchy | None:
    """A hierarchy from what a user wrote (see `Hierarchy`); None means flat."""
    if spec is None or isinstance(spec, Hierarchy):
        return spec
    if isinstance(spec, bool):
        raise NfabError(f"hierarchy must be 'auto', 'flat', ranks per node or NODESxLOCAL, got {spec!r}")
    if isinstance(spec, int):
        if spec < 1:
            raise NfabError(f"hierarchy: ranks per node must be >= 1, got {spec}")
        return Hierarchy(local_world=spec)
    text = str(spec).strip().lower()
    if text in ("flat", "none", ""):
        return None
    if text == "auto":
        return Hierarchy()
    nodes, sep, local = text.partition("x")
    if text.isdigit():
        return parse(int(text))
    if sep and nodes.isdigit() and local.isdigit() and int(nodes) >= 1 and int(local) >= 1:
        return Hierarchy(nodes=int(nodes), local_world=int(local))
    raise NfabError(f"hierarchy must be 'auto', 'flat', ranks per node (e.g. 8) or NODESxLOCAL (e.g. 64x8), "
                    f"got {spec!r}")


@dataclass(frozen=True, slots=True)
class Groups:
    """This rank's node-local group and its cross-node group."""

    topology: Topology
    local: dist.ProcessGroup
    cross: dist.ProcessGroup


def make_groups(topology: Topology) -> Groups:
    """Create every node-local and cross group (a collective call: every rank, same order)."""
    local = cross = None
    for node in range(topology.nodes):
        g = dist.new_group(topology.node_ranks(node))
        if node == topology.node:
            local = g
    for j in range(topology.local_world):
        g = dist.new_group(topology.cross_ranks(j))
        if j == topology.local_rank:
            cross = g
    assert local is not None and cross is not None
    return Groups(topology, local, cross)


def capacity(reducer: Reducer, topology: Topology) -> Capacity:
    """The cross level runs at W = nodes: that is where lanes and levels are sized."""
    return reducer.capacity(topology.nodes)


def shard_bounds(numel: int, local_world: int) -> tuple[int, int]:
    """Padded length and shard length of a `numel` bucket split over `local_world` ranks."""
    shard = -(-numel // local_world)
    return shard * local_world, shard


def shard_lengths(lengths: Sequence[int], start: int, end: int) -> list[int]:
    """The segments (scaled slices) of [start, end) of a buffer cut into `lengths`, padding as its own.

    A segment cut by a shard boundary is scaled separately on each side; the padding past the
    buffer's end (zeros) is one more segment, so it never dilutes a real segment's scale.
    """
    out, pos = [], 0
    for n in lengths:
        lo, hi = max(pos, start), min(pos + n, end)
        if hi > lo:
            out.append(hi - lo)
        pos += n
    if end > max(pos, start):
        out.append(end - max(pos, start))
    return out


def scatter(x: torch.Tensor, groups: Groups) -> tuple[torch.Tensor, int, int]:
    """Level 1: node-local SUM reduce-scatter in x's dtype. This rank's shard of the node
    mean (fp32), its start in x, and the shard length (the last shard is zero-padded)."""
    topo = groups.topology
    flat = x.reshape(-1)
    numel = flat.numel()
    padded, shard = shard_bounds(numel, topo.local_world)
    full = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
    full[:numel] = flat
    mine = torch.empty(shard, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter_tensor(mine, full, op=dist.ReduceOp.SUM, group=groups.local)
    return mine.to(torch.float32) / topo.local_world, topo.local_rank * shard, shard


def gather(reduced: torch.Tensor, like: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Level 3: node-local all-gather of every rank's reduced shard, as `like` (shape, dtype)."""
    shard = reduced.numel()
    out = torch.empty(shard * groups.topology.local_world, dtype=like.dtype, device=like.device)
    all_gather_flat(out, reduced.to(like.dtype).contiguous(), group=groups.local)
    return out[: like.numel()].view_as(like)


def reduce(x: torch.Tensor, reducer: Reducer, groups: Groups, lengths: Sequence[int] | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Mean over all ranks of `x` through the two-level path (blocking; a new tensor of x's shape).

    The reduce-scatter runs in x's dtype; the reducer sees fp32 node means. With one node
    there is no slow link and no cross level: the result is the exact node mean.
    """
    topo = groups.topology
    lengths = [x.numel()] if lengths is None else list(lengths)
    node_mean, start, shard = scatter(x, groups)
    if topo.nodes > 1:
        node_mean = reducer.reduce(node_mean, shard_lengths(lengths, start, start + shard), group=groups.cross,
                                   generator=generator)
    return gather(node_mean, x, groups)


def replay(xs: Sequence[torch.Tensor], reducer: Reducer, nodes: int, lengths: Sequence[int] | None = None,
           generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
    """The same arithmetic as `reduce` for W = len(xs) virtual ranks (consecutive ranks per node), one process.

    Node sums are added in rank order; gloo's reduce-scatter adds two ranks in either order to the
    same bits, so with up to 2 ranks per node this equals the real reduction bit for bit.
    `generators[r]` is global rank r's (stochastic rounding), as `reduce` gets on that rank.
    """
    world = len(xs)
    if world % nodes:
        raise NfabError(f"{world} ranks do not split into {nodes} equal nodes")
    local = world // nodes
    flat = [x.reshape(-1) for x in xs]
    numel = flat[0].numel()
    lengths = [numel] if lengths is None else list(lengths)
    padded, shard = shard_bounds(numel, local)
    padded_xs = [torch.cat([f, f.new_zeros(padded - numel)]) for f in flat]
    out = flat[0].new_empty(padded)
    for j in range(local):
        lo, hi = j * shard, (j + 1) * shard
        means = []
        for n in range(nodes):
            total = padded_xs[n * local][lo:hi].clone()
            for r in range(n * local + 1, (n + 1) * local):
                total += padded_xs[r][lo:hi]
            means.append(total.to(torch.float32) / local)
        gens = None if generators is None else [generators[n * local + j] for n in range(nodes)]
        got = reducer.replay(means, shard_lengths(lengths, lo, hi), gens) if nodes > 1 else means[0]
        out[lo:hi] = got.to(out.dtype)
    return out[:numel].view_as(xs[0])


@dataclass(frozen=True, slots=True)
class LevelBytes:
    """Bytes each rank sends per level for one bucket (ring algorithms)."""

    local_reduce_scatter: float
    cross: float
    local_all_gather: float

    @property
    def local(self) -> float:
        return self.local_reduce_scatter + self.local_all_gather


def level_bytes(numel: int, reducer: Reducer, nodes: int, local_world: int, dtype_bytes: int = 4,
                segments: int = 1) -> LevelBytes:
    """What a rank sends on each level; `cross` is what crosses the slow link."""
    padded, shard = shard_bounds(numel, local_world)
    local = (local_world - 1) / local_world * padded * dtype_bytes
    cross = reducer.wire_bytes(shard, nodes, segments) if nodes > 1 else 0.0
    return LevelBytes(local, cross, local)


def paper_rows(numel: int, layouts: Sequence[tuple[int, int]], routes: Sequence[str] = ("fp32", "sign", "q8", "q4"),
               ) -> list[dict[str, object]]:
    """Flat vs two-level bytes per rank for `numel` elements (one segment), cheapest exact reducer each."""
    from nfab.wire.registry import candidates

    def cheapest(route: str, world: int, n: int) -> Reducer | None:
        ok = [r for r in candidates(route) if r.capacity(world).ok]
        return min(ok, key=lambda r: r.wire_bytes(n, world)) if ok else None

    rows: list[dict[str, object]] = []
    for nodes, local in layouts:
        world = nodes * local
        for route in routes:
            flat, two = cheapest(route, world, numel), cheapest(route, nodes, numel // local)
            lb = level_bytes(numel, two, nodes, local) if two is not None else None
            rows.append({
                "nodes": nodes, "local_world": local, "route": route,
                "flat_reducer": flat.name if flat else None,
                "flat_bytes_per_rank": flat.wire_bytes(numel, world) if flat else None,
                "cross_reducer": two.name if two else None,
                "cross_bytes_per_rank": lb.cross if lb else None,
                "cross_bytes_per_node": local * lb.cross if lb else None,
                "local_bytes_per_rank": lb.local if lb else None,
            })
    return rows


if __name__ == "__main__":  # python -m nfab.runtime.core.hierarchy NUMEL NODESxLOCAL ...: the README's table
    import json
    import sys

    layouts = [tuple(int(v) for v in a.split("x")) for a in sys.argv[2:]]
    for row in paper_rows(int(sys.argv[1]), layouts):  # type: ignore[arg-type]
        print(json.dumps(row))
