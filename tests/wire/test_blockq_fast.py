"""Block-scaled qsum's compiled CPU path (`blockkernels`) against its torch reference, bit for bit.

The reference runs under `dispatch.host_paths(False)` (the path every non-CPU device takes);
both paths must give the same block maxima, levels, payload, local values and decoded mean,
for every packing (bit lanes and radix digits), block size, W and input dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from nfab.wire import dispatch, noise
from nfab.wire.blockq import reducer as blockq
from nfab.wire.blockq.radix import RadixLayout, radix_layout, unpack
from nfab.wire.blockq.reducer import BlockQSum, scale_codes

pytestmark = pytest.mark.skipif(blockq.blockkernels is None or not dispatch.AVAILABLE,
                                reason="numba not installed: only the torch reference runs")

LENGTHS = [100, 64, 1, 0, 835, 7, 4096 + 13]
"""Segments that do not divide into blocks (blocks restart per segment), one empty."""


def _x(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 + rank)
    n = sum(LENGTHS)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)
    x[100:164] = 0.0  # an all-zero block: code 0, scale 0
    x[3000] = -0.0
    return x.to(dtype)


def _both(fn):
    """(compiled, reference) results of `fn()`."""
    fast = fn()
    with dispatch.host_paths(False):
        ref = fn()
    return fast, ref


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.is_floating_point():  # same bits, -0.0 and NaN included
        a, b = a.view(torch.int32 if a.element_size() == 4 else torch.int16), b.view(
            torch.int32 if b.element_size() == 4 else torch.int16)
    assert torch.equal(a, b)


ROUTES = [(4, 64), (8, 64), (16, 64), (256, 64), (4, 128), (8, 256), (5, 64), (6, 64)]
"""(levels, block): bq2, bq3, bq4, bq8, bq2-128, bq3-256, bl5, bl6."""


@pytest.mark.parametrize("levels,block", ROUTES)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 7, 8, 12, 16])
def test_compiled_encode_and_decode_are_the_reference_bits(levels: int, block: int, world_size: int) -> None:
    red = BlockQSum(levels=levels, block=block)
    if not red.capacity(world_size).ok:
        pytest.skip("over capacity")
    xs = [_x(r) for r in range(world_size)]
    maxima = [_both(lambda x=x: red.local_scale(x, LENGTHS)) for x in xs]
    for fast, ref in maxima:
        _same(fast, ref)
    codes = torch.stack([scale_codes(m) for m, _ in maxima]).amax(0)  # what the MAX all-reduce agrees
    keys = noise.draw_keys(torch.Generator().manual_seed(5), len(LENGTHS), torch.device("cpu"))
    payloads = []
    for r, x in enumerate(xs):
        stratum = noise.Stratum(keys, r, world_size)
        fast, ref = _both(lambda x=x, s=stratum: red.encode(x, LENGTHS, world_size, codes, s))
        _same(fast.payload, ref.payload)
        _same(fast.local, ref.local)
        payloads.append(fast.payload)
    summed = red.combine(payloads)
    n = sum(LENGTHS)
    fast, ref = _both(lambda: red.decode(summed, codes, n, LENGTHS, world_size))
    _same(fast, ref)
    out = torch.full((n,), 7.0)
    red.decode(summed, codes, n, LENGTHS, world_size, out=out)  # into the bucket: same values
    _same(out, ref)
    dests = list(torch.full((n,), 7.0).split(LENGTHS))  # per-slice destinations (a mixed bucket's views)
    red.decode(summed, codes, n, LENGTHS, world_size, out=dests)
    _same(torch.cat(dests), ref)


def test_radix_layouts_are_covered() -> None:
    # the digits path is what bq2 uses at every W here; bq3 at W=4 is bit lanes
    assert all(isinstance(BlockQSum(2).layout(w), RadixLayout) for w in (2, 4, 8, 16))
    assert not isinstance(BlockQSum(3).layout(4), RadixLayout)
    # 5 and 6 levels: digits for one rank (27 base-5, 24 base-6 per int64) and for the sum at W=4
    assert [(BlockQSum(levels=v).layout(1).radix, BlockQSum(levels=v).layout(1).digits) for v in (5, 6)] == [
        (5, 27), (6, 24)]
    assert all(isinstance(BlockQSum(levels=v).layout(w), RadixLayout) for v in (5, 6) for w in (2, 4, 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_take_the_same_bits(dtype: torch.dtype) -> None:
    red, w = BlockQSum(2), 4
    x = _x(0, dtype)
    fast, ref = _both(lambda: red.local_scale(x, LENGTHS))
    _same(fast, ref)
    codes = scale_codes(fast)
    stratum = noise.Stratum(noise.draw_keys(None, len(LENGTHS), torch.device("cpu")), 1, w)
    fast, ref = _both(lambda: red.encode(x, LENGTHS, w, codes, stratum))
    _same(fast.payload, ref.payload)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_element_flags_block_zero_on_both_paths(bad: float) -> None:
    red = BlockQSum(3)
    x = _x(0)
    x[2000] = bad
    fast, ref = _both(lambda: red.local_scale(x, LENGTHS))
    assert math.isnan(fast[0]) and math.isnan(ref[0])
    assert torch.equal(torch.isnan(fast), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    assert torch.equal(fast[finite], ref[finite])


def test_radix_digits_of_extreme_containers() -> None:
    # containers whose every digit is R-1 (the largest W-rank sums) and zero: the float64
    # quotient is corrected to the exact integer split
    for w in (2, 4, 8, 16):
        layout = BlockQSum(2).layout(w)
        assert isinstance(layout, RadixLayout)
        k, r = layout.digits, layout.radix
        top = sum((r - 1) * r**j for j in range(k))
        containers = torch.tensor([top, 0, top - 1, r**k - r ** (k - 1)], dtype=torch.int64)
        n = containers.numel() * k
        codes = torch.full((-(-n // 64),), 160, dtype=torch.uint8)
        fast, ref = _both(lambda c=containers, n=n, codes=codes, w=w: BlockQSum(2).decode(c, codes, n, [n], w))
        _same(fast, ref)


def test_the_cpu_path_is_the_compiled_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # the comparisons above would pass vacuously if both sides ran the reference
    called: list[str] = []
    names = ("block_max_bits", "scale_codes", "block_levels", "radix_pack_chunked", "radix_decode_chunked")
    for name in names:
        fn = getattr(blockq.blockkernels, name)
        monkeypatch.setattr(blockq.blockkernels, name, lambda *a, _f=fn, _n=name: (called.append(_n), _f(*a))[1])
    red, w, x = BlockQSum(2), 4, _x(0)
    codes = scale_codes(red.local_scale(x, LENGTHS))
    enc = red.encode(x, LENGTHS, w, codes, noise.Stratum(None, 0, w))
    red.decode(enc.payload, codes, x.numel(), LENGTHS, w)
    assert called == list(names)
    called.clear()
    with dispatch.host_paths(False):
        red.local_scale(x, LENGTHS)
    assert called == []


def test_compiled_scale_codes_are_searchsorted_clamped() -> None:
    # every scale, its float32 neighbours, zeros, NaN and infinities: torch's searchsorted (left), clamped
    s = blockq.SCALES
    edges = torch.cat([s, torch.nextafter(s, torch.tensor(math.inf)), torch.nextafter(s, torch.tensor(0.0))])
    v = torch.cat([edges, torch.tensor([0.0, -0.0, math.nan, math.inf, 3e38, 1e-45, -1.0])])
    fast, ref = _both(lambda: scale_codes(v))
    _same(fast, ref)
    assert fast[v.isnan()].tolist() == [0]  # a NaN block max codes as 0 (the bucket's |g|^2 flags it)


def test_every_scale_is_its_octave_entry_times_a_power_of_two() -> None:
    """What the kernel's exponent arithmetic (`blockkernels.scale_codes`) rests on, for every code."""
    codes = torch.arange(1, 256)
    octave = torch.div(codes - blockq.CODE_OFFSET, 4, rounding_mode="floor")
    step = (codes - blockq.CODE_OFFSET) % 4
    assert torch.equal(torch.ldexp(blockq.SCALES[blockq.CODE_OFFSET + step], octave), blockq.SCALES[1:])


