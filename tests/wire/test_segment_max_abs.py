"""segments.segment_max_abs: the one-pass path for many segments gives the loop's bits."""

import pytest
import torch

from nfab.wire import dispatch, host_slices, segments


def test_segment_max_abs_many_segments_matches_one_by_one():
    x = torch.randn(1000)
    lengths = [0, 3, 50, 1, 200, 0, 46, 300, 100, 100, 200]
    many = segments.segment_max_abs(x, lengths)
    one = torch.stack([p.abs().max() if p.numel() else torch.zeros(()) for p in torch.split(x, lengths)])
    assert torch.equal(many, one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", [[1], [5000], [3, 0, 100, 4097]])
def test_compiled_segment_max_abs_matches_torch_for_every_input_dtype(dtype, lengths):
    """The compiled integer pass (CPU) against torch's abs().max(), with an inf and a NaN."""
    if not dispatch.AVAILABLE:
        pytest.skip("numba not installed")
    x = (torch.randn(sum(lengths), generator=torch.Generator().manual_seed(sum(lengths))) * 100).to(dtype)
    if x.numel() > 10:
        x[7] = -float("inf")
    want = torch.stack([p.abs().max().float() if p.numel() else torch.zeros(()) for p in torch.split(x, lengths)])
    assert torch.equal(host_slices.segment_max_abs(x, lengths), want)
    if x.numel() > 10:
        x[9] = float("nan")
        seg = 0 if len(lengths) == 1 else 2  # element 9 lies in segment 2 of [3, 0, 100, 4097]
        assert torch.isnan(host_slices.segment_max_abs(x, lengths)[seg])
