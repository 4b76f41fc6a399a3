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

Why per parameter: the sample is taken from each parameter on its own (every k-th element
from its index 0, k fixed by the parameter's size) and reduced to a few sums per parameter
in a fixed-width row, so a parameter's numbers do not depend on which bucket it travels in
or what sits beside it. DDP's buckets differ between a run's first step and the rest (it
rebuilds them after step 0) — a resumed run's first step is on the initial buckets — and
the drift monitor's decisions must not differ with them. The callback leaves the sums on
the device; the step's fold reads them in its one host copy and adds them up per region
in sorted parameter order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

PARAM_SAMPLES = 512
"""A probe samples at most this many elements of each parameter (every k-th from index 0)."""

STAT_FIELDS = ("dot", "est_sq", "ref_sq", "pre_dot", "pre_est_sq", "pre_ref_sq", "pre_diff_sq")
"""Per parameter: plain sums of est*ref, est^2, ref^2, then the same (and (est-ref)^2) after
multiplying both by the preconditioner (by 1 where the parameter has none)."""


@dataclass(frozen=True, slots=True)
class RegionFidelity:
    """One region's agreement between the low-bit and the FP32 result of a probe."""

    cosine: float
    """Cosine of est and ref (after preconditioning when `preconditioned`)."""
    rel_error: float
    """||est - ref|| / ||ref||, in the same space."""
    preconditioned: bool
    samples: int

    def as_row(self) -> list[float]:
        """Its `ROW_FIELDS` as floats (a control-word row, a checkpoint entry)."""
        return [self.cosine, self.rel_error, float(self.preconditioned), float(self.samples)]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RegionFidelity:
        """`as_row`'s inverse."""
        cosine, rel_error, pre, samples = row
        return cls(float(cosine), float(rel_error), pre > 0, int(samples))


ROW_FIELDS = ("cosine", "rel_error", "preconditioned", "samples")
"""`RegionFidelity.as_row`'s order."""


@dataclass(frozen=True, slots=True)
class SampleLayout:
    """Where a group's probe sample comes from and where each element lands in the stats rows."""

    src: torch.Tensor
    """Indices into the group's concatenated slices (int64, on the group's device)."""
    dst: torch.Tensor
    """Their positions in a (slices, PARAM_SAMPLES) matrix, flattened (int64)."""
    strides: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.counts)


