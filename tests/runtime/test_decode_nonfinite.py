"""The non-finite check of FP32-only buckets and blockq's reference (`segments.nonfinite_sum`), element-wise checked."""

from __future__ import annotations

import math

import pytest
import torch

from nfab.wire.segments import nonfinite_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf, "both"])
def test_nonfinite_sum_matches_elementwise_check(dtype: torch.dtype, bad: object) -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).to(dtype)
    if bad == "both":  # +inf and -inf sum to NaN: still flagged
        x[17], x[9000] = math.inf, -math.inf
    elif bad is not None:
        x[4321] = bad
    want = not bool(torch.isfinite(x).all())
    assert bool(nonfinite_sum(x)) is want


def test_fp16_bucket_whose_sum_exceeds_fp16_range_is_finite() -> None:
    # every element finite, sum 2e6: an fp16 sum would overflow to inf and zero a healthy bucket
    x = torch.full((1000,), 2000.0, dtype=torch.float16)
    assert not bool(nonfinite_sum(x))


def test_nonfinite_sum_stays_on_the_device() -> None:
    with torch.device("meta"):
        flag = nonfinite_sum(torch.empty(8))
    assert flag.device.type == "meta" and flag.dtype == torch.bool and flag.dim() == 0
