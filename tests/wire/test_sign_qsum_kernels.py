"""The sign and qsum numba kernels (`sign/host.py`, `qsum/host.py`, what CPU tensors take) give the
same bits as the torch reference (the path every other device runs); blockq's are held to it in
test_blockq_fast.py.

Sizes cover odd lengths, empty and one-element segments, segments that start mid-byte,
and the kernels' 4096-element chunk boundaries.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nfab.wire import dispatch
from nfab.wire.qsum import host as qsum_host
from nfab.wire.qsum import lanes
from nfab.wire.qsum.lanes import count_lane_bits, layout_for
from nfab.wire.registry import REDUCERS
from nfab.wire.sign import codec as sign_codec
from nfab.wire.sign import host as sign_host

pytestmark = pytest.mark.skipif(not dispatch.AVAILABLE, reason="numba not installed")

SHAPES = [
    (1, [1]),
    (7, [7]),
    (21, [10, 0, 11]),
    (1001, [400, 601]),
    (8195, [4095, 1, 4097, 2]),  # chunk edges relative to each segment's start
    (70_001, [3, 0, 69_990, 8]),
]


def _x(numel: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if numel >= 8:
        x[:6] = torch.tensor([0.0, -0.0, float("nan"), float("-inf"), float("inf"), -1e-30])
        x[-1] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel,lengths", SHAPES)
def test_sign_votes_match_reference(dtype, numel, lengths):
    x = _x(numel, numel, dtype)
    for tie in (0, 1):  # a zero votes by the tie (+-0.0 alike), NaN negative
        bits, sums = sign_host.sign_votes(x, lengths, tie)
        assert np.array_equal(bits, np.packbits(sign_codec.sign_bits(x.float(), tie).numpy(), bitorder="little"))
    wide = x.to(torch.float64)
    expected = np.array([p.abs().sum().item() for p in torch.split(wide, lengths)])
    assert np.allclose(sums, expected, rtol=1e-5, equal_nan=True)


SPECIAL = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, -1e-30, 3.0, -3.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sign_votes_of_special_values_in_every_vector_lane(dtype):
    """The votes are taken 8 at a time by one vector compare: each special value (signed zeros,
    both NaNs, infinities, subnormals) in each of the 64 places of a word, and in the tail."""
    base = torch.randn(64 * len(SPECIAL) + 77, generator=torch.Generator().manual_seed(5))
    for i, v in enumerate(SPECIAL):
        base[64 * i : 64 * (i + 1) : 1 + i % 3] = v
    base[-77::2] = -0.0
    x = base.to(dtype)
    for lengths in ([x.numel()], [13, x.numel() - 13]):  # the second segment's words are shifted
        for tie in (0, 1, 6, 7):
            bits, _ = sign_host.sign_votes(x, lengths, tie)
            assert np.array_equal(bits, np.packbits(sign_codec.sign_bits(x.float(), tie).numpy(), bitorder="little"))


@pytest.mark.parametrize("numel,lengths", SHAPES)
def test_segment_sums_do_not_depend_on_neighbours_or_offset(numel, lengths):
    """A slice's scale is the same alone, inside a bucket, and read as a view."""
    x = _x(numel, 3)
    _, together = sign_host.sign_votes(x, lengths)
    parts = torch.split(x, lengths)
    alone = [sign_host.sign_votes(p.clone(), [p.numel()])[1][0] for p in parts]
    bits_v, views = sign_host.sign_votes_views(list(parts), lengths)
    assert np.array_equal(together, np.array(alone), equal_nan=True)
    assert np.array_equal(together, views, equal_nan=True)
    assert np.array_equal(bits_v, sign_host.sign_votes(x, lengths)[0])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 31, 64, 100, 512])