def param_stride(numel: int, samples: int = PARAM_SAMPLES) -> int:
    """Every k-th element of a parameter of `numel` is sampled (at most `samples` of them)."""
    return max(1, -(-numel // samples))


def probe_mask(regions_of_slices: Sequence[str], probed: frozenset[str]) -> tuple[bool, ...] | None:
    """Which slices of a group (given their regions, in group order) a probe of the regions
    `probed` samples; None when it samples none of them (the group sends no probe part)."""
    mask = tuple(r in probed for r in regions_of_slices)
    return mask if any(mask) else None


@lru_cache(maxsize=1024)
def sample_layout(lengths: tuple[int, ...], device: torch.device, mask: tuple[bool, ...] | None = None,
                  per_slice: int = PARAM_SAMPLES) -> SampleLayout:
    """The probe sample of a group whose slices have `lengths` (cached: a plan's groups repeat).
    `mask`: sample only the slices marked True (the others count 0 samples); None: all of them.
    `per_slice`: at most this many samples of each slice (FSDP2 samples each of the W rows of a
    parameter, so about PARAM_SAMPLES / W of each: as many of the parameter as DDP's probe)."""
    src, dst, strides, counts, pos = [], [], [], [], 0
    for i, n in enumerate(lengths):
        k = param_stride(n, per_slice)
        c = -(-n // k) if mask is None or mask[i] else 0
        if c:
            src.append(torch.arange(pos, pos + n, k, dtype=torch.int64, device=device))
            dst.append(torch.arange(i * PARAM_SAMPLES, i * PARAM_SAMPLES + c, dtype=torch.int64, device=device))
        strides.append(k)
        counts.append(c)
        pos += n
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return SampleLayout(torch.cat(src) if src else empty, torch.cat(dst) if dst else empty, tuple(strides),
                        tuple(counts))


def sample(x: torch.Tensor, layout: SampleLayout) -> torch.Tensor:
    """The group's probe sample of `x` (its concatenated slices), as a float32 copy."""
    return x.index_select(0, layout.src).to(torch.float32)


def _stat_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def probe_stats(est: torch.Tensor, ref: torch.Tensor, layout: SampleLayout,
                weights: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """(slices, len(STAT_FIELDS)) sums per parameter, on the device (no host read).

    `weights[i]`: parameter i's flat 1/(sqrt(v)+eps), or None (then weight 1). Rows have a
    fixed width (PARAM_SAMPLES, zero-padded), so each row's sums depend on that parameter alone.
    """
    n, dt, dev = len(layout.counts), _stat_dtype(est.device), est.device
    e = torch.zeros(n * PARAM_SAMPLES, dtype=dt, device=dev).index_copy_(0, layout.dst, est.to(dt)).view(n, -1)
    f = torch.zeros(n * PARAM_SAMPLES, dtype=dt, device=dev).index_copy_(0, layout.dst, ref.to(dt)).view(n, -1)
    w = torch.ones(n, PARAM_SAMPLES, dtype=dt, device=dev)
    for i, (wi, k, c) in enumerate(zip(weights, layout.strides, layout.counts, strict=True)):
        if wi is not None and c:
            w[i, :c] = wi[::k].to(dt)
    pe, pf = e * w, f * w
    cols = (e * f, e * e, f * f, pe * pf, pe * pe, pf * pf, (pe - pf).square())
    return torch.stack([c.sum(dim=1) for c in cols], dim=1)


@dataclass(frozen=True, slots=True)
class ParamProbe:
    """One parameter's probe sums, read to the host at the fold."""

    region: str
    preconditioned: bool
    samples: int
    stats: tuple[float, ...]
    """`STAT_FIELDS`, in order."""


def bucket_probe(est: torch.Tensor, ref: torch.Tensor, slices: Sequence[tuple[str, str]], layout: SampleLayout,
                 inverse_rms: Callable[[str], torch.Tensor | None] | None) -> tuple[tuple, torch.Tensor]:
    """A probed group's per-parameter sums: ((name, region, preconditioned, samples), ...) and
    the (slices, fields) device tensor. `slices`: (name, region) in group order."""
    weights = [inverse_rms(name) if inverse_rms is not None and c else None
               for (name, _), c in zip(slices, layout.counts, strict=True)]
    meta = tuple((name, region, w is not None, c)
                 for (name, region), w, c in zip(slices, weights, layout.counts, strict=True))
    return meta, probe_stats(est, ref, layout, weights)


def read_params(meta: Sequence[tuple[str, str, bool, int]], flat: Sequence[float]) -> dict[str, ParamProbe]:
    """`bucket_probe`'s tensor read to the host (flat, row after row), keyed by parameter name."""
    k = len(STAT_FIELDS)
    return {name: ParamProbe(region, pre, samples, tuple(flat[i * k : (i + 1) * k]))
            for i, (name, region, pre, samples) in enumerate(meta) if samples}  # unprobed slices: no entry


@dataclass(frozen=True, slots=True)
class RegionSums:
    """One region's probe sums (`STAT_FIELDS`) over its probed parameters.

    Sums, not a cosine, are what ranks can combine when each probed a different part: FSDP2's
    ranks each compare their own shard of the reduced gradient, and the sums of every rank's
    shard add up to the sums of the whole sample (a cosine of the added sums is the sample's
    cosine; a mean of the ranks' cosines is not)."""

    stats: tuple[float, ...]
    """`STAT_FIELDS`, in order."""
    preconditioned: bool
    samples: int

    def as_row(self) -> list[float]:
        """Its `SUM_FIELDS` as floats (control-word values, a checkpoint entry)."""
        return [*self.stats, float(self.preconditioned), float(self.samples)]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> RegionSums:
        """`as_row`'s inverse."""
        k = len(STAT_FIELDS)
        return cls(tuple(float(v) for v in row[:k]), row[k] > 0, int(row[k + 1]))

    def fidelity(self) -> RegionFidelity:
        """The region's fidelity: its cosine and relative error, in the preconditioned space when
        every summed parameter had a second moment, else plain."""
        a = self.stats
        if self.preconditioned:
            dot, ee, ff, dd = a[3], a[4], a[5], a[6]
        else:
            dot, ee, ff = a[0], a[1], a[2]
            dd = max(ee - 2 * dot + ff, 0.0)
        return RegionFidelity(_cosine(dot, ee, ff), math.sqrt(dd / ff) if ff > 0 else 0.0, self.preconditioned,
                              self.samples)


SUM_FIELDS = (*STAT_FIELDS, "preconditioned", "samples")
"""`RegionSums.as_row`'s order."""


def region_sums(params: dict[str, ParamProbe]) -> dict[str, RegionSums]:
    """Each region's sums over its probed parameters, added in sorted name order (the same numbers
    for the same parameters, whatever the buckets were); preconditioned only when every one of the
    region's parameters had a second moment."""
    acc: dict[str, list[float]] = {}
    pre: dict[str, bool] = {}
    samples: dict[str, int] = {}
    for name in sorted(params):
        p = params[name]
        a = acc.setdefault(p.region, [0.0] * len(STAT_FIELDS))
        for i, v in enumerate(p.stats):
            a[i] += v
        pre[p.region] = pre.get(p.region, True) and p.preconditioned
        samples[p.region] = samples.get(p.region, 0) + p.samples
    return {r: RegionSums(tuple(acc[r]), pre[r], samples[r]) for r in sorted(acc)}


def add_sums(parts: Sequence[dict[str, RegionSums]]) -> dict[str, RegionSums]:
    """Several ranks' per-region sums added, in the order given (rank order: the same arithmetic on
    every rank); a region is preconditioned only where every rank's part was."""
    out: dict[str, RegionSums] = {}
    for part in parts:
        for region, s in sorted(part.items()):
            old = out.get(region)
            out[region] = s if old is None else RegionSums(
                tuple(x + y for x, y in zip(old.stats, s.stats, strict=True)),
                old.preconditioned and s.preconditioned, old.samples + s.samples)
    return dict(sorted(out.items()))


def sums_cosine(sums: dict[str, RegionSums]) -> float | None:
    """The cosine over every region of `sums` (added in sorted region order): preconditioned when
    every region is, else plain; None without any."""
    if not sums:
        return None
    pre = all(s.preconditioned for s in sums.values())
    total = [0.0, 0.0, 0.0]
    for region in sorted(sums):
        for i in range(3):
            total[i] += sums[region].stats[3 + i if pre else i]
    return _cosine(*total)


def fold_probes(params: dict[str, ParamProbe]) -> tuple[float | None, dict[str, RegionFidelity]]:
    """The step's cosine over every probed parameter and each region's fidelity.

    Sums run over parameters in sorted name order in Python floats: the same numbers for the
    same parameters, whatever the buckets were. A region counts as preconditioned only when
    every one of its parameters had a second moment; the step's cosine is preconditioned when
    every probed parameter had one (block-scaled qsum rounds in that space, so its plain
    cosine reads noise Adam divides away as harm), else plain.
    """
    if not params:
        return None, {}
    plain = [0.0, 0.0, 0.0]
    whole = [0.0, 0.0, 0.0]
    for name in sorted(params):
        p = params[name]
        for i in range(3):
            plain[i] += p.stats[i]
            whole[i] += p.stats[3 + i]
    out = {region: s.fidelity() for region, s in region_sums(params).items()}
    step = whole if all(p.preconditioned for p in params.values()) else plain
    return _cosine(*step), out


def _cosine(dot: float, ee: float, ff: float) -> float:
    return dot / math.sqrt(ee * ff) if ee > 0 and ff > 0 else 1.0
