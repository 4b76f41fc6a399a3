"""Counter-based rounding noise: the compiled kernel, the torch reference and plain Python agree
bit for bit; the noise is uniform; qsum's stochastic rounding stays unbiased."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nfab.wire import dispatch, host_slices, noise, segments
from nfab.wire.qsum import host as qsum_host
from nfab.wire.registry import REDUCERS

pytestmark = pytest.mark.skipif(not dispatch.AVAILABLE, reason="compiled kernels unavailable")

SHAPES = [[1], [7], [4097], [3, 1, 4096, 4097, 5], [0, 9, 0, 13], [8193]]


def test_torch_reference_is_the_python_definition():
    keys = torch.tensor([0, -1, 123456789012345, -(1 << 63)], dtype=torch.int64)
    lengths = [3, 5, 2, 4]
    u = noise.uniform(keys, lengths)
    want, pos = [], 0
    for k, n in zip(keys.tolist(), lengths, strict=True):
        want += [noise.uniform_scalar(k, i) for i in range(n)]
        pos += n
    assert u.dtype == torch.float32 and u.tolist() == want
    assert noise.uniform_scalar(0, 0) == (0x01FCE552 >> 8) * 2.0**-24  # lowbias32(0x9E3779B9), worked by hand
    # the key's high half enters by xor: key = 2**32 * 0x9E3779B9 hashes c = 0x9E3779B9 ^ 0x9E3779B9 = 0,
    # and lowbias32(0) = 0
    assert noise.uniform_scalar(0x9E3779B9 << 32, 0) == 0.0


def test_int32_hash_is_the_python_definition_on_both_layouts():
    """`uniform` hashes in int32 lanes: a slice per segment up to `_FEW_SEGMENTS` segments, one
    gather past them; both with a stratum's shift, against the plain-integer statement."""
    g = torch.Generator().manual_seed(3)
    for count in (noise._FEW_SEGMENTS, noise._FEW_SEGMENTS + 5):
        keys = torch.randint(-(1 << 63), (1 << 63) - 1, (count,), generator=g, dtype=torch.int64)
        lengths = torch.randint(0, 40, (count,), generator=g).tolist()
        shift = (1 << 24) - 7
        want = [noise.uniform_scalar(k, i, shift) for k, n in zip(keys.tolist(), lengths, strict=True)
                for i in range(n)]
        assert noise.uniform(keys, lengths, shift).tolist() == want


@pytest.mark.parametrize("lengths", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,world_size", [(8, 2), (8, 3), (4, 2), (2, 1)])
def test_compiled_levels_equal_reference(lengths, dtype, bits, world_size):
    red = REDUCERS[f"qsum-q{bits}"]
    n = sum(lengths)
    g = torch.Generator().manual_seed(n + bits)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    if n > 5:
        x[5] = 0.0
    scale = torch.rand(len(lengths), generator=g) * 4 + 0.1  # some elements saturate
    keys = noise.draw_keys(torch.Generator().manual_seed(1), len(lengths), torch.device("cpu"))
    m = red.max_level(world_size)
    levels, payload = qsum_host.qsum_levels(x, keys, scale, lengths, m, red._layout)
    ref_levels, ref_payload = red._levels_reference(x, scale, lengths, m, keys)
    assert torch.equal(levels, ref_levels) and torch.equal(payload, ref_payload)


@pytest.mark.parametrize("lengths", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_max_abs_equals_torch(lengths, dtype):
    n = sum(lengths)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    if n > 4:
        x[n // 2] = -50.0  # the max is a negative element
    got = host_slices.segment_max_abs(x, lengths)
    want = torch.stack([p.abs().max().to(torch.float32) if p.numel() else torch.zeros(())
                        for p in torch.split(x, lengths)])
    assert torch.equal(got, want)
    assert torch.equal(segments.segment_max_abs(x, lengths), want)


def test_max_abs_propagates_nan_and_inf():
    x = torch.tensor([1.0, float("nan"), -2.0, float("-inf"), 3.0])
    got = host_slices.segment_max_abs(x, [3, 2])
    assert torch.isnan(got[0]) and got[1] == float("inf")


def test_noise_is_uniform_without_lattice():
    """Mean 1/2, flat over 256 bins (chi-square), and flat in the low bits too (a lattice or a
    short period shows up there), on consecutive indices of one key."""
    u = noise.uniform(torch.tensor([42], dtype=torch.int64), [1 << 18]).double()
    assert abs(u.mean().item() - 0.5) < 3 * (1 / 12) ** 0.5 / (1 << 9)
    assert u.min() >= 0 and u.max() < 1
    crit = 256 + 5 * (2 * 255) ** 0.5  # ~5 sigma above the chi-square mean, 255 dof
    for scaled in (u * 256, (u * (1 << 24)) % 256):  # high bits, low bits
        counts = torch.bincount(scaled.long(), minlength=256).double()
        expect = u.numel() / 256
        assert ((counts - expect) ** 2 / expect).sum().item() < crit
    pairs = (u[0::2] * 16).long() * 16 + (u[1::2] * 16).long()  # neighbours jointly flat
    counts = torch.bincount(pairs, minlength=256).double()
    expect = pairs.numel() / 256
    assert ((counts - expect) ** 2 / expect).sum().item() < crit


def test_keys_differ_per_generator_and_streams_are_uncorrelated():
    a = noise.uniform(noise.draw_keys([torch.Generator().manual_seed(0)], 1, torch.device("cpu")), [1 << 16])
    b = noise.uniform(noise.draw_keys([torch.Generator().manual_seed(1)], 1, torch.device("cpu")), [1 << 16])
    assert not torch.equal(a, b)
    corr = np.corrcoef(a.numpy(), b.numpy())[0, 1]
    assert abs(corr) < 5 / (1 << 8)


def test_stochastic_rounding_is_unbiased_over_seeds():
    red = REDUCERS["qsum-q4"]
    w = 2
    x = torch.linspace(-1, 1, 257)
    shared = segments.segment_max_abs(x, [257])
    seeds = 400
    total = torch.zeros_like(x, dtype=torch.float64)
    for seed in range(seeds):
        enc = red.encode(x, [257], w, shared, torch.Generator().manual_seed(seed))
        total += enc.local.double()
    mean = total / seeds
    step = 2.0 / red.max_level(w)  # one level in units of the scale (scale = 1)
    # per element the decoded value has sd <= step/2: the mean over seeds is within 5 sd/sqrt(seeds)
    assert (mean - x.double()).abs().max().item() < 5 * (step / 2) / seeds**0.5
    assert abs((mean - x.double()).mean().item()) < (step / 2) / (seeds * 257) ** 0.5 * 5


def test_seeded_keys_are_the_generators_first_draws():
    """Keys computed from the seeds are the bits a CPU generator per seed draws (MT19937 on the
    seed's low 32 bits, its first two outputs): seeds of the hook's 47-bit schedule and edges."""
    g = torch.Generator().manual_seed(5)
    seeds = [0, 1, 5489, 2**31, 2**32 - 1, 2**32, 2**47 - 1] + torch.randint(0, 2**47, (200,), generator=g).tolist()
    drawn = noise.draw_keys([torch.Generator().manual_seed(s) for s in seeds], len(seeds), torch.device("cpu"))
    assert torch.equal(noise.seeded_keys(seeds), drawn)
    assert torch.equal(noise.draw_keys(drawn, len(seeds), torch.device("cpu")), drawn)  # keys pass through
