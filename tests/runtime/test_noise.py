"""qsum rounding noise: uniform, keyed per parameter, independent of the slices beside it."""

import torch

from nfab.runtime import noise
from nfab.wire import codecs


def test_noise_is_uniform_and_layout_independent():
    keys = [noise.slice_key(0, r, 5, p) for r in (0, 1) for p in (3, 7)]
    lengths = [100, noise.SMALL_SLICE + 5, 4000, 37]
    together = noise.group_noise(keys, lengths, torch.device("cpu"))
    alone = torch.cat([noise.group_noise([k], [n], torch.device("cpu")) for k, n in zip(keys, lengths, strict=True)])
    assert torch.equal(together, alone)  # a slice's noise does not depend on its neighbours
    assert together.dtype == torch.float32 and together.numel() == sum(lengths)
    assert float(together.min()) >= 0.0 and float(together.max()) < 1.0
    small = noise.group_noise([keys[0]], [1 << 13], torch.device("cpu"))
    assert abs(float(small.mean()) - 0.5) < 0.02 and abs(float(small.var()) - 1 / 12) < 0.01
    assert not torch.equal(small, noise.group_noise([keys[1]], [1 << 13], torch.device("cpu")))
    assert float((small.argsort()[1:] - small.argsort()[:-1]).abs().float().mean()) > 100  # no visible order


def test_segment_max_abs_many_segments_matches_one_by_one():
    x = torch.randn(1000)
    lengths = [0, 3, 50, 1, 200, 0, 46, 300, 100, 100, 200]
    many = codecs.segment_max_abs(x, lengths)
    one = torch.stack([p.abs().max() if p.numel() else torch.zeros(()) for p in torch.split(x, lengths)])
    assert torch.equal(many, one)
