"""codecs.segment_max_abs: the one-pass path for many segments gives the loop's bits."""

import torch

from nfab.wire import codecs


def test_segment_max_abs_many_segments_matches_one_by_one():
    x = torch.randn(1000)
    lengths = [0, 3, 50, 1, 200, 0, 46, 300, 100, 100, 200]
    many = codecs.segment_max_abs(x, lengths)
    one = torch.stack([p.abs().max() if p.numel() else torch.zeros(()) for p in torch.split(x, lengths)])
    assert torch.equal(many, one)
