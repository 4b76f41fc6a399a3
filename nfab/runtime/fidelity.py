"""Per-region fidelity of a probe, measured in the optimizer's preconditioned space.

A fidelity probe reduces a strided sample of a bucket's lossy groups both ways: the
low-bit result every rank decoded (`est`) and the FP32 mean of the same elements before
error feedback (`ref`). Both are identical on every rank, and so is the optimizer state
the preconditioner reads, so everything here is rank-consistent.

Why preconditioned: Adam moves coordinate i by about g_i / (sqrt(v_i) + eps). A route
whose error is small in absolute terms but lands on coordinates with a small RMS (sign
gives every coordinate the same magnitude; error feedback re-injects stale mass) bends
the *update* far more than the plain cosine shows. Comparing est and ref after dividing
both by sqrt(v) + eps measures the error where the optimizer feels it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SampleRun:
    """Probe samples that fall in one parameter: indices start, start+step, ... (count of them)."""

    region: str
    name: str
    start: int
    step: int
    count: int


@dataclass(frozen=True, slots=True)
class RegionFidelity:
    """One region's agreement between the low-bit and the FP32 result of a probe."""

    cosine: float
    """Cosine of est and ref (after preconditioning when `preconditioned`)."""
    rel_error: float
    """||est - ref|| / ||ref||, in the same space."""
    preconditioned: bool
    samples: int


def probe_runs(slices: Sequence[tuple[str, str, int]], stride: int) -> list[SampleRun]:
    """Where a group's strided probe sample lands: `slices` are (region, name, numel) in
    group order; the sample is every `stride`-th element of their concatenation."""
    runs: list[SampleRun] = []
    pos = 0
    for region, name, numel in slices:
        first_j = -(-pos // stride)
        end_j = -(-(pos + numel) // stride)
        if end_j > first_j:
            runs.append(SampleRun(region, name, first_j * stride - pos, stride, end_j - first_j))
        pos += numel
    return runs


def region_fidelity(
    est: torch.Tensor,
    ref: torch.Tensor,
    runs: Sequence[SampleRun],
    inverse_rms: Callable[[str], torch.Tensor | None] | None = None,
) -> dict[str, RegionFidelity]:
    """Per region: cosine and relative error of `est` vs `ref` (aligned with `runs`).

    With `inverse_rms` (name -> flat 1/(sqrt(v)+eps), or None) both are weighted by the
    optimizer's preconditioner at the sampled indices; a region is marked preconditioned
    only when every one of its parameters had a second moment. Sums run in float64 in a
    fixed order, so every rank gets the same numbers.
    """
    assert sum(r.count for r in runs) == est.numel() == ref.numel(), "probe layout and samples disagree"
    parts: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], bool]] = {}
    pos = 0
    for run in runs:
        e = est[pos : pos + run.count].to(torch.float64)
        f = ref[pos : pos + run.count].to(torch.float64)
        pos += run.count
        w = inverse_rms(run.name) if inverse_rms is not None else None
        pre = w is not None
        if w is not None:
            idx = torch.arange(run.start, run.start + run.step * run.count, run.step, device=w.device)
            w64 = w[idx].to(torch.float64)
            e, f = e * w64, f * w64
        es, fs, ok = parts.setdefault(run.region, ([], [], True))
        es.append(e)
        fs.append(f)
        parts[run.region] = (es, fs, ok and pre)
    out: dict[str, RegionFidelity] = {}
    for region in sorted(parts):
        es, fs, pre = parts[region]
        e, f = torch.cat(es), torch.cat(fs)
        ne, nf = float(e.norm()), float(f.norm())
        cos = float(e @ f) / (ne * nf) if ne > 0 and nf > 0 else 1.0
        rel = float((e - f).norm()) / nf if nf > 0 else 0.0
        out[region] = RegionFidelity(cos, rel, pre, int(e.numel()))
    return out
