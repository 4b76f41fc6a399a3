"""signscatter: reduce-scatter of count lanes, owner majority, all-gather of bits/trits.

Checked against an independent majority vote, its one-process replay against real gloo
ranks (W = 2, 3, 4) bit for bit, and its compiled CPU decode against the torch reference.
"""

import json

import numpy as np
import pytest
import torch

from nfab.distributed import run_ranks
from nfab.wire import dispatch
from nfab.wire.cost import default_cost_model
from nfab.wire.qsum.lanes import layout_for, pack, unpack
from nfab.wire.registry import REDUCERS, SignScatter
from nfab.wire.sign import host as sign_host
from nfab.wire.sign.scatter import pack_trits, unpack_trits

LENGTHS = [37, 1000, 3, 513, 0, 8]


def rank_input(rank: int, numel: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))
    x[::7] = x[::7].abs()  # agreement on some elements, and ties at even W
    if numel > 5:
        x[5] = -0.0
    return x


def votes(x: torch.Tensor, tie: int) -> torch.Tensor:
    """A sign vote, computed apart from nfab: x > 0; an exact zero votes positive when tie is even
    (virtual rank r replays with tie r)."""
    return (x > 0) | ((x == 0) & (tie % 2 == 0))


def independent(xs: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """Majority of the ranks' votes (ties 0) times the mean over ranks of each segment's mean |x|."""
    w = len(xs)
    positives = torch.stack([votes(x, r) for r, x in enumerate(xs)]).sum(0)
    vote = torch.sign(2 * positives - w).float()
    scales = torch.stack([torch.stack([p.abs().mean() if p.numel() else p.new_zeros(())
                                       for p in torch.split(x, lengths)]) for x in xs]).mean(0)
    return vote * torch.repeat_interleave(scales, torch.tensor(lengths))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8, 9, 16])
def test_replay_is_the_majority_vote(world_size):
    n = sum(LENGTHS)
    xs = [rank_input(r, n) for r in range(world_size)]
    got = REDUCERS["signscatter"].replay(xs, LENGTHS)
    assert torch.allclose(got, independent(xs, LENGTHS), rtol=1e-6, atol=0)
    assert torch.equal(got, REDUCERS["signcount"].replay(xs, LENGTHS))  # the same decode as signcount
    if world_size % 2 == 0:
        ties = torch.stack([votes(x, r) for r, x in enumerate(xs)]).sum(0) == world_size // 2
        assert ties.any() and (got[ties] == 0).all()


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("numel,lengths", [(1, [1]), (41, [40, 1]), (1001, [400, 601]), (9000, [4097, 4903])])
def test_compiled_equals_reference(world_size, numel, lengths):
    if not dispatch.AVAILABLE:
        pytest.skip("numba not installed")
    red = REDUCERS["signscatter"]
    xs = [rank_input(r, numel) for r in range(world_size)]
    fast = [red.encode(x, lengths, world_size) for x in xs]
    was = dispatch.AVAILABLE
    dispatch.AVAILABLE = False
    try:
        ref = [red.encode(x, lengths, world_size) for x in xs]
        reduced = red.combine([e.payload for e in fast])
        scales = torch.stack([e.scales for e in fast]).mean(0)
        want = red.decode(reduced, scales, numel, lengths, world_size)
    finally:
        dispatch.AVAILABLE = was
    assert all(torch.equal(a.payload, b.payload) for a, b in zip(fast, ref, strict=True))
    assert torch.equal(red.decode(reduced, scales, numel, lengths, world_size), want)
    out = torch.full((numel + 2,), 3.0)
    red.decode(reduced, scales, numel, lengths, world_size, out=out[1:-1])
    assert torch.equal(out[1:-1], want) and out[0] == 3.0 and out[-1] == 3.0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 31, 32])
