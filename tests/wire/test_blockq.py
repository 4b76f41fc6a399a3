"""Block-scaled qsum: codes, capacity, bytes, and real gloo reductions against an independent computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from nfab.distributed import run_ranks
from nfab.wire.blockq.reducer import SCALES, BlockQSum, route_name, scale_codes
from nfab.wire.noise import uniform_scalar
from nfab.wire.registry import REDUCERS, candidates

LENGTHS = [100, 64, 1, 835, 7]
"""Segments that do not divide into blocks: blocks restart at every segment."""


def _x(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    # magnitudes over four decades, one all-zero segment-sized stretch
    x = torch.randn(sum(LENGTHS), generator=g) * torch.logspace(-4, 0, sum(LENGTHS))
    x[100:164] = 0.0
    return x


def _gens(world_size: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(50 + r) for r in range(world_size)]


def test_scale_codes_are_the_smallest_covering_quarter_octave():
    amax = torch.tensor([0.0, 1e-30, 3e-7, 0.5, 1.0, 1.0000001, 7.3, 1e9])
    codes = scale_codes(amax)
    for a, c in zip(amax.tolist(), codes.tolist(), strict=True):
        if a == 0:
            assert c == 0
            continue
        assert SCALES[c] >= a or c == 255
        assert c == 1 or SCALES[c - 1] < a
        # independent: 2^(ceil(4 log2 a)/4)
        want = min(max(math.ceil(4 * math.log2(a) - 1e-9) + 160, 1), 255)
        assert abs(c - want) <= 1 and (c == want or SCALES[want] < a or SCALES[c] == SCALES[want])


def test_route_names_lanes_and_bytes():
    assert route_name(3) == "bq3" and route_name(4, 128) == "bq4-128"
    # blockq, then blockqscatter (the same bits, fewer bytes: tests/wire/test_blockqscatter.py)
    assert [(r.name, r.route) for r in candidates("bq3")] == [("blockq", "bq3"), ("blockqscatter", "bq3")]
    assert candidates("bq4-128")[0].block == 128
    bq3 = REDUCERS["blockq-bq3"]
    assert isinstance(bq3, BlockQSum)
    assert bq3.capacity(4).lane_bits == 5  # 4 ranks x 7 steps = 28 < 32
    assert bq3.capacity(2).lane_bits == 4
    assert REDUCERS["blockq-bq8"].capacity(4).lane_bits == 10
    n = 1 << 20
    # 5-bit lanes, 6 per int32: 32/6 bits per element, on a ring, plus one code byte per 64
    want = 1.5 * (math.ceil(n / 6) * 4 + n // 64)
    assert bq3.wire_bytes(n, 4) == pytest.approx(want)
    fp32 = REDUCERS["allreduce-fp32"].wire_bytes(n, 4)
    assert 5.5 < fp32 / bq3.wire_bytes(n, 4) < 6.5  # ~6x fewer bytes than FP32 at W=4


def _independent(xs: list[torch.Tensor], steps: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean the reduction must produce, computed element by element from the definition:
    per block the scale 2^(c/4) covering every rank's max |x|, each rank's levels rounded with
    its own stratum of the one shared noise stream (u shifted by r/W mod 1), summed, decoded.
    Returns (mean, per-element scale)."""
    w, m = len(xs), steps
    n = xs[0].numel()
    scale = torch.empty(n)
    pos = 0
    for length in LENGTHS:
        for b0 in range(0, length, block):
            sl = slice(pos + b0, pos + min(b0 + block, length))
            a = max(float(x[sl].abs().max()) for x in xs)
            scale[sl] = 0.0 if a == 0 else float(SCALES[int(scale_codes(torch.tensor([a]))[0])])
        pos += length
    total = torch.zeros(n, dtype=torch.int64)
    # the counter-based noise, from its plain-integer statement (nfab.wire.noise): one 64-bit
    # key per segment from the shared generator, u = lowbias32(keyed counter of index) + r/W (mod 1)
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (len(LENGTHS),), generator=_gens(w)[0], dtype=torch.int64)
    for r, x in enumerate(xs):
        shift = (r << 24) // w
        noise = torch.tensor([uniform_scalar(int(k) % (1 << 64), i, shift)
                              for k, length in zip(keys.tolist(), LENGTHS, strict=True) for i in range(length)])
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        u = ((x / safe) + 1.0) * (0.5 * m) + noise
        total += u.floor().clamp(0, m).to(torch.int64)
    mean = (total.to(torch.float32) * (2.0 / (m * w)) - 1.0) * scale
    return mean, scale