@pytest.mark.parametrize("numel", [1, 7, 9, 63, 1001, 8195])
def test_votes_to_lanes_match_pack(world_size, numel):
    layout = layout_for(count_lane_bits(world_size))
    x = _x(numel, world_size)
    bits, _ = sign_host.sign_votes(x, [numel])
    assert torch.equal(sign_host.votes_to_lanes(bits, numel, layout), lanes.pack(sign_codec.sign_bits(x), layout))


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16, 31, 100])
@pytest.mark.parametrize("numel", [1, 9, 1001, 8195])
def test_vote_spread_writes_every_container(world_size, numel):
    """The spread kernels take np.empty buffers: containers past the last element come out 0,
    whatever the buffer held."""
    from nfab.wire.qsum import lane_kernels as lanekernels

    layout = layout_for(count_lane_bits(world_size))
    x = _x(numel, world_size)
    bits, _ = sign_host.sign_votes(x, [numel])
    padded = np.concatenate([bits, np.zeros(2, dtype=np.uint8)])
    want = lanes.pack(sign_codec.sign_bits(x), layout).numpy()
    out = np.full(want.size + 0, -1).astype(want.dtype)  # all bits set
    spread = lanekernels.spread_table(layout.lane_bits)
    if out.itemsize == 1:
        lanekernels.bits_to_byte_lanes(padded, numel, layout.lanes, out, spread)
    else:
        lanekernels.bits_to_wide_lanes(padded, numel, layout.lane_bits, layout.lanes, out, spread)
    assert np.array_equal(out, want)
    out[:] = np.full(1, -1).astype(out.dtype)
    qsum_host.bits_to_lanes(padded, numel, layout, out)  # with the layouts' whole-group passes
    assert np.array_equal(out, want)


@pytest.mark.parametrize("lane_bits", [1, 2, 4])
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 17, 64, 1003])
@pytest.mark.parametrize("offset", [0, 3])
def test_level_bytes_packed_by_word_folds_are_lanes_pack(lane_bits, numel, offset):
    """`pack_bytes` folds whole words of 8 values in a register, the last partial word value by value,
    into np.empty containers; from values that do not start on a word too: `lanes.pack`'s bytes,
    every lane at its largest value and at 0."""
    if not dispatch.AVAILABLE:
        pytest.skip("numba not installed")
    from nfab.wire.qsum import lane_kernels as lanekernels

    layout = layout_for(lane_bits)
    top = (1 << lane_bits) - 1
    values = np.random.default_rng(numel).integers(0, top + 1, numel).astype(np.uint8)
    values[: min(numel, 8)] = top
    values[8:16] = 0
    buffer = np.zeros(numel + offset, dtype=np.uint8)
    buffer[offset:] = values
    out = np.full(layout.containers_for(numel), 0xA5, dtype=np.uint8)
    lanekernels.pack_bytes(buffer[offset:], lane_bits, out)
    assert np.array_equal(out, lanes.pack(torch.from_numpy(values), layout).numpy())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8, 9, 16, 17, 100, 255])
@pytest.mark.parametrize("start,numel", [(0, 1), (3, 5), (0, 4096), (5, 4100), (1, 9000)])
def test_decode_bit_rows_counts_every_row(world_size, start, numel):
    g = torch.Generator().manual_seed(world_size + start)
    votes = torch.randint(0, 2, (world_size, start + numel), generator=g, dtype=torch.uint8)
    rows = np.stack([np.packbits(v.numpy(), bitorder="little") for v in votes])
    table = torch.randn(world_size + 1, generator=g).numpy()
    out = np.full(numel, 7.0, dtype=np.float32)
    sign_host.decode_bit_rows(rows, start, numel, table, out)
    assert np.array_equal(out, table[votes.long().sum(0).numpy()[start:]])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 32, 100, 255])
