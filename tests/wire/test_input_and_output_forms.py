"""The same bits whatever form a codec's input or output takes: lane packing from bool, uint8 or
int64 values; a table decode (torch and numba) or an unpack and a gather; sign votes and scales
of signed zeros, NaN, bf16 and strided views; a decode into one tensor or into each segment's
own destination."""

import pytest
import torch

from nfab.wire import segments
from nfab.wire.qsum import host as qsum_host
from nfab.wire.qsum import lanes
from nfab.wire.qsum.lanes import count_lane_bits, layout_for, pack, unpack
from nfab.wire.sign import codec as sign_codec

SIZES = [0, 1, 7, 8, 21, 22, 63, 1001]


@pytest.mark.parametrize("lane_bits", list(range(1, 13)))
@pytest.mark.parametrize("numel", SIZES)
def test_pack_fast_path_matches_torch_path(lane_bits, numel):
    layout = layout_for(lane_bits)
    g = torch.Generator().manual_seed(lane_bits * 1000 + numel)
    votes = torch.randint(0, 2, (numel,), generator=g)
    assert torch.equal(pack(votes.bool(), layout), pack(votes.long(), layout))  # bool vs int64 input
    if lane_bits <= 8:
        levels = torch.randint(0, layout.max_value + 1, (numel,), generator=g)
        assert torch.equal(pack(levels.to(torch.uint8), layout), pack(levels, layout))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8, 16, 31, 32, 63, 100])
@pytest.mark.parametrize("numel", SIZES + [4099, 100003])
def test_decode_table_matches_unpack_and_gather(world_size, numel):
    layout = layout_for(count_lane_bits(world_size))
    g = torch.Generator().manual_seed(world_size * 7 + numel)
    total = pack(torch.randint(0, 2, (numel,), generator=g).bool(), layout).long()
    total = total.to(layout.container)
    for _ in range(world_size - 1):
        total += pack(torch.randint(0, 2, (numel,), generator=g).bool(), layout)
    values = torch.randn(layout.max_value + 1, generator=g)
    expected = values[unpack(total, layout, numel).long()]
    assert torch.equal(lanes.decode_table(total, layout, numel, values), expected)
    assert torch.equal(qsum_host.decode_table(total, layout, numel, values), expected)  # compiled on CPU


def test_sign_fast_paths_on_zeros_nan_and_strided_input():
    x = torch.tensor([0.0, -0.0, 1.5, -2.0, float("nan"), float("-inf"), 3.0] * 5)
    for tie in range(4):  # x > 0 votes positive, x < 0 and NaN negative, a zero (+-0.0) by the tie
        assert torch.equal(sign_codec.sign_bits(x, tie), (x > 0) | ((x == 0) & (tie % 2 == 0)))
        assert torch.equal(sign_codec.sign_bits(x[None, :], tie)[0], sign_codec.sign_bits(x, tie))
        assert torch.equal(sign_codec.sign_bits(x.to(torch.bfloat16), tie), sign_codec.sign_bits(x, tie))
    strided = torch.randn(2 * 1001)[::2]
    assert torch.equal(sign_codec.sign_bits(strided), strided >= 0)
    lengths = [400, 601]
    scales = segments.segment_mean_abs(strided, lengths)
    expected = torch.stack([p.abs().mean() for p in torch.split(strided, lengths)])
    assert torch.allclose(scales, expected, rtol=1e-5)
    bits = strided >= 0
    local = sign_codec.sign_values(bits, scales, lengths)
    ref = torch.where(bits, 1.0, -1.0) * torch.repeat_interleave(scales, torch.tensor(lengths))
    assert torch.equal(local, ref)
    one = sign_codec.sign_values(bits, scales[:1], [1001])  # one segment: the scale rides in the table
    assert torch.equal(one, torch.where(bits, 1.0, -1.0) * scales[0])
    assert sign_codec.sign_values(torch.zeros(0, dtype=torch.bool), scales[:1], [0]).numel() == 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("key", ["allreduce-fp32", "allreduce-bf16", "signcount", "signgather", "qsum-q8",
                                 "qsum-q4", "qsum-q2"])
@pytest.mark.parametrize("lengths", [[37], [5, 17, 1, 40, 0, 9], [16, 8, 0, 24, 41]])  # last: byte-aligned starts
def test_decode_into_per_segment_destinations_matches_one_tensor(key, world_size, lengths):
    """A mixed bucket's decode writes each slice at its own offset: same bits as decode + scatter."""
    from nfab.wire.registry import REDUCERS

    red = REDUCERS[key]
    if not red.capacity(world_size).ok:
        pytest.skip("over capacity")
    g = torch.Generator().manual_seed(world_size * 31 + len(lengths))
    n = sum(lengths)
    xs = [torch.randn(n, generator=g) for _ in range(world_size)]
    shared = torch.stack([red.local_scale(x, lengths) for x in xs]).amax(0) if red.needs_shared_scale else None
    encs = [red.encode(x, lengths, world_size, shared, torch.Generator().manual_seed(r)) for r, x in enumerate(xs)]
    reduced = red.combine([e.payload for e in encs])
    scale = shared if shared is not None else (
        torch.stack([e.scales for e in encs]).mean(0) if encs[0].scales is not None else None)
    whole = red.decode(reduced, scale, n, lengths, world_size)
    bucket = torch.full((3 * n + 8,), 7.0)
    offsets, at = [], 3
    for ln in lengths:  # scattered, with gaps that must stay untouched
        offsets.append(at)
        at += ln + 2
    dests = [bucket[o : o + ln] for o, ln in zip(offsets, lengths, strict=True)]
    red.decode(reduced, scale, n, lengths, world_size, out=dests)
    got = torch.cat([bucket[o : o + ln] for o, ln in zip(offsets, lengths, strict=True)])
    assert torch.equal(got, whole)
    mask = torch.ones_like(bucket, dtype=torch.bool)
    for o, ln in zip(offsets, lengths, strict=True):
        mask[o : o + ln] = False
    assert bool((bucket[mask] == 7.0).all())
