"""Two-level reduction on real gloo ranks (2 nodes x 2 ranks, torchrun's layout), against a
one-process replay (bit for bit), an independent vote computation, and plain all_reduce."""

import os

import pytest
import torch
import torch.distributed as dist

from nfab.distributed import run_ranks
from nfab.errors import NfabError
from nfab.runtime.core import hierarchy as hier
from nfab.wire.registry import REDUCERS

NUMEL, LENGTHS = 1001, [300, 5, 696]  # odd: the last shard is padded; segments cut by shard boundaries
KEYS = ("allreduce-fp32", "allreduce-bf16", "signgather", "signcount", "signscatter", "qsum-q8")


def grads(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank))


def gen(rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(7 + rank)


def _two_level(rank: int, world: int, nodes: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(world // nodes)
    topo = hier.Topology.from_env()
    groups = hier.make_groups(topo)
    out = {k: hier.reduce(grads(rank), REDUCERS[k], groups, LENGTHS, generator=gen(rank)) for k in KEYS}
    flat = grads(rank)
    dist.all_reduce(flat)
    out["plain"] = flat / world
    out["flat-signcount"] = REDUCERS["signcount"].reduce(grads(rank), LENGTHS)
    return out


@pytest.mark.world_size(4)
def test_two_nodes_of_two_match_the_replay_bit_for_bit_and_fp32_matches_all_reduce():
    res = run_ranks(_two_level, 4, 2, timeout_s=180)
    xs = [grads(r) for r in range(4)]
    for key in KEYS:
        for r in range(1, 4):
            assert torch.equal(res[r][key], res[0][key]), (key, r)  # replicas identical
        want = hier.replay(xs, REDUCERS[key], 2, LENGTHS, [gen(r) for r in range(4)])
        assert torch.equal(res[0][key], want), key
    torch.testing.assert_close(res[0]["allreduce-fp32"], res[0]["plain"], rtol=1e-6, atol=1e-7)
    # the node majority is not the rank majority
    assert not torch.equal(res[0]["signcount"], res[0]["flat-signcount"])


def _two_level_block(rank: int, world: int, nodes: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(world // nodes)
    groups = hier.make_groups(hier.Topology.from_env())
    # block routes round stratified across the cross group: the same key source on every rank
    return {k: hier.reduce(grads(rank), REDUCERS[k], groups, LENGTHS, generator=gen(0))
            for k in ("blockq-bq2", "blockqscatter-bq2", "blockq-bq3", "blockqscatter-bq3")}


@pytest.mark.world_size(4)
def test_cross_level_blockqscatter_is_blockq_bit_for_bit():
    """The two-level path runs blockqscatter across nodes (its all-to-all and all-gather on the
    cross group, W = nodes) to blockq's bits: the controller may pick either there."""
    res = run_ranks(_two_level_block, 4, 2, timeout_s=180)
    for r in range(4):
        for bits in ("bq2", "bq3"):
            got = res[r][f"blockqscatter-{bits}"]
            assert torch.equal(got.view(torch.int32), res[r][f"blockq-{bits}"].view(torch.int32)), (bits, r)
            assert torch.equal(got, res[0][f"blockqscatter-{bits}"])


@pytest.mark.world_size(4)
def test_vote_is_the_majority_of_node_sums_against_an_independent_reference():
    res = run_ranks(_two_level, 4, 2, timeout_s=180)
    xs = torch.stack([grads(r) for r in range(4)])
    node_mean = torch.stack([(xs[0] + xs[1]) / 2, (xs[2] + xs[3]) / 2])  # (nodes, numel)
    votes = torch.sign(node_mean).sum(0)  # +1 / -1 per node; 2 nodes: a split is a tie -> 0
    want = torch.sign(votes)
    # scale: per shard piece of each segment, the mean over nodes of mean |node mean|
    _, shard = hier.shard_bounds(NUMEL, 2)
    scale = torch.empty(NUMEL)
    for j in range(2):
        lo, hi = j * shard, min((j + 1) * shard, NUMEL)
        pos = lo
        for n in hier.shard_lengths(LENGTHS, lo, (j + 1) * shard):
            end = min(pos + n, hi)
            if end > pos:
                scale[pos:end] = node_mean[:, pos:end].abs().mean(1).mean()
            pos += n
    for key in ("signgather", "signcount"):
        got = res[0][key]
        assert torch.equal(torch.sign(got), want), key
        nz = want != 0
        torch.testing.assert_close(got[nz].abs(), scale[nz], rtol=1e-5, atol=0)


def _constructed(rank: int, world: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    groups = hier.make_groups(hier.Topology.from_env())
    # node 0: +1, +1 (sum +2); node 1: -3, +1 (sum -2). Ranks: 3 of 4 positive. Nodes: a tie.
    x = torch.full((8,), [1.0, 1.0, -3.0, 1.0][rank])
    return {"node": hier.reduce(x, REDUCERS["signcount"], groups), "rank": REDUCERS["signcount"].reduce(x)}


@pytest.mark.world_size(4)
def test_a_split_node_can_outvote_a_rank_majority():
    res = run_ranks(_constructed, 4, timeout_s=120)[0]
    assert torch.equal(res["node"], torch.zeros(8))  # node sums +2 and -2: tie -> 0
    assert (res["rank"] > 0).all()  # flat majority of ranks: 3 of 4 positive


def _one_rank_per_node(rank: int, world: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    groups = hier.make_groups(hier.Topology.from_env())
    return {k: (hier.reduce(grads(rank), REDUCERS[k], groups, LENGTHS), REDUCERS[k].reduce(grads(rank), LENGTHS))
            for k in ("signcount", "signgather")}


@pytest.mark.world_size(2)
def test_one_rank_per_node_is_the_flat_reduction():
    res = run_ranks(_one_rank_per_node, 2, timeout_s=120)[0]
    for key, (two_level, flat) in res.items():
        assert torch.equal(two_level, flat), key


def test_topology_capacity_and_level_bytes():
    t = hier.Topology(nodes=64, local_world=8, rank=17)
    assert (t.node, t.local_rank, t.world_size) == (2, 1, 512)
    assert t.cross_ranks(1)[:3] == [1, 9, 17] and t.node_ranks(2) == list(range(16, 24))
    sc = REDUCERS["signcount"]
    assert hier.capacity(sc, t).lane_bits == sc.capacity(64).lane_bits == 7  # sized for W = nodes, not 512
    assert not REDUCERS["qsum-q4"].capacity(512).ok and REDUCERS["qsum-q4"].capacity(8).ok
    lb = hier.level_bytes(8 << 20, sc, nodes=64, local_world=8)
    assert lb.cross == pytest.approx(sc.wire_bytes(1 << 20, 64))
    assert lb.local == pytest.approx(2 * 7 / 8 * (8 << 20) * 4)
    # per node, the slow link carries ~ the flat route at W = nodes instead of W = 512
    assert 8 * lb.cross < sc.wire_bytes(8 << 20, 512)
    with pytest.raises(NfabError, match="does not divide"):
        os.environ["LOCAL_WORLD_SIZE"] = "3"
        try:
            hier.Topology.from_env(world_size=8, rank=0)
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]


def test_shard_lengths_cut_segments_and_pad():
    assert hier.shard_lengths([300, 5, 696], 0, 501) == [300, 5, 196]
    assert hier.shard_lengths([300, 5, 696], 501, 1002) == [500, 1]  # 500 real, 1 padding
    assert sum(hier.shard_lengths([3, 4], 0, 8)) == 8
