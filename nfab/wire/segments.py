"""Per-segment helpers every codec shares: one scale per parameter slice of a bucket.

Functions over torch tensors on any device: |x| means and maxima per segment, scaling
segments in place or into their destinations, a bucket's non-finite flag. What differs by
device sits in three ops objects, chosen by `nfab.wire.dispatch.ops` from the tensor's device:
`SegmentOps` (the torch path: stays on the device and never waits for it), `ReadSegmentOps`
(the CPU: values read on the host where that is free) and `HostSegmentOps` (the CPU with the
compiled kernels of `host_slices`). Every path gives the same bits, save `segment_mean_abs`,
whose host and device sums agree to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from nfab.wire import dispatch, host_slices

_ABS_CHUNK = 1 << 16  # elements per |x| chunk: the scratch buffer stays in L2


def segment_counts(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """`lengths` as an int64 tensor on `device`, without waiting: built on the host and sent
    with a non-blocking copy (a blocking one would wait for the device; cached per layout)."""
    return _segment_counts(tuple(lengths), torch.device(device))


@lru_cache(maxsize=512)
def _segment_counts(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(lengths, dtype=torch.int64, device="cpu").to(device, non_blocking=True)


def nonfinite_sum(buffer: torch.Tensor) -> torch.Tensor:
    """True (0-d, on the buffer's device) when the buffer holds a NaN or an Inf (no host read).

    One summing pass in fp32 (an fp16 bucket's sum cannot overflow there): NaN and Inf
    propagate through a sum, so the sum is non-finite iff an element is, save a finite sum
    beyond 3.4e38, which the bucket's |g|^2 would have flagged long before. `isfinite().all()`
    and the max-norm give the same verdict at 20x the CPU (3.3-3.6 ms per million elements
    on one core against 0.18)."""
    return ~torch.isfinite(buffer.sum(dtype=torch.float32))


def segment_mean_abs(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Mean |x| over each consecutive segment of `x` (one scale per parameter slice), fp32.

    A per-parameter scale keeps a large conv kernel's magnitude from swamping a small
    one's when both ride in the same bucket. |x| is summed in float64 (the host kernels add fp32
    sums of 4096-element chunks in float64) and divided in float64 before the one rounding
    to fp32: a plain fp32 sum of millions of elements drifts in its fourth
    digit (0.12% low on 4M normal values, and by a different amount on two threads). On CPU
    |x| is read once, with no full-size temporary; elsewhere one reduction per segment (one
    scan for many). Each path's order is fixed: every rank and every replay gets the same
    bits; the paths agree to fp32 rounding.
    """
    lengths = list(lengths)
    if not lengths:
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    return ops(x.device).mean_abs(x, lengths)


def _device_mean_abs(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """`segment_mean_abs` on the device: one reduction per segment, or one scan for many."""
    sums = (scan_abs_sums(x, lengths) if len(lengths) > _MANY_SEGMENTS
            else torch.stack([abs_sum(p) for p in torch.split(x, lengths)]))
    return means(sums, lengths)


def _host_mean_abs(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """`segment_mean_abs` on the host: |x| read once in chunks, no full-size temporary."""
    buf = torch.empty(min(_ABS_CHUNK, max(x.numel(), 1)), dtype=torch.float32, device=x.device)
    sums = []
    start = 0
    for n in lengths:
        acc = torch.zeros((), dtype=torch.float64, device=x.device)
        for lo in range(start, start + n, _ABS_CHUNK):
            hi = min(lo + _ABS_CHUNK, start + n)
            part = buf[: hi - lo]
            part.copy_(x[lo:hi]).abs_()  # bf16/fp16 widen chunk by chunk, never a whole fp32 copy
            acc += part.sum(dtype=torch.float64)
        sums.append(acc)
        start += n
    return means(torch.stack(sums), lengths)


def means(sums: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Per-segment means (fp32) of float64 per-segment sums: divided in float64, rounded once
    (an empty segment divides by 1)."""
    return (sums / segment_counts([max(n, 1) for n in lengths], sums.device).to(torch.float64)).to(torch.float32)


_SCAN_ROW = 4096
"""Elements per row of `scan_abs_sums`: its prefix sums restart every row."""


def scan_abs_sums(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """sum |x| of every segment (float64, on x's device) in a fixed number of kernels, whatever the
    number of segments: a bucket's dozens of norms and biases are not one reduction each (on a GPU,
    a launch each).

    |x| is laid out in rows of `_SCAN_ROW` and prefix-summed along each row in float64, the row
    totals prefix-summed once more; a segment [a, b) is then the within-row prefix at b - 1, less
    the one just before a in a's row, plus the totals of the rows from a's up to b's (a difference
    of two row-total prefixes). Every order is fixed, so the bits are the same on every run; the
    differences cost at most a few float64 ulps of the row sums and row-total prefix involved,
    which leaves a segment's fp32 mean exact unless |x| spans ~9 orders of magnitude between it and
    the bucket before it (the index arithmetic is made once per layout, `_scan_plan`)."""
    n, dev = x.numel(), x.device
    rows = max(-(-n // _SCAN_ROW), 1)
    grid = torch.zeros(rows * _SCAN_ROW, dtype=torch.float32, device=dev)
    grid[:n] = x.reshape(-1).abs()  # bf16 / fp16 widen exactly
    within = torch.cumsum(grid.view(rows, _SCAN_ROW), 1, dtype=torch.float64)
    totals = torch.cumsum(within[:, -1], 0)
    index, take = _scan_plan(tuple(lengths), dev)
    picked = torch.stack([within.view(-1)[index[0]], within.view(-1)[index[1]], totals[index[2]], totals[index[3]]])
    return ((picked * take).sum(0) if picked.numel() else picked.new_zeros(len(lengths)))


@lru_cache(maxsize=256)
def _scan_plan(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment [a, b), what `scan_abs_sums` takes (both on `device`, sent without waiting):
    four indices (int64, (4, segments)) -- the within-row prefix at b - 1; at a - 1; the row-total
    prefix at row (b - 1) // R - 1; at row a // R - 1 -- and their signs (float64 +1 / -1, or 0
    where there is nothing to take: an empty segment, a start at a row's first element, a segment
    inside one row, the rows before row 0)."""
    index, take = [], []
    a = 0
    for n in lengths:
        b = a + n
        ra, rb = a // _SCAN_ROW, (b - 1) // _SCAN_ROW
        spans = n > 0 and rb > ra
        wanted = (n > 0, n > 0 and a % _SCAN_ROW > 0, spans, spans and ra > 0)
        at = (b - 1, a - 1, rb - 1, ra - 1)
        index.append([i if w else 0 for i, w in zip(at, wanted, strict=True)])
        take.append([s * w for s, w in zip((1.0, -1.0, 1.0, -1.0), wanted, strict=True)])
        a = b
    index_t = torch.tensor(index, dtype=torch.int64, device="cpu").reshape(-1, 4).T.contiguous()
    take_t = torch.tensor(take, dtype=torch.float64, device="cpu").reshape(-1, 4).T.contiguous()
    return index_t.to(device, non_blocking=True), take_t.to(device, non_blocking=True)


def abs_sum(part: torch.Tensor) -> torch.Tensor:
    """sum |part| as a 0-d float64 on its device, 0 for an empty part."""
    return part.abs().sum(dtype=torch.float64)


_MANY_SEGMENTS = 8


def segment_max_abs(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """max |x| over each consecutive segment of `x` (fp32; 0 for an empty segment).

    On CPU one compiled pass reads fp32/bf16/fp16 as they are (`host_slices.segment_max_abs`).
    Elsewhere many segments (a bucket's norms and biases) are reduced in one scatter pass
    instead of one reduction each. Max is order-free, so every way gives the same bits.
    """
    return ops(x.device).max_abs(x, list(lengths))


def _device_max_abs(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    if len(lengths) > _MANY_SEGMENTS:
        seg = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), segment_counts(lengths, x.device),
                                      output_size=x.numel())
        out = torch.zeros(len(lengths), dtype=torch.float32, device=x.device)
        return out.scatter_reduce_(0, seg, x.abs().to(torch.float32), "amax")
    parts = torch.split(x, lengths)
    out = torch.zeros(len(parts), dtype=torch.float32, device=x.device)
    for i, part in enumerate(parts):
        if part.numel():
            out[i] = torch.linalg.vector_norm(part, float("inf"))
    return out


def scale_segments_(x: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Multiply each segment of `x` in place by its scale; returns `x`.

    The scales stay where they are: on the host one Python float per segment (free to read
    on the CPU), elsewhere a 0-d device tensor per segment, or for many segments one
    per-element scale vector (one kernel instead of one per segment). Either way each
    element is fl(x * s) in fp32, so every path gives the same bits.
    """
    lengths = list(lengths)
    flat = scales.reshape(-1)
    if len(lengths) == 1:
        return x.mul_(flat[0])
    ops(scales.device).scale_(x, flat, lengths)
    return x


def scale_segments_into(x: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
                        dests: Sequence[torch.Tensor]) -> None:
    """dests[i] = segment i of `x` times scales[i]: scaling and scattering in one pass
    (each scale a host float on the CPU, a 0-d device tensor elsewhere: no host read)."""
    flat = scales.reshape(-1)
    factors = ops(scales.device).factors(flat)
    for part, s, d in zip(torch.split(x, list(lengths)), factors, dests, strict=True):
        torch.mul(part, s, out=d)


class SegmentOps:
    """The per-segment operations whose implementations differ by device: the torch path, which
    reads no value back (every device but the CPU, and the CPU under `host_paths(False)`)."""

    def mean_abs(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return _device_mean_abs(x, lengths)

    def max_abs(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return _device_max_abs(x, lengths)

    def scale_(self, x: torch.Tensor, flat: torch.Tensor, lengths: list[int]) -> None:
        """Each segment of `x` times its scale, in place (several segments; the scales stay on the device)."""
        if len(lengths) > _MANY_SEGMENTS:
            x.mul_(torch.repeat_interleave(flat.to(x.dtype), segment_counts(lengths, x.device), output_size=x.numel()))
        else:
            for i, part in enumerate(torch.split(x, lengths)):
                part.mul_(flat[i])

    def factors(self, flat: torch.Tensor) -> list:
        """Each segment's scale as a multiplier: a 0-d device tensor (no host read)."""
        return list(flat.unbind())


class ReadSegmentOps(SegmentOps):
    """The CPU without the compiled kernels: the same math, values read on the host where free."""

    def mean_abs(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return _host_mean_abs(x, lengths)

    def scale_(self, x: torch.Tensor, flat: torch.Tensor, lengths: list[int]) -> None:
        for part, s in zip(torch.split(x, lengths), flat.tolist(), strict=True):
            part.mul_(s)

    def factors(self, flat: torch.Tensor) -> list:
        return flat.tolist()


class HostSegmentOps(ReadSegmentOps):
    """The CPU with the compiled kernels (`host_slices`), each on the inputs it reads (a 1-D
    contiguous bucket, its dtypes); anything else takes the read path. (Slices read where they
    lie: `host_slices.SliceOps`.)"""

    def max_abs(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        if host_slices.flat_float(x):
            return host_slices.segment_max_abs(x, lengths)
        return super().max_abs(x, lengths)


def ops(device: torch.device) -> SegmentOps:
    """The segment ops for `device` (`dispatch.ops`: chosen once per device)."""
    return dispatch.ops(device, SegmentOps, HostSegmentOps, ReadSegmentOps)
