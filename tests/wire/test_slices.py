"""A group's slices decoded or encoded where they lie in the bucket, in one compiled call
(`Slices`, `host_slices.slices_span`): the same bits as the torch reference writing each slice
through its own view, and nothing outside the slices touched."""

import numpy as np
import pytest
import torch

from nfab.wire import dispatch, host_slices
from nfab.wire.registry import REDUCERS
from nfab.wire.slices import Slices

pytestmark = pytest.mark.skipif(not dispatch.AVAILABLE, reason="numba not installed")

LAYOUTS = [[5], [3, 0, 70], [32, 32, 64, 1, 9000, 17], [4097, 1, 8]]


def _bucket(lengths: list[int], gap: int = 3) -> tuple[torch.Tensor, np.ndarray]:
    """A bucket with the slices at scattered offsets (gaps between them) and sentinel values."""
    offsets = np.cumsum([gap] + [n + gap for n in lengths[:-1]]).astype(np.int64)
    return torch.full((int(offsets[-1]) + lengths[-1] + gap,), 7.0), offsets


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("lengths", LAYOUTS)
@pytest.mark.parametrize("as_slices", [True, False])
def test_gathered_q8_into_slices_is_the_reference(world_size, lengths, as_slices):
    red = REDUCERS["qsum-q8"]
    g = torch.Generator().manual_seed(world_size * 7 + len(lengths))
    n = sum(lengths)
    rows = torch.randint(0, 256, (world_size, n), dtype=torch.uint8, generator=g)
    scales = torch.rand(world_size, len(lengths), generator=g) * 3
    with dispatch.host_paths(False):  # the torch reference every other device runs
        expected = red.decode_gathered(list(rows), scales, n, lengths, torch.zeros(n))
    bucket, offsets = _bucket(lengths)
    out = Slices(bucket, offsets, lengths)
    red.decode_gathered(rows, scales, n, lengths, out if as_slices else list(out))
    got = torch.cat([bucket[o : o + k] for o, k in zip(offsets.tolist(), lengths, strict=True)])
    assert torch.equal(_bits(got), _bits(expected))
    mask = torch.ones_like(bucket, dtype=torch.bool)
    for o, k in zip(offsets.tolist(), lengths, strict=True):
        mask[o : o + k] = False
    assert bool((bucket[mask] == 7.0).all())  # the gaps between slices are untouched


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_signgather_through_slices_is_the_reference(world_size, lengths):
    """Encode from the bucket's slices and decode into them, vs the reference on gathered copies."""
    red = REDUCERS["signgather"]
    g = torch.Generator().manual_seed(world_size + 100 * len(lengths))
    n = sum(lengths)
    payloads, scales, refs = [], [], []
    for _ in range(world_size):
        bucket, offsets = _bucket(lengths)
        for o, k in zip(offsets.tolist(), lengths, strict=True):
            bucket[o : o + k] = torch.randn(k, generator=g)
        flat = torch.cat([bucket[o : o + k] for o, k in zip(offsets.tolist(), lengths, strict=True)])
        enc = red.encode_views(Slices(bucket, offsets, lengths), lengths, world_size)
        ref = red.encode(flat, lengths, world_size)  # one contiguous copy, segment by segment
        assert torch.equal(enc.payload, ref.payload) and torch.equal(enc.scales, ref.scales)
        with dispatch.host_paths(False):  # the torch reference: same votes, the mean |x| to rounding
            torch_ref = red.encode(flat, lengths, world_size)
        assert torch.equal(enc.payload, torch_ref.payload) and torch.allclose(enc.scales, torch_ref.scales)
        payloads.append(enc.payload)
        scales.append(enc.scales)
        refs.append(ref)
    reduced = red.combine(payloads)
    scale_mean = torch.stack(scales).mean(0)
    with dispatch.host_paths(False):
        expected = red.decode(reduced, scale_mean, n, lengths, world_size)
    bucket, offsets = _bucket(lengths)
    red.decode(reduced, scale_mean, n, lengths, world_size, out=Slices(bucket, offsets, lengths))
    got = torch.cat([bucket[o : o + k] for o, k in zip(offsets.tolist(), lengths, strict=True)])
    assert torch.equal(_bits(got), _bits(expected))
    assert float(bucket[0]) == 7.0 and float(bucket[-1]) == 7.0


