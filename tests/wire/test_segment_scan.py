"""`segments.scan_abs_sums`: every segment's sum |x| in a fixed number of kernels (the torch path's
many-segment buckets), against float64 sums segment by segment."""

from __future__ import annotations

import pytest
import torch

from nfab.wire import dispatch, segments

ROW = segments._SCAN_ROW
LAYOUTS = [
    [5, 17, 0, 1, 40, 9, 3, 2, 11, 0],  # many small segments in one row, empty ones among them
    [ROW - 3, 7, 2 * ROW, 1, ROW + 5, 0, 300, 13, 5, 8],  # segments across row boundaries, one of whole rows
    [ROW, ROW, 3 * ROW, 1, 1, 1, 1, 1, 1, 1],  # row-aligned starts and ends
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", LAYOUTS)
def test_scan_sums_are_float64_sums_segment_by_segment(lengths, dtype):
    g = torch.Generator().manual_seed(len(lengths))
    x = (torch.randn(sum(lengths), generator=g) * torch.exp2(torch.randint(-12, 12, (sum(lengths),), generator=g))
         ).to(dtype)  # magnitudes over 24 octaves
    got = segments.scan_abs_sums(x, lengths)
    want = torch.stack([p.double().abs().sum() for p in torch.split(x, lengths)])
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    assert torch.equal(got, segments.scan_abs_sums(x, lengths))  # a fixed order: the same bits again


def test_many_segments_on_the_torch_path_agree_with_the_host_path():
    lengths = LAYOUTS[1]
    x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(1))
    with dispatch.host_paths(False):
        device_path = segments.segment_mean_abs(x, lengths)
    with dispatch.host_paths(True):
        host = segments.segment_mean_abs(x, lengths)
    assert torch.allclose(device_path, host, rtol=2e-7, atol=0)
