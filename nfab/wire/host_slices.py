"""Host adapters shared by every codec's compiled path: segment bounds, slices read where they
lie in a bucket (gather, x^2), max |x| per segment, and where a decode writes.

Tensors in, `shared_kernels` on their memory. The `*_here` functions and `segment_max_abs` are
`segments.HostSegmentOps`' (run only where `nfab.wire.dispatch` chose the host); each checks
only what its kernel reads (1-D contiguous memory, a dtype) and returns None otherwise. `gather`,
`concat`, `slices_sq`, `slices_span` and `targets` ask the device's segment ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from nfab.wire import dispatch
from nfab.wire.slices import Slices

try:
    from nfab.wire import shared_kernels
except ImportError:  # numba missing: `dispatch.AVAILABLE` is False and nothing here is called
    shared_kernels = None  # type: ignore[assignment]

HALF = {torch.bfloat16: True, torch.float16: False}
"""The half dtypes the kernels read as raw uint16 bits: True for bf16, False for fp16."""
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The input dtypes the compiled encoders read as they are (no fp32 copy)."""


def segment_bounds(lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets (int64) of the concatenated segments, for the kernels (read-only:
    made once per layout)."""
    return _segment_bounds(tuple(lengths))


@lru_cache(maxsize=256)
def _segment_bounds(lengths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    starts = ends - np.asarray(lengths, dtype=np.int64)
    starts.flags.writeable = ends.flags.writeable = False  # shared by every caller of this layout
    return starts, ends


def sq_total(sqs: np.ndarray) -> torch.Tensor:
    """The segments' float64 x^2 sums as one 0-d fp32 tensor (an encoder's |x|^2 share)."""
    return torch.from_numpy(np.array(sqs.sum(), dtype=np.float32))


_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def flat_float(x: torch.Tensor) -> bool:
    """Whether the compiled encoders read `x` as it is: 1-D, contiguous, fp32/bf16/fp16."""
    return x.dim() == 1 and x.is_contiguous() and x.dtype in FLOAT_DTYPES


def gather(slices: Slices) -> torch.Tensor | None:
    """The slices' values as one new contiguous tensor (`torch.cat` of their views) in one
    compiled copy, without making a view per slice; None off the host."""
    return _ops(slices.buffer.device).gather(slices)


def gather_here(slices: Slices) -> torch.Tensor | None:
    """`gather` on the host: None unless the bucket is 1-D and contiguous."""
    b = slices.buffer
    if not (b.is_contiguous() and b.dim() == 1 and b.element_size() in _BITS):
        return None
    assert shared_kernels is not None
    lengths = np.asarray(slices.lengths, dtype=np.int64)
    out = torch.empty(int(lengths.sum()), dtype=b.dtype, device=b.device)  # the host: named, not the default
    bits = _BITS[b.element_size()]
    shared_kernels.gather_segments(b.view(torch.uint8).numpy().view(bits), slices.offsets, lengths,
                                   out.view(torch.uint8).numpy().view(bits))
    return out


def concat(slices: Slices) -> torch.Tensor:
    """The slices' values as one new tensor: `gather` on the host, `torch.cat` of their views
    elsewhere (the same values)."""
    out = gather(slices)
    return out if out is not None else torch.cat(slices.views())


def slices_sq(slices: Slices) -> torch.Tensor | None:
    """|x|^2 of fp32 slices (0-d fp32 on the host) read where they lie, no gathered copy; None
    when the compiled path does not apply."""
    return _ops(slices.buffer.device).slices_sq(slices)


def slices_sq_here(slices: Slices) -> torch.Tensor | None:
    """`slices_sq` on the host: None unless the bucket is 1-D, contiguous fp32."""
    b = slices.buffer
    if not (b.is_contiguous() and b.dim() == 1 and b.dtype == torch.float32):
        return None
    assert shared_kernels is not None
    tot = shared_kernels.segments_sq(b.numpy(), slices.offsets, np.asarray(slices.lengths, dtype=np.int64))
    return torch.from_numpy(np.array(tot, dtype=np.float32))


def slices_span(views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray] | None:
    """(bucket, element offsets) of `Slices` on the host, for one kernel call over all of them
    where they lie; None for anything else (a plain list of tensors goes view by view)."""
    if isinstance(views, Slices):
        return _ops(views.buffer.device).span(views)
    return None


def span_here(views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray] | None:
    """`slices_span` on the host."""
    if isinstance(views, Slices) and views.buffer.is_contiguous() and views.buffer.dim() == 1:
        return views.buffer, views.offsets
    return None


def targets(out: torch.Tensor | Sequence[torch.Tensor],
            lengths: Sequence[int]) -> tuple[torch.Tensor, np.ndarray] | None:
    """Where a decode writes: one fp32 host tensor and each segment's offset in it (`out` one
    tensor of all segments, or `Slices`); None otherwise (per-segment destinations). The
    host's: called only where `dispatch` chose it."""
    if isinstance(out, torch.Tensor):
        span = (out.reshape(-1), segment_bounds(lengths)[0]) if out.is_contiguous() else None
    else:
        span = span_here(out)
    return span if span is not None and span[0].dtype == torch.float32 else None


def as_f32(t: torch.Tensor) -> np.ndarray:
    """A host tensor's values as a float32 numpy array, strides and all (no copy when already fp32)."""
    return (t if t.dtype == torch.float32 else t.to(torch.float32)).numpy()


def segment_max_abs(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """max |x| per segment (fp32) in one compiled integer pass over fp32/bf16/fp16 `x` (1-D, CPU).

    A NaN in a segment gives NaN (as torch's max does); its payload is whichever NaN had the
    largest bits, so compare NaNs by isnan, not by bits.
    """
    assert shared_kernels is not None
    starts, ends = segment_bounds(lengths)
    if x.dtype == torch.float32:
        out = np.empty(len(starts), dtype=np.uint32)
        shared_kernels.segment_max_abs_bits(x.view(torch.int32).numpy().view(np.uint32), np.uint32(0x7FFFFFFF),
                                            starts, ends, out)
        return torch.from_numpy(out.view(np.float32))
    half = np.empty(len(starts), dtype=np.uint16)
    shared_kernels.segment_max_abs_bits(x.view(torch.int16).numpy().view(np.uint16), np.uint16(0x7FFF), starts, ends,
                                        half)
    return torch.from_numpy(half.view(np.int16)).view(x.dtype).to(torch.float32)  # widening is exact


class SliceOps:
    """Slices read where they lie in their bucket, in one compiled call: none off the host (None)."""

    def gather(self, slices: Slices) -> torch.Tensor | None:
        return None

    def slices_sq(self, slices: Slices) -> torch.Tensor | None:
        return None

    def span(self, slices: Slices) -> tuple[torch.Tensor, np.ndarray] | None:
        return None


class HostSliceOps(SliceOps):
    """The compiled reads of the host."""

    def gather(self, slices: Slices) -> torch.Tensor | None:
        return gather_here(slices)

    def slices_sq(self, slices: Slices) -> torch.Tensor | None:
        return slices_sq_here(slices)

    def span(self, slices: Slices) -> tuple[torch.Tensor, np.ndarray] | None:
        return span_here(slices)


def _ops(device: torch.device) -> SliceOps:
    return dispatch.ops(device, SliceOps, HostSliceOps)
