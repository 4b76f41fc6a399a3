"""blockqscatter: BlockQSum's result bit for bit, through an all-to-all and an all-gather.

Checked: its own path (encode -> all-to-all/owner sums/all-gather emulation -> decode) against
BlockQSum's replay and an independent sum of every rank's levels; the compiled CPU path
against the torch reference; the torch path under a meta default device; the bytes against
their formula and BlockQSum's; and real gloo ranks (W = 2, 3, 4, 8) against BlockQSum on the
same ranks, replay and the independent sum.
"""

from __future__ import annotations

import math

import pytest
import torch

from nfab.distributed import run_ranks
from nfab.wire import dispatch, noise
from nfab.wire.blockq import reducer as blockq
from nfab.wire.blockq.scatter import BlockQScatter, consecutive
from nfab.wire.contract import Reducer
from nfab.wire.cost import default_cost_model
from nfab.wire.qsum.lanes import layout_for
from nfab.wire.registry import REDUCERS, candidates

KEYS = ["bq2", "bq3", "bq4-128", "bq8", "bl5", "bl6"]
LENGTHS = [37, 1000, 3, 513, 0, 8, 64]
"""Segments shorter than a block, one empty, a total not divisible by W."""
SEED = 11


def rank_input(rank: int, numel: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(300 + rank)) * torch.logspace(-3, 1, numel)
    if numel > 200:
        x[100:164] = 0.0  # an all-zero block on every rank: code 0
    return x


def pair(key: str) -> tuple[blockq.BlockQSum, BlockQScatter]:
    red = REDUCERS[f"blockqscatter-{key}"]
    assert isinstance(red, BlockQScatter)
    return REDUCERS[f"blockq-{key}"], red  # type: ignore[return-value]


def fresh(world_size: int) -> list[torch.Generator]:
    """The key source `reduce` gets on every rank (a new one per call: drawing advances it)."""
    return [torch.Generator().manual_seed(SEED)] * world_size


def strata(world_size: int, segments: int) -> list[noise.Stratum]:
    return noise.stratified(noise.draw_keys(torch.Generator().manual_seed(SEED), segments, torch.device("cpu")),
                            world_size)