def test_only_slices_span_a_bucket():
    """A plain list of views is never spanned (it goes view by view: the reference bits, as the
    as_slices=False cases above check); `Slices` on the host give their bucket and offsets."""
    a, b = torch.zeros(10), torch.zeros(10)
    assert host_slices.slices_span([a[2:4], b[0:3]]) is None
    assert host_slices.slices_span([a[6:9], a[1:3]]) is None
    offsets = np.array([6, 1], dtype=np.int64)
    span, at = host_slices.slices_span(Slices(a, offsets, [3, 2]))
    assert span is a and at is offsets
    with dispatch.host_paths(False):
        assert host_slices.slices_span(Slices(a, offsets, [3, 2])) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_sign_encode_takes_the_slices_sq_on_its_read(dtype, lengths):
    """`with_sq`: the x^2 sum of everything encoded (the bucket's norm share the hook leaves to
    the sign encoder), the same votes as without it; a NaN or inf in a slice shows in it."""
    red = REDUCERS["signgather"]
    bucket, offsets = _bucket(lengths)
    bucket = torch.randn(bucket.numel(), generator=torch.Generator().manual_seed(len(lengths))).to(dtype)
    sl = Slices(bucket, offsets, lengths)
    flat = torch.cat(list(sl)).double()
    assert red.reads_sq(bucket)
    enc = red.encode_views(sl, lengths, 2, with_sq=True)
    plain = red.encode_views(sl, lengths, 2)
    assert plain.sq is None and torch.equal(enc.payload, plain.payload)
    assert enc.sq.dtype == torch.float32 and float(enc.sq) == pytest.approx(float(flat.square().sum()), rel=1e-5)
    for bad in (float("nan"), float("inf")):
        hit = bucket.clone()
        hit[int(offsets[-1]) + lengths[-1] - 1] = bad
        sq = red.encode_views(Slices(hit, offsets, lengths), lengths, 2, with_sq=True).sq
        assert not bool(torch.isfinite(sq))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_gather_is_the_concatenation_of_the_views(dtype, lengths):
    bucket, offsets = _bucket(lengths)
    bucket = torch.randn(bucket.numel(), generator=torch.Generator().manual_seed(3)).to(dtype)
    bucket[int(offsets[0])] = float("nan")
    sl = Slices(bucket, offsets, lengths)
    got = host_slices.gather(sl)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), torch.cat(list(sl)).view(torch.uint8))
    with dispatch.host_paths(False):
        assert host_slices.gather(sl) is None  # off the host: the caller concatenates views


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_slices_sq_reads_the_slices_where_they_lie(lengths):
    """The norm pass's remainder beside sign groups: the slices' x^2 sum without a gathered
    copy; a NaN or inf in a slice shows in it, values between the slices never count."""
    bucket, offsets = _bucket(lengths)
    bucket = torch.randn(bucket.numel(), generator=torch.Generator().manual_seed(7))
    sl = Slices(bucket, offsets, lengths)
    expected = float(torch.cat(list(sl)).double().square().sum())
    assert float(host_slices.slices_sq(sl)) == pytest.approx(expected, rel=1e-5)
    for bad in (float("nan"), float("inf")):
        hit = bucket.clone()
        hit[int(offsets[-1]) + lengths[-1] - 1] = bad
        assert not bool(torch.isfinite(host_slices.slices_sq(Slices(hit, offsets, lengths))))
    gap = bucket.clone()
    gap[int(offsets[0]) - 1] = float("nan")  # between slices: not part of any
    assert float(host_slices.slices_sq(Slices(gap, offsets, lengths))) == pytest.approx(expected, rel=1e-5)
    assert host_slices.slices_sq(Slices(bucket.to(torch.bfloat16), offsets, lengths)) is None  # fp32 only
    with dispatch.host_paths(False):
        assert host_slices.slices_sq(sl) is None
