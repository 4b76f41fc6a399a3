"""A gathered bucket's qsum group rounded where its slices lie, in its own scale, in one compiled
call (`QSum.encode_own_views` on `Slices` with `noise.Seeds`, `kernels.qsum_own_scale`): the
same payload and scale bits as the reference path (gather the slices, take the max |x|, draw
each slice's key from its own seeded generator, `QSum.encode`), and their |x|^2 on the way."""

import numpy as np
import pytest
import torch

from nfab.wire import dispatch, noise
from nfab.wire.registry import REDUCERS
from nfab.wire.slices import Slices

pytestmark = pytest.mark.skipif(not dispatch.AVAILABLE, reason="numba not installed")

LAYOUTS = [[5], [3, 0, 70], [32, 32, 64, 1, 9000, 17], [4097, 1, 8], [64] * 40]


def _bucket(lengths: list[int], seed: int, gap: int = 5) -> tuple[torch.Tensor, np.ndarray]:
    """Random slices at scattered offsets; the gaps hold values that would change every result."""
    g = torch.Generator().manual_seed(seed)
    offsets = np.cumsum([gap] + [n + gap for n in lengths[:-1]]).astype(np.int64)
    bucket = torch.full((int(offsets[-1]) + lengths[-1] + gap,), 1e30)
    for o, n in zip(offsets.tolist(), lengths, strict=True):
        bucket[o : o + n] = torch.randn(n, generator=g) * (1 + o % 7)
    return bucket, offsets


def _reference(red, bucket: torch.Tensor, offsets: np.ndarray, lengths: list[int], world_size: int,
               seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The path every other device takes: gathered copy, max |x|, one generator per slice."""
    x = torch.cat([bucket[o : o + n] for o, n in zip(offsets.tolist(), lengths, strict=True)])
    with dispatch.host_paths(False):
        own = red.local_scale(x, lengths)
        enc = red.encode(x, lengths, world_size, own, [torch.Generator().manual_seed(s) for s in seeds])
    return enc.payload, own


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_own_scale_in_place_is_the_reference(world_size, lengths):
    red = REDUCERS["qsum-q8"]
    bucket, offsets = _bucket(lengths, seed=world_size * 31 + len(lengths))
    zero_at = int(offsets[0])
    bucket[zero_at : zero_at + lengths[0]] = 0.0  # an all-zero slice rounds in scale 1 (the reference's where)
    if lengths[0] > 1:
        bucket[zero_at] = -0.0
    seeds = [(7919 * i + world_size) & 0x7FFF_FFFF_FFFF for i in range(len(lengths))]
    before = bucket.clone()
    enc, own = red.encode_own_views(Slices(bucket, offsets, lengths), lengths, world_size,
                                    noise.Seeds(np.array(seeds, dtype=np.uint64)), with_sq=True)
    payload, expected_own = _reference(red, bucket, offsets, lengths, world_size, seeds)
    assert torch.equal(enc.payload, payload)
    assert torch.equal(own.view(torch.int32), expected_own.view(torch.int32))
    assert torch.equal(bucket, before)  # read where they lie, nothing written
    x = torch.cat([bucket[o : o + n] for o, n in zip(offsets.tolist(), lengths, strict=True)]).double()
    assert enc.sq is not None and enc.sq.dtype == torch.float32 and enc.sq.dim() == 0
    assert float(enc.sq) == pytest.approx(float((x * x).sum()), rel=1e-5)
    # this rank's own decode (error feedback's `local`) is what its levels mean
    assert torch.allclose(enc.local, x.float(), atol=float(own.max()) * 2 / red.max_level(world_size) + 1e-6)


def test_own_scale_shows_nan_and_inf():
    red = REDUCERS["qsum-q8"]
    lengths = [10, 10, 10]
    bucket, offsets = _bucket(lengths, seed=3)
    bucket[int(offsets[0]) + 4] = float("nan")
    bucket[int(offsets[2]) + 1] = float("-inf")
    seeds = [1, 2, 3]
    enc, own = red.encode_own_views(Slices(bucket, offsets, lengths), lengths, 2,
                                    noise.Seeds(np.array(seeds, dtype=np.uint64)), with_sq=True)
    payload, expected_own = _reference(red, bucket, offsets, lengths, 2, seeds)
    assert torch.equal(enc.payload, payload)
    assert torch.isnan(own[0]) and torch.isnan(expected_own[0])
    assert torch.equal(own[1:], expected_own[1:]) and own[2] == float("inf")
    assert not torch.isfinite(enc.sq)  # the bucket's non-finite flag rides on its |g|^2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_gather_and_give_the_reference(dtype):
    """No compiled own-scale pass for half inputs: the gathered path, the same bits, no |x|^2."""
    red = REDUCERS["qsum-q8"]
    lengths = [33, 7]
    bucket, offsets = _bucket(lengths, seed=5)
    bucket = bucket.clamp(-100, 100).to(dtype)
    seeds = [11, 12]
    assert not red.reads_sq(bucket)
    enc, own = red.encode_own_views(Slices(bucket, offsets, lengths), lengths, 2,
                                    noise.Seeds(np.array(seeds, dtype=np.uint64)))
    payload, expected_own = _reference(red, bucket, offsets, lengths, 2, seeds)
    assert torch.equal(enc.payload, payload) and torch.equal(own, expected_own) and enc.sq is None


def test_seeds_stand_for_their_generators():
    seeds = [0, 1, 2**32 - 1, 2**32, 2**47 - 1, 123456789]
    keys = noise.draw_keys(noise.Seeds(np.array(seeds, dtype=np.uint64)), len(seeds), torch.device("cpu"))
    expected = noise.draw_keys([torch.Generator().manual_seed(s) for s in seeds], len(seeds), torch.device("cpu"))
    assert torch.equal(keys, expected)


def test_only_exact_qsum_reads_its_own_square():
    fp32 = torch.zeros(8)
    assert REDUCERS["qsum-q8"].reads_sq(fp32)
    assert not REDUCERS["qsum-q4"].reads_sq(fp32)  # lane-packed: the gathered path
    with dispatch.host_paths(False):
        assert not REDUCERS["qsum-q8"].reads_sq(fp32)