def test_compiled_scale_codes_of_subnormals_and_a_wide_spread_are_searchsorted() -> None:
    # below 2^-40 (subnormals too) the formula is at most 0 and clamps to 1; from 2^24 every code is 255
    special = torch.tensor([1e-45, 1e-40, 1.17e-38, 2.0**-41, 2.0**-40, 2.0**23.75, 2.0**24, 3e38])
    spread = torch.exp2(torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 140 - 70)  # 2^-70..2^70
    v = torch.cat([special, spread])
    fast, ref = _both(lambda: scale_codes(v))
    _same(fast, ref)


def test_every_radix_splits_into_exact_float64_halves() -> None:
    # `_chunk_digits` corrects the float64 split c = hi * R^h + lo by one step and needs both
    # halves below 2^51: R^h >= 2^12 and R^(k-h) < 2^51 for every radix a route can ask for
    for r in range(2, 16 * 255 + 2):
        k = radix_layout(r).digits
        assert r ** (k // 2) >= 1 << 12 and r ** (k - k // 2) < 1 << 51, r


@pytest.mark.parametrize("radix", [5, 6, 7, 13, 21, 49, 65, 4081])
def test_compiled_radix_digits_are_unpack(radix: int) -> None:
    layout = radix_layout(radix)
    k, g = layout.digits, torch.Generator().manual_seed(radix)
    digits = torch.randint(0, radix, (300 * k,), generator=g)
    digits[:k] = radix - 1  # the largest container, then the smallest
    digits[k:2 * k] = 0
    containers = (digits.view(-1, k) * torch.tensor([radix**j for j in range(k)])).sum(1)
    for numel in (digits.numel(), digits.numel() - k + 1, 5):
        out = torch.empty(numel, dtype=torch.int32)
        blockq.blockkernels.radix_digits(containers.numpy(), radix, k, numel, out.numpy())
        assert torch.equal(out.long(), unpack(containers, layout, numel))


@pytest.mark.parametrize("lane_bits", [1, 2, 4, 5, 6, 3])
@pytest.mark.parametrize("n", [0, 1, 5, 7, 9, 1003])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
def test_host_lane_pack_is_lanes_pack(lane_bits: int, n: int, dtype: torch.dtype) -> None:
    # the CPU kernels' packing (`pack_any`, compiled): uint8 lanes by word folds, one-block int32 lanes
    # with only the last container padded, several blocks (21 3-bit lanes) padded whole; levels (uint8)
    # and the owner's integer sums (int32); every lane at its largest value and at 0
    from nfab.wire.qsum.lanes import layout_for, pack

    layout = layout_for(lane_bits)
    values = torch.randint(0, layout.max_value + 1, (n,), generator=torch.Generator().manual_seed(n)).to(dtype)
    values[: layout.lanes] = layout.max_value
    values[layout.lanes : 2 * layout.lanes] = 0
    assert torch.equal(blockq.pack_any(values, layout, True), pack(values, layout))