@pytest.mark.parametrize("start,numel", [(0, 1), (3, 5), (0, 4096), (5, 4100), (1, 9000), (7, 8199), (3, 40000)])
@pytest.mark.parametrize("scale", [0.37, 0.0, float("nan"), float("inf")])
def test_majority_bit_rows_is_the_majority_table(world_size, start, numel, scale):
    """The bit-sliced majority decode writes the bits of count -> sign(2c - W) * scale by table."""
    g = torch.Generator().manual_seed(world_size * 31 + start)
    votes = torch.randint(0, 2, (world_size, start + numel), generator=g, dtype=torch.uint8)
    if world_size > 1:  # a stretch of exact ties (even W) and unanimous votes
        votes[: world_size // 2, start : start + 64] = 1
        votes[world_size // 2 :, start : start + 64] = 0
        votes[:, start + 64 : start + 80] = 1
    rows = np.stack([np.packbits(v.numpy(), bitorder="little") for v in votes])
    with np.errstate(invalid="ignore"):
        table = (sign_codec.vote_table(world_size, "majority").numpy() * np.float32(scale)).astype(np.float32)
    expected = table[votes.long().sum(0).numpy()[start:]]
    out = np.full(numel, 7.0, dtype=np.float32)
    sign_host.majority_bit_rows(rows, start, numel, world_size, scale, out)
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=6), world_size=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_sign_reducers_fast_equal_reference(lengths, world_size, seed):
    """Whole encode -> combine -> decode, compiled vs torch reference: the same payload and
    the same decoded bits for the same scales (scales are sums: equal to float rounding)."""
    n = sum(lengths)
    if n == 0:
        return
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g) for _ in range(world_size)]
    for key in ("signcount", "signgather"):
        red = REDUCERS[key]
        fast = [red.encode(x, lengths, world_size) for x in xs]
        with _reference():
            ref = [red.encode(x, lengths, world_size) for x in xs]
        for a, b in zip(fast, ref, strict=True):
            assert torch.equal(a.payload, b.payload)
            assert torch.allclose(a.scales, b.scales, rtol=1e-5)
        for x, a in zip(xs, fast, strict=True):
            assert torch.equal(a.local, sign_codec.sign_values(x >= 0, a.scales, lengths))
        reduced = red.combine([e.payload for e in fast])
        scales = torch.stack([e.scales for e in fast]).mean(0)
        got = red.decode(reduced.clone(), scales, n, lengths, world_size)
        with _reference():
            want = red.decode(reduced.clone(), scales, n, lengths, world_size)
        assert torch.equal(got, want), key


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("numel,lengths", SHAPES)
@pytest.mark.parametrize("per_segment_noise", [False, True])
def test_qsum_fast_equal_reference(bits, world_size, numel, lengths, per_segment_noise):
    red = REDUCERS[f"qsum-q{bits}"]
    if not red.capacity(world_size).ok:
        pytest.skip("over capacity")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    shared = red.local_scale(x, lengths) * 0.7  # some elements saturate
    shared[0] = 0.0  # an all-zero scale takes the safe path

    def gens():
        if per_segment_noise:
            return [torch.Generator().manual_seed(i) for i in range(len(lengths))]
        return torch.Generator().manual_seed(5)

    fast = red.encode(x, lengths, world_size, shared, gens())
    with _reference():
        ref = red.encode(x, lengths, world_size, shared, gens())
    assert torch.equal(fast.payload, ref.payload)
    assert torch.equal(fast.local, ref.local)
    got = red.decode(fast.payload.clone(), shared, numel, lengths, world_size)
    with _reference():
        want = red.decode(fast.payload.clone(), shared, numel, lengths, world_size)
    assert torch.equal(got, want)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 16, 255])
@pytest.mark.parametrize("lengths", [[1], [4099], [3, 0, 500, 7]])
def test_qsum_q8_computed_decode_is_the_table_decode_bit_for_bit(world_size, lengths):
    """q8's decode computes (level * step - 1) * scale instead of looking it up: same bits,
    into a fresh tensor and into `out`."""
    red = REDUCERS["qsum-q8"]
    g = torch.Generator().manual_seed(world_size)
    n = sum(lengths)
    summed = torch.randint(0, 256, (n,), generator=g).to(torch.uint8)
    scales = torch.rand(len(lengths), generator=g) * 3
    with _reference():
        want = red.decode(summed, scales, n, lengths, world_size).view(torch.int32)
    assert torch.equal(red.decode(summed, scales, n, lengths, world_size).view(torch.int32), want)
    out = torch.full((n,), 7.0)
    red.decode(summed, scales, n, lengths, world_size, out=out)
    assert torch.equal(out.view(torch.int32), want)


class _reference:
    """Run the torch reference on CPU (the compiled paths switched off) inside a `with`."""

    def __enter__(self):
        self._was = dispatch.AVAILABLE
        dispatch.AVAILABLE = False

    def __exit__(self, *exc):
        dispatch.AVAILABLE = self._was


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key", ["signcount", "signgather", "signscatter"])
def test_half_precision_gradients_encode_alike_on_both_paths(dtype, key):
    """bf16/fp16 buckets are encoded without an fp32 copy: same payload as the reference."""
    x = _x(8195, 11, dtype)
    lengths = [4095, 1, 4099]
    red = REDUCERS[key]
    fast = red.encode(x, lengths, 4)
    with _reference():
        ref = red.encode(x, lengths, 4)
    assert torch.equal(fast.payload, ref.payload)
    assert torch.allclose(fast.scales, ref.scales, rtol=1e-5, equal_nan=True)
