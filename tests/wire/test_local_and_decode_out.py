"""Sign encoders keep their own decode lazily, signgather decodes counted votes, `decode(out=)` matches."""

import pytest
import torch

from nfab.wire import segments
from nfab.wire.qsum.lanes import layout_for, pack
from nfab.wire.registry import REDUCERS, Encoded
from nfab.wire.sign import codec as sign_codec

SHAPES = [
    (1, [1]),
    (7, [7]),
    (21, [10, 0, 11]),
    (1001, [400, 601]),
    (70_001, [3, 0, 69_990, 8]),  # crosses the chunk boundary, empty segment
    (200_003, [200_003]),
]


@pytest.mark.parametrize("name", ["signcount", "signgather"])
@pytest.mark.parametrize("world_size", [1, 2, 4, 5, 16])
@pytest.mark.parametrize("numel,lengths", SHAPES)
def test_sign_encode_local_is_lazy_and_exact(name, world_size, numel, lengths):
    red = REDUCERS[name]
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    enc = red.encode(x, lengths, world_size)
    assert enc._local is None  # nothing computed until asked for
    payload = enc.payload.clone()
    enc.payload.fill_(0)  # an in-place collective must not change this rank's own decode
    assert torch.equal(enc.local, sign_codec.sign_values(x >= 0, enc.scales, lengths))
    assert enc.local is enc.local
    ref = segments.segment_mean_abs(x, lengths)
    assert torch.allclose(enc.scales, ref, rtol=1e-5)
    layout = red.layout(world_size) if name == "signcount" else layout_for(1)
    assert torch.equal(payload, pack(x >= 0, layout))


@pytest.mark.parametrize("bits,world_size", [(8, 2), (8, 4), (4, 2), (2, 1)])
@pytest.mark.parametrize("numel,lengths", SHAPES)
def test_qsum_local_read_before_launch_is_exact(bits, world_size, numel, lengths):
    """qsum's own decode, read before its payload is launched (as the hook and the two-level path
    do), is the reference's levels decoded, and stays what was read once an in-place collective
    has written the payload (one-lane q8's payload is its levels: no second copy to read later)."""
    red = REDUCERS[f"qsum-q{bits}"]
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g)
    shared = segments.segment_max_abs(x, lengths)
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (len(lengths),), generator=g, dtype=torch.int64)
    enc = red.encode(x, lengths, world_size, shared, keys)
    local = enc.local
    m = red.max_level(world_size)
    safe = torch.where(shared > 0, shared, torch.ones_like(shared))
    ref_levels, ref_payload = red._levels_reference(x, safe, lengths, m, keys)
    assert torch.equal(enc.payload, ref_payload)
    want = red.level_values(world_size, 1, x.device)[ref_levels.long()]
    want = want * torch.repeat_interleave(shared, torch.tensor(lengths), output_size=numel)
    enc.payload.fill_(0)  # what an in-place SUM all-reduce does to it
    assert torch.equal(enc.local, local) and torch.allclose(local, want, rtol=0, atol=0)


def test_encoded_keeps_plain_local():
    t = torch.ones(3)
    enc = Encoded(t, None, t)
    assert enc.local is t
    assert Encoded(t, None).local is None


@pytest.mark.parametrize("vote", ["majority", "mean"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 8, 15, 16])
@pytest.mark.parametrize("numel,lengths", [(1, [1]), (13, [13]), (1001, [400, 601]), (600_001, [600_000, 1])])
def test_signgather_decode_matches_counted_votes(vote, world_size, numel, lengths):
    from nfab.wire.registry import SignGather

    red = SignGather(vote)
    g = torch.Generator().manual_seed(world_size * 31 + numel)
    votes = [torch.randint(0, 2, (numel,), generator=g).bool() for _ in range(world_size)]
    reduced = torch.cat([pack(v, layout_for(1)) for v in votes])
    scales = torch.rand(len(lengths), generator=g) + 0.5
    counts = torch.stack(votes).long().sum(0)
    expected = sign_codec.vote_table(world_size, vote)[counts] * torch.repeat_interleave(scales, torch.tensor(lengths))
    got = red.decode(reduced, scales, numel, lengths, world_size)
    assert torch.equal(got, expected)
    out = torch.full((numel,), 7.0)
    assert red.decode(reduced, scales, numel, lengths, world_size, out=out) is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name", ["allreduce-fp32", "allreduce-bf16", "signcount", "signgather", "qsum-q4", "qsum-q2"])
@pytest.mark.parametrize("numel,lengths", [(5, [5]), (1001, [400, 601]), (4099, [4099])])
def test_decode_into_out_matches(name, numel, lengths):
    red = REDUCERS[name]
    w = 4 if red.capacity(4).ok else 2
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(w)]
    shared = torch.stack([red.local_scale(x, lengths) for x in xs]).amax(0) if red.needs_shared_scale else None
    encs = [red.encode(x, lengths, w, shared, torch.Generator().manual_seed(9)) for x in xs]
    reduced = red.combine([e.payload for e in encs])
    scale = shared if shared is not None else (
        torch.stack([e.scales for e in encs]).mean(0) if encs[0].scales is not None else None)
    ref = red.decode(reduced.clone(), scale, numel, lengths, w)
    buf = torch.full((numel + 3,), 5.0)
    out = buf[1 : 1 + numel]
    assert red.decode(reduced.clone(), scale, numel, lengths, w, out=out) is out
    assert torch.equal(out, ref)
    assert buf[0] == 5.0 and torch.all(buf[1 + numel :] == 5.0)


@pytest.mark.parametrize("lengths", [[1], [13], [5, 17, 1, 40, 9], [70000, 3, 66000]])
def test_signgather_encode_from_views_matches_encode_of_the_copy(lengths):
    """A mixed bucket's sign slices are encoded where they lie: same payload, scales and local."""
    from nfab.wire.registry import REDUCERS

    red = REDUCERS["signgather"]
    g = torch.Generator().manual_seed(sum(lengths))
    bucket = torch.randn(sum(lengths) + 3 * len(lengths) + 5, generator=g)
    bucket[4] = -0.0
    views, at = [], 2
    for ln in lengths:
        views.append(bucket[at : at + ln])
        at += ln + 3
    a = red.encode_views(views, lengths, 2)
    b = red.encode(torch.cat(views), lengths, 2)
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
    assert torch.equal(a.local, b.local)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_qsum_decode_gathered_is_the_mean_of_each_ranks_own_decode(bits, world_size):
    """Gathered qsum rows (each rank's own scales) decode to the rank-order mean of what each
    rank's encoding stands for on its own, and never clip."""
    red = REDUCERS[f"qsum-q{bits}"]
    if not red.capacity(world_size).ok:
        pytest.skip("over capacity")
    lengths = [7, 1, 30]
    g = torch.Generator().manual_seed(bits * 10 + world_size)
    xs = [torch.randn(sum(lengths), generator=g) * (r + 1) for r in range(world_size)]
    own = [red.local_scale(x, lengths) for x in xs]
    encs = [red.encode(x, lengths, world_size, s, torch.Generator().manual_seed(r))
            for r, (x, s) in enumerate(zip(xs, own, strict=True))]
    got = red.decode_gathered([e.payload for e in encs], torch.stack(own), sum(lengths), lengths)
    ref = encs[0].local.clone()
    for e in encs[1:]:
        ref += e.local
    assert torch.equal(got, ref.mul_(1.0 / world_size))
    step = max(float(s.max()) for s in own) * 2 / red.max_level(world_size)
    assert float((got - torch.stack(xs).mean(0)).abs().max()) <= step * (1 + 1e-6)