def test_owner_step_compiled_equals_reference(world_size):
    """The owner's majority (bits at odd W, trits at even W) from summed count lanes: the host path
    and the torch reference give the same bytes for every count 0..W, ties included."""
    if not dispatch.AVAILABLE:
        pytest.skip("numba not installed")
    red = REDUCERS["signscatter"]
    lay = red.layout(world_size)
    shard = red.shard_numel(4003, world_size)
    counts = torch.arange(shard, dtype=torch.int64) % (world_size + 1)
    counts = counts[torch.randperm(shard, generator=torch.Generator().manual_seed(world_size))]
    containers = pack(counts.to(lay.container), lay)
    fast = red.owner_step(containers, world_size)
    with dispatch.host_paths(False):
        ref = red.owner_step(containers, world_size)
    assert torch.equal(fast, ref)
    majority = counts > world_size // 2
    got = unpack_trits(fast, shard) if world_size % 2 == 0 else unpack(fast, layout_for(1), shard)
    want = majority.to(torch.int64) + (counts >= world_size / 2).to(torch.int64) if world_size % 2 == 0 else majority
    assert torch.equal(got.to(torch.int64), want.to(torch.int64))


def test_trits_round_trip():
    t = torch.randint(0, 3, (1000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    packed = pack_trits(t)
    assert packed.numel() == 200 and int(packed.max()) <= 242
    assert torch.equal(unpack_trits(packed, 997), t[:997].to(torch.int32))
    tl = t.tolist()  # the order, independently: byte e of group g is sum_k 3^k * trit (40 g + 8 k + e)
    assert packed.tolist() == [sum(3**k * tl[40 * (b // 8) + 8 * k + b % 8] for k in range(5)) for b in range(200)]
    if dispatch.AVAILABLE:
        table = np.array([-2.0, 0.5, 7.0], dtype=np.float32)
        out = np.empty(990, dtype=np.float32)
        sign_host.decode_trits(packed.numpy(), 7, 990, table, out)
        assert np.array_equal(out, table[t[7:997].numpy()])


def test_bytes_and_cost_model_pick():
    n = 1 << 24
    ss, sc, sg = REDUCERS["signscatter"], REDUCERS["signcount"], REDUCERS["signgather"]
    assert ss.bits_per_element(8, n) == pytest.approx(7 / 8 * (4 + 1.6), rel=1e-3)  # even W: trits
    assert ss.bits_per_element(9, n) == pytest.approx(8 / 9 * (4 + 1), rel=1e-3)  # odd W: bits
    assert ss.bits_per_element(512, n) < 12.5 < sc.bits_per_element(512, n)
    assert ss.wire_bytes(n, 8) < min(sc.wire_bytes(n, 8), sg.wire_bytes(n, 8))
    assert sum(ss.link_bytes(n, 8).values()) == ss.wire_bytes(n, 8)
    cm = default_cost_model(8)
    assert min(("signgather", "signcount", "signscatter"), key=lambda k: cm.time(k, n, 8)) == "signscatter"
    assert min(("signgather", "signcount", "signscatter"), key=lambda k: cm.time(k, n, 2)) == "signgather"
    assert SignScatter.shard_numel(1, 4) == 40 and SignScatter.shard_numel(161, 4) == 80


def _reduce(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    x = rank_input(rank, sum(LENGTHS))
    return {
        "signscatter": REDUCERS["signscatter"].reduce(x.clone(), LENGTHS),
        "strided": REDUCERS["signscatter"].reduce(rank_input(rank, 2 * sum(LENGTHS))[::2], LENGTHS),
        "bf16": REDUCERS["signscatter"].reduce(x.to(torch.bfloat16).float(), LENGTHS),
    }


@pytest.mark.world_size(4)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_real_gloo_equals_replay_and_independent_vote(world_size):
    results = run_ranks(_reduce, world_size, timeout_s=120)
    for key in results[0]:
        for r in range(1, world_size):
            assert torch.equal(results[0][key], results[r][key]), key  # replicas identical
    xs = [rank_input(r, sum(LENGTHS)) for r in range(world_size)]
    res = results[0]["signscatter"]
    assert torch.equal(res, REDUCERS["signscatter"].replay(xs, LENGTHS))  # replay is the real reduction
    assert torch.allclose(res, independent(xs, LENGTHS), rtol=1e-6, atol=0)
    strided = [rank_input(r, 2 * sum(LENGTHS))[::2] for r in range(world_size)]
    assert torch.equal(results[0]["strided"], REDUCERS["signscatter"].replay(strided, LENGTHS))


def test_a_slow_reduce_scatter_is_priced_out():
    from nfab.wire.cost import CostModel, LinkCost

    n, fast, slow = 1 << 24, LinkCost(1e-4, 1e9), LinkCost(1e-4, 1e7)
    keys = ("signgather", "signcount", "signscatter")
    cm = CostModel("gloo", 16, fast, fast, source="test", reducescatter=slow)
    assert min(keys, key=lambda k: cm.time(k, n)) == "signcount"
    assert min(keys, key=lambda k: CostModel("gloo", 16, fast, fast).time(k, n)) == "signscatter"
    data = json.loads(cm.to_json())
    assert CostModel.from_dict(data) == cm
    assert CostModel.from_dict({**data, "reducescatter": None}).reducescatter is None  # older files


@pytest.mark.parametrize("start", [0, 3, 5, 8, 17, 39, 40, 41, 87])
@pytest.mark.parametrize("offset", [0, 1])
def test_decode_trits_every_alignment(start, offset):
    """The compiled trit decode (whole groups of 40 from their 8 bytes, value by value before the
    first group boundary and after the last) gives the table's values at every start and offset."""
    if not dispatch.AVAILABLE:
        pytest.skip("numba not installed")
    t = torch.randint(0, 3, (2000,), generator=torch.Generator().manual_seed(start)).to(torch.uint8)
    packed = pack_trits(t).numpy()
    table = np.array([-2.0, -0.0, 7.0], dtype=np.float32)
    for numel in (0, 1, 9, 39, 40, 41, 81, 2000 - start - 3):
        buf = np.full(numel + offset + 1, 5.0, dtype=np.float32)
        sign_host.decode_trits(packed, start, numel, table, buf[offset : offset + numel])
        want = table[t[start : start + numel].numpy()]
        assert np.array_equal(buf[offset : offset + numel].view(np.uint32), want.view(np.uint32))
        assert buf[-1] == 5.0 and (offset == 0 or buf[0] == 5.0)


@pytest.mark.parametrize("host", [True, False] if dispatch.AVAILABLE else [False])
@pytest.mark.parametrize("world_size", [2, 3])
def test_encode_rows_reads_each_segment_where_it_lies(world_size, host):
    """`encode_rows` (FSDP2's rows read in place: two column ranges of each 101-element row, split
    into segments, and a tail with nothing to read) gives the votes and scales `encode` gives for
    those columns copied into rows padded to whole vote bytes: every real element's vote, every read
    segment's scale, bit for bit; the tail's scale 0. (The tail's votes are never decoded.)"""
    red, w, chunk = SignScatter(), world_size, 101
    cols = [(0, 30), (50, 41)]  # the group's columns in a row: a parameter's 30, another's 20 + 21
    numel = 71
    padded = red.shard_numel(w * numel, w)
    row = [30, 20, 21, padded - numel]
    x = rank_input(0, w * chunk)
    sources = []
    copy = torch.zeros(w, padded)
    for r in range(w):
        base = r * chunk
        sources += [(base, 30), (base + 50, 20), (base + 70, 21), (-1, padded - numel)]
        copy[r, :numel] = torch.cat([x[base + off : base + off + n] for off, n in cols])
    with dispatch.host_paths(host):
        got = red.encode_rows(x, sources, padded, w, tie=3)
        want = red.encode(copy.reshape(-1), row * w, w, tie=3)
    lay = red.layout(w)
    for r in range(w):
        mine, ref = got.payload.view(w, -1)[r], want.payload.view(w, -1)[r]
        assert torch.equal(unpack(mine, lay, numel), unpack(ref, lay, numel)), r
        expected = votes(copy[r, :numel], 3)
        assert torch.equal(unpack(mine, lay, numel), expected.to(torch.uint8)), r
    real = [i for i in range(4 * w) if i % 4 != 3]
    assert torch.equal(got.scales[real], want.scales[real])
    assert not got.scales[3::4].any()