KEYS_AT = {2: ("blockq-bq3", "blockq-bq2", "blockq-bl5", "blockq-bl6"),
           3: ("blockq-bq4-128", "blockq-bq3", "blockq-bq2-256", "blockq-bl5", "blockq-bl6"),
           4: ("blockq-bq3", "blockq-bq8", "blockq-bq2", "blockq-bl5", "blockq-bl6")}


def _reduce(rank: int, world_size: int) -> dict:
    # gloo's MAX all-reduce of uint8 (how block codes are agreed)
    t = torch.tensor([rank, 255 - rank, 7], dtype=torch.uint8)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    # every rank passes the same key source (stratified rounding: reduce adds the rank's shift)
    out = {key: REDUCERS[key].reduce(_x(rank), LENGTHS, generator=_gens(world_size)[0])
           for key in KEYS_AT[world_size]}
    return {"uint8_max": t.tolist(), **out}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_reduction_equals_replay_and_an_independent_computation(world_size):
    res = run_ranks(_reduce, world_size, timeout_s=120)
    assert all(r["uint8_max"] == [world_size - 1, 255, 7] for r in res)
    xs = [_x(r) for r in range(world_size)]
    for key in KEYS_AT[world_size]:
        red = REDUCERS[key]
        replay = red.replay(xs, LENGTHS, _gens(world_size))
        for r in res:
            assert torch.equal(r[key], replay)  # one-process replay is bit-identical to the wire
        want, scale = _independent(xs, red.steps, red.block)
        assert torch.allclose(replay, want, rtol=0, atol=1e-6 * float(scale.max()))
        # and it estimates the mean: at most one level of one rank away, per element
        err = (replay - torch.stack(xs).mean(0)).abs()
        assert bool((err <= scale * (2.0 / red.steps) + 1e-12).all())
        assert bool((replay[100:164] == 0).all())  # an all-zero block stays exactly zero


def test_stochastic_rounding_is_unbiased():
    red = REDUCERS["blockq-bq3"]
    xs = [_x(r) for r in range(2)]
    runs = [red.replay(xs, LENGTHS, [torch.Generator().manual_seed(7 * s + r) for r in range(2)])
            for s in range(200)]
    mean = torch.stack(runs).mean(0)
    truth = torch.stack(xs).mean(0)
    _, scale = _independent(xs, 7, 64)
    # 200 draws: the error of the average shrinks by ~14x against one level
    assert bool(((mean - truth).abs() <= scale * (2.0 / 7) / 4 + 1e-12).all())


def test_non_finite_input_is_flagged_by_the_block_maxima():
    red = REDUCERS["blockq-bq4"]
    x = _x(0)
    x[500] = math.nan
    assert not bool(torch.isfinite(red.local_scale(x, LENGTHS)).all())
    assert bool(torch.isfinite(red.local_scale(_x(0), LENGTHS)).all())


@pytest.mark.parametrize("key,world_size", [("blockq-bq3", 4), ("blockq-bq2", 4), ("blockq-bq2", 8), ("blockq-bq4", 3),
                                            ("blockq-bl5", 4), ("blockq-bl6", 3)])
def test_stratified_rounding_cancels_across_ranks(key, world_size):
    """Identical inputs on every rank: the W strata of one element sum to within ONE level of
    the exact W * level (Hermite's identity), so the mean is within 1/W of a level; independent
    rounding would stray by ~sqrt(W) levels somewhere among a thousand elements."""
    red = REDUCERS[key]
    x = _x(0)
    xs = [x.clone() for _ in range(world_size)]
    _, scale = _independent(xs, red.steps, red.block)
    step = scale * (2.0 / red.steps)
    for seed in range(3):
        got = red.replay(xs, LENGTHS, [torch.Generator().manual_seed(seed)] + [None] * (world_size - 1))
        assert bool(((got - x).abs() <= step / world_size * (1 + 1e-5) + 1e-12).all())
    # the plain per-rank path (one generator each, no stratum) is what stratification beats
    indep = [red.encode(xi, LENGTHS, world_size, red.local_scale(xi, LENGTHS),
                        torch.Generator().manual_seed(90 + r)).local for r, xi in enumerate(xs)]
    assert bool(((torch.stack(indep).mean(0) - x).abs() > step / world_size * 1.01).any())