def independent(red: blockq.BlockQSum, xs: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """Every rank's levels (BlockQSum's reference rounding for its stratum), summed as integers and
    decoded by the formula mean = (2 S / (M W) - 1) * scale of the MAX-agreed block code."""
    w, m = len(xs), red.steps
    block_max = torch.stack([red.local_scale(x, lengths) for x in xs]).amax(0)
    scale = red.element_scales(blockq.scale_codes(torch.nan_to_num(block_max, nan=0.0)), lengths)
    total = sum(red._levels(x, lengths, block_max, s).to(torch.int64) for x, s in zip(xs, strata(w, len(lengths)),
                                                                                        strict=True))
    return (total.to(torch.float32) * (2.0 / (m * w)) - 1.0) * scale


def own_path(red: BlockQScatter, xs: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """The reducer's own encode / combine / decode (not BlockQSum's fast replay)."""
    return Reducer._replay(red, xs, lengths, strata(len(xs), len(lengths)))[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8, 16])
def test_own_path_is_blockq_and_the_independent_sum(key, world_size):
    plain, scatter = pair(key)
    if not plain.capacity(world_size).ok:
        pytest.skip("over capacity")
    n = sum(LENGTHS)
    xs = [rank_input(r, n) for r in range(world_size)]
    got = own_path(scatter, xs, LENGTHS)
    assert torch.equal(_bits(got), _bits(plain.replay(xs, LENGTHS, fresh(world_size))))
    assert torch.equal(_bits(got), _bits(independent(plain, xs, LENGTHS)))
    assert torch.equal(_bits(scatter.replay(xs, LENGTHS, fresh(world_size))), _bits(got))  # the inherited fast replay
    mean, locals_ = scatter.replay_with_locals(xs, LENGTHS, fresh(world_size))
    assert torch.equal(_bits(mean), _bits(got))
    _, want_locals = Reducer._replay(plain, xs, LENGTHS, strata(world_size, len(LENGTHS)))
    assert all(torch.equal(a, b.local) for a, b in zip(locals_, want_locals, strict=True))


@pytest.mark.parametrize("key,world_size", [("bq3", 16), ("bq4", 8)])
def test_shard_by_shard_decode_of_multi_block_lanes(key, world_size):
    """bq3 at W=16 and bq4 at W=8 sum into int64 lanes of 9 (two blocks): decoded per shard."""
    plain, scatter = pair(key)
    assert not consecutive(scatter.layout(world_size))
    n = 3000
    xs = [rank_input(r, n) for r in range(world_size)]
    assert torch.equal(_bits(own_path(scatter, xs, [n])), _bits(independent(plain, xs, [n])))


@pytest.mark.skipif(blockq.blockkernels is None or not dispatch.AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("key", KEYS + ["bq4"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 16])
def test_compiled_equals_reference(key, world_size):
    _, red = pair(key)
    if not red.capacity(world_size).ok:
        pytest.skip("over capacity")
    n = sum(LENGTHS)
    xs = [rank_input(r, n) for r in range(world_size)]
    shared = torch.stack([red.local_scale(x, LENGTHS) for x in xs]).amax(0)

    def run():
        encs = [red.encode(x, LENGTHS, world_size, shared, s) for x, s in zip(xs, strata(world_size, 7), strict=True)]
        reduced = red.combine([e.payload for e in encs])
        return [e.payload for e in encs], reduced, red.decode(reduced, shared, n, LENGTHS, world_size)

    fast = run()
    with dispatch.host_paths(False):
        ref = run()
    assert all(torch.equal(a, b) for a, b in zip(fast[0], ref[0], strict=True))  # own levels, per shard
    assert torch.equal(fast[1], ref[1])  # the owners' packed sums
    assert torch.equal(_bits(fast[2]), _bits(ref[2]))
    out = torch.full((n + 2,), 3.0)
    red.decode(fast[1], shared, n, LENGTHS, world_size, out=out[1:-1])
    assert torch.equal(_bits(out[1:-1]), _bits(fast[2])) and out[0] == 3.0 and out[-1] == 3.0


@pytest.mark.parametrize("key", ["bq2", "bq3", "bl5", "bl6"])
def test_torch_path_under_a_meta_default_device(key):
    """Every allocation names the input's device: under a meta default device the torch path
    (and the compiled one) give the bits of a normal run."""
    _, red = pair(key)
    w, n = 4, sum(LENGTHS)
    xs = [rank_input(r, n) for r in range(w)]
    shared = torch.stack([red.local_scale(x, LENGTHS) for x in xs]).amax(0)

    def run():
        encs = [red.encode(x, LENGTHS, w, shared, s) for x, s in zip(xs, strata(w, 7), strict=True)]
        return red.decode(red.combine([e.payload for e in encs]), shared, n, LENGTHS, w), encs[1].local

    want = run()
    for host in (False, True):
        with torch.device("meta"), dispatch.host_paths(host):
            got = run()
        assert got[0].device.type == "cpu" and torch.equal(_bits(got[0]), _bits(want[0]))
        assert torch.equal(got[1], want[1])


def formula_bytes(red: BlockQScatter, n: int, w: int) -> float:
    """Per rank: (W-1)/W of the own-levels payload + W-1 owners' sums + the codes' ring all-reduce."""
    own, lay = red.own_layout(), red.layout(w)
    k1 = own.lanes if hasattr(own, "lanes") else own.digits
    k2 = lay.lanes if hasattr(lay, "lanes") else lay.digits
    shard = math.ceil(math.ceil(n / w) / math.lcm(k1, k2)) * math.lcm(k1, k2)
    stage1 = w * shard // k1 * own.storage_bits / 8
    sums = shard // k2 * lay.storage_bits / 8
    return (w - 1) / w * stage1 + (w - 1) * sums + 2 * (w - 1) / w * math.ceil(n / red.block)


@pytest.mark.parametrize("key", ["bq2", "bq3", "bl5", "bl6"])
@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
def test_fewer_bytes_than_blockq_by_the_formula(key, world_size):
    plain, scatter = pair(key)
    n = 1 << 20
    assert scatter.wire_bytes(n, world_size) == pytest.approx(formula_bytes(scatter, n, world_size), rel=1e-12)
    assert scatter.wire_bytes(n, world_size) < plain.wire_bytes(n, world_size)
    assert sum(scatter.link_bytes(n, world_size).values()) == scatter.wire_bytes(n, world_size)
    enc = scatter.encode(torch.zeros(n), [n], world_size, torch.zeros(n // 64))
    assert enc.payload.numel() * enc.payload.element_size() == scatter.payload_bytes(n, world_size)
    payload_wire = scatter.wire_bytes(n, world_size, 0) - scatter.link_bytes(n, world_size, 0)["blocking"]
    assert scatter.collective_factor(world_size) * scatter.payload_bytes(n, world_size) == pytest.approx(payload_wire)


def test_bq2_at_w8_and_the_cost_model():
    plain, scatter = pair("bq2")
    n = 1 << 20
    assert plain.bits_per_element(8, n) == pytest.approx(8.83, abs=0.01)
    # own levels 2 bits + sums in 13 base-25 digits per int64, (W-1)/W each; codes 1 byte per 64 on a ring
    assert scatter.bits_per_element(8, n) == pytest.approx(0.875 * (2 + 64 / 13) + 1.75 * 8 / 64, abs=0.01)
    cm = default_cost_model(8)
    assert cm.time("blockqscatter-bq2", n) < cm.time("blockq-bq2", n)
    # the codes' round: one all-reduce latency (blocking_rounds), its bytes at the all-reduce bandwidth
    want = (3 * cm.allreduce.latency_s + scatter.wire_bytes(n, 8) / cm.allreduce.bandwidth_bps)
    assert cm.time("blockqscatter-bq2", n) == pytest.approx(want)
    assert [r.name for r in candidates("bq2")] == ["blockq", "blockqscatter"]


def blockq_formula(red: blockq.BlockQSum, n: int, w: int) -> float:
    """BlockQSum per rank: the denser of bit lanes and base-(W*M+1) int64 digits (k digits while
    R^k <= 2^63), on a ring, plus the codes."""
    r = w * red.steps + 1
    k = max(j for j in range(1, 64) if r**j <= 2**63)
    lanes = layout_for(math.ceil(math.log2(r)))
    payload = min(math.ceil(n / k) * 8, lanes.containers_for(n) * lanes.storage_bits / 8)
    return 2 * (w - 1) / w * (payload + math.ceil(n / red.block))


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_5_and_6_levels_cost_between_bq2_and_bq3(world_size):
    """Bits per element rise with the levels, 4 < 5 < 6 < 8, on both reducers, by the formulas."""
    n = 1 << 20
    order = ["bq2", "bl5", "bl6", "bq3"]
    for key in order:
        plain, scatter = pair(key)
        assert plain.wire_bytes(n, world_size) == pytest.approx(blockq_formula(plain, n, world_size), rel=1e-12)
        assert scatter.wire_bytes(n, world_size) == pytest.approx(formula_bytes(scatter, n, world_size), rel=1e-12)
    for name in ("blockq", "blockqscatter"):
        bits = [REDUCERS[f"{name}-{key}"].bits_per_element(world_size, n) for key in order]
        assert bits == sorted(bits) and len(set(bits)) == len(bits), (name, bits)
    fp32 = REDUCERS["allreduce-fp32"].bits_per_element(world_size, n)
    if world_size == 4:  # the 1%-at-8x target's setting: both new routes past 8x fewer bytes
        assert fp32 / pair("bl5")[1].bits_per_element(4, n) > 9.2 and fp32 / pair("bl6")[1].bits_per_element(4, n) > 8.5
    if world_size == 8:
        assert fp32 / pair("bl5")[1].bits_per_element(8, n) > 8.0


# ---- real gloo ranks -------------------------------------------------------------------------
CASES = {"segments": LENGTHS, "one": [5], "blocks": [4096 + 13, 1]}


def _reduce_all(rank: int, world_size: int, keys: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Every route's reductions in one set of ranks (spawning ranks costs more than the reductions)."""
    return {key: _reduce(rank, key) for key in keys}


def _reduce(rank: int, key: str) -> dict[str, torch.Tensor]:
    plain, scatter = pair(key)
    out = {}
    for name, lengths in CASES.items():
        x = rank_input(rank, sum(lengths))
        for tag, red in (("scatter", scatter), ("plain", plain)):
            out[f"{name}/{tag}"] = red.reduce(x.clone(), lengths, generator=torch.Generator().manual_seed(SEED))
    bad = rank_input(rank, sum(LENGTHS))
    bad[rank * 50 + 3] = math.inf if rank % 2 else math.nan
    for tag, red in (("scatter", scatter), ("plain", plain)):
        out[f"nonfinite/{tag}"] = red.reduce(bad.clone(), LENGTHS, generator=torch.Generator().manual_seed(SEED))
        out[f"empty/{tag}"] = red.reduce(torch.empty(0), [0], generator=torch.Generator().manual_seed(SEED))
    return out


@pytest.mark.world_size(4)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_real_gloo_equals_blockq_replay_and_independent(world_size):
    results = run_ranks(_reduce_all, world_size, KEYS, timeout_s=240)
    for key in KEYS:
        _check_ranks(key, world_size, [r[key] for r in results])


@pytest.mark.world_size(8)
def test_real_gloo_at_w8():
    keys = ["bq2", "bl5"]
    results = run_ranks(_reduce_all, 8, keys, timeout_s=240)
    for key in keys:
        _check_ranks(key, 8, [r[key] for r in results])


def _check_ranks(key: str, world_size: int, results: list[dict[str, torch.Tensor]]) -> None:
    plain, _ = pair(key)
    for name in results[0]:
        for r in range(world_size):
            assert torch.equal(_bits(results[0][name]), _bits(results[r][name])), name  # replicas identical
    for name, lengths in CASES.items():
        res = results[0][f"{name}/scatter"]
        xs = [rank_input(r, sum(lengths)) for r in range(world_size)]
        assert torch.equal(_bits(res), _bits(results[0][f"{name}/plain"])), name
        assert torch.equal(_bits(res), _bits(plain.replay(xs, lengths, fresh(world_size)))), name
        assert torch.equal(_bits(res), _bits(independent(plain, xs, lengths))), name
    assert torch.equal(_bits(results[0]["nonfinite/scatter"]), _bits(results[0]["nonfinite/plain"]))
    assert results[0]["empty/scatter"].numel() == 0