def test_bq2_packs_base_13_digits_at_w4_and_beats_8x():
    red = REDUCERS["blockq-bq2"]
    layout = red.layout(4)
    assert (layout.radix, layout.digits) == (13, 17)  # 13^17 < 2^63 <= 13^18
    n = 1 << 20
    fp32 = REDUCERS["allreduce-fp32"].wire_bytes(n, 4)
    assert fp32 / red.wire_bytes(n, 4) > 8.0
    assert fp32 / REDUCERS["blockq-bq2-128"].wire_bytes(n, 4) > 8.2


@pytest.mark.parametrize("levels", [4, 8, 16, 256, 5, 6])
@pytest.mark.parametrize("world_size", [1, 3, 4, 8])
def test_summed_replay_equals_the_packed_lanes_bit_for_bit(levels, world_size):
    """Replay sums the ranks' levels directly (`_replay_summed`); the generic path packs them in
    lanes (bit or radix), adds the containers and unpacks: same means and locals, bit for bit."""
    from nfab.wire import noise
    from nfab.wire.contract import Reducer

    for block in (64, 256):
        red = BlockQSum(levels=levels, block=block)
        xs = [_x(r % 5) * (1 + r) for r in range(world_size)]
        keys = noise.draw_keys(torch.Generator().manual_seed(levels), len(LENGTHS), torch.device("cpu"))
        gens = noise.stratified(keys, world_size)
        summed = red._replay_summed(xs, LENGTHS, gens)
        assert summed is not None
        mean, locals_ = Reducer.replay_with_locals(red, xs, LENGTHS, gens)
        assert torch.equal(summed[0], mean)
        assert all(torch.equal(a, b) for a, b in zip(summed[1], locals_, strict=True))


def test_summed_replay_leaves_non_finite_inputs_and_foreign_keys_to_the_generic_path():
    from nfab.wire import noise

    red = REDUCERS["blockq-bq3"]
    xs = [_x(r) for r in range(4)]
    keys = noise.draw_keys(torch.Generator().manual_seed(0), len(LENGTHS), torch.device("cpu"))
    assert red._replay_summed(xs, LENGTHS, noise.stratified(keys, 4)) is not None
    bad = [x.clone() for x in xs]
    bad[2][7] = math.inf
    assert red._replay_summed(bad, LENGTHS, noise.stratified(keys, 4)) is None
    per_rank = [noise.Stratum(torch.Generator().manual_seed(r), r, 4) for r in range(4)]
    assert red._replay_summed(xs, LENGTHS, per_rank) is None  # keys drawn per rank: not one shared stream
    mean, _ = red.replay_with_locals(bad, LENGTHS, noise.stratified(keys, 4))  # the generic path still runs
    assert mean.shape == xs[0].shape


def test_a_large_layouts_block_index_is_built_on_the_device_as_the_kept_one_is():
    """Past `grid.CACHED_INDEX` elements (an FSDP2 module's rows of segments) the per-element block ids
    are expanded from the kept block sizes at each call: the same ids and count as the index built
    element by element."""
    from nfab.wire.blockq import grid

    cpu = torch.device("cpu")
    lengths = (grid.CACHED_INDEX // 2 + 3, 64 * 5, 1, grid.CACHED_INDEX // 2 + 100)
    ids, at = [], 0
    for n in lengths:  # the numbering `kernels.py` documents: blocks restart per segment, counted on
        ids.append(torch.arange(n) // 64 + at)
        at += -(-n // 64)
    want = torch.cat(ids)
    got, blocks = grid.block_index(lengths, 64, cpu)
    assert sum(lengths) > grid.CACHED_INDEX and blocks == at and torch.equal(got, want)
    small = lengths[1:3]
    assert torch.equal(grid.block_index(small, 64, cpu)[0], want[lengths[0] : lengths[0] + sum(small)] - want[
        lengths[0]])
