"""In-run calibration's windows (`attach(model, "auto")`): every rank's own gradient, sampled and agreed.

During a window's steps each bucket's hook copies a fixed sample of its local gradient before anything
is encoded: contiguous `CHUNK`-element pieces of every parameter (whole blocks of every block route),
the same positions on every rank, drawn once from the seed with nfab's own generator. The step's last
bucket all-gathers the step's samples, ONE collective of at most `SAMPLE` elements per region and rank
(FSDP2, which has no last call to wait for: one per module's reduce-scatter), never one per candidate
route, and the fold keeps them on the host. At a window's end
`fit` (given at attach: `nfab.calibrate.inrun`) replays every candidate route over the W ranks'
samples as `nfab calibrate` replays its virtual ranks, and returns the profile the run continues on.
Every rank holds the same samples and fits the same numbers; the next hook body still agrees the
decision (one MAX all-reduce of its route codes and their negatives) before any bucket uses it, and
a disagreement keeps FP32 everywhere.

Windows start at step 0 and at even fractions of the run (`schedule`): the profile is phase-dependent.
The first window sends `WINDOW_ROUTE` (bf16: half FP32's bytes, level with it in quality; FP32 on FSDP2,
whose reduce-scatter carries no bf16); a later one keeps sending the profile in force, since what it
measures does not depend on what is sent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nfab.profile.schema import REGIONS, Profile
from nfab.runtime.core.plan import BucketPlan
from nfab.runtime.core.shards import ShardParam
from nfab.wire.contract import all_gather_flat
from nfab.wire.routes import ROUTES

CHUNK = 256
"""Elements per sampled piece: a whole number of blocks of every block route (64, 128, 256)."""
SAMPLE = 16384
"""Sampled elements per region and rank, at most (a big region's sample costs it little)."""
SAMPLE_SHARE = 1 / 16
"""...and at most this share of a smaller region, down to `MIN_SAMPLE`: on a small model a fixed sample
is a large part of a step's bytes (16k per region was 39% of a 0.17M-parameter GPT's FP32 step)."""
MIN_SAMPLE = 2048
"""Sampled elements of a region at least (every element of a region this small)."""
WINDOW_FRACTION = 0.02
"""A window's length as a fraction of the run (at least `MIN_STEPS`)."""
MIN_STEPS = 4
WINDOWS = 3
"""Windows per run with a known length: at its start and at each third."""
WINDOW_ROUTE = "bf16"
"""What the first window sends while no profile is fitted yet: half FP32's bytes, level with it in quality."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """Where the windows lie: each starts at `starts[i]` and measures `length` steps."""

    starts: tuple[int, ...]
    length: int

    def index(self, step: int) -> int | None:
        """The window measuring at `step`, or None."""
        for i, s in enumerate(self.starts):
            if s <= step < s + self.length:
                return i
        return None


def schedule(total_steps: int | None, window_steps: int | None = None, windows: int = WINDOWS) -> Schedule:
    """The windows of a run of `total_steps` (None: one window, at the start)."""
    if total_steps is None:
        return Schedule((0,), window_steps or 2 * MIN_STEPS)
    length = window_steps or max(MIN_STEPS, math.ceil(WINDOW_FRACTION * total_steps))
    starts = [0]
    for k in range(1, windows):
        s = round(k * total_steps / windows)
        if s >= starts[-1] + length and s + length <= total_steps:
            starts.append(s)
    return Schedule(tuple(starts), min(length, total_steps))


@dataclass(frozen=True, slots=True)
class Sampled:
    """One parameter's sample: its element positions (chunks in order) and region."""

    name: str
    region: str
    numel: int
    positions: torch.Tensor
    """int64, on the host: the sampled elements of the parameter's flat gradient."""


def sample_layout(params: Sequence[tuple[str, str, int]], seed: int) -> tuple[Sampled, ...]:
    """The positions every rank samples: `params` = (name, region, numel) in the model's order. Per
    region about `region_sample` elements, shared between its parameters by size (at least one chunk each),
    whole `CHUNK`s at chunk-aligned offsets, drawn from nfab's own generator (never the user's)."""
    by_region: dict[str, int] = {}
    for _, region, n in params:
        by_region[region] = by_region.get(region, 0) + n
    budget = {r: region_sample(n) for r, n in by_region.items()}
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    out = []
    for name, region, n in params:
        chunks = -(-n // CHUNK)
        share = budget[region] * n / by_region[region]  # this parameter's part of its region's sample
        take = chunks if by_region[region] <= budget[region] else min(chunks, max(1, round(share / CHUNK)))
        picked = torch.randperm(chunks, generator=gen, device="cpu")[:take].sort().values
        pos = (picked[:, None] * CHUNK + torch.arange(CHUNK, device="cpu")[None, :]).reshape(-1)
        out.append(Sampled(name, region, n, pos[pos < n]))
    return tuple(out)


def region_sample(numel: int) -> int:
    """Elements a region of `numel` samples per rank and step: `SAMPLE`, at most `SAMPLE_SHARE` of it but
    `MIN_SAMPLE` at least (all of a region smaller than that)."""
    return min(numel, max(MIN_SAMPLE, min(SAMPLE, int(numel * SAMPLE_SHARE))))


@dataclass(slots=True)
class WindowSamples:
    """What one window measured: per step the W ranks' samples, and the optimizer's scale at its start."""

    start: int
    steps: list[torch.Tensor] = field(default_factory=list)
    """Per step a [W, S] fp32 host tensor (rank r's sample in row r; columns in `sample_layout` order)."""
    scale: torch.Tensor | None = None
    """[S]: sqrt(v) + eps at the sampled elements when the window opened (None: no second moment yet)."""


Fit = Callable[["Window", dict[str, list[float]]], Profile]
"""(the windows measured so far, the run's agreed loss and grad-norm series) -> the profile the run
continues on (`nfab.calibrate.inrun.fitter`)."""


class Window:
    """In-run calibration's state on one rank: schedule, sample layout, the samples, the decisions."""

    def __init__(self, schedule_: Schedule, layout: tuple[Sampled, ...], fit: Fit, *, world_size: int,
                 group: Any = None) -> None:
        self.schedule = schedule_
        self.layout = layout
        self.fit = fit
        self.world_size = world_size
        self.group = group
        self.size = sum(int(s.positions.numel()) for s in layout)
        self._by_name = {s.name: s for s in layout}
        self._offsets: dict[str, int] = {}
        at = 0
        for s in layout:
            self._offsets[s.name] = at
            at += int(s.positions.numel())
        self.windows: list[WindowSamples] = []
        self.decided: Profile | None = None
        """The profile the run is on since the last window's end (None: still the window route)."""
        self.pending: Profile | None = None
        """Fitted at a window's end, adopted (after agreement) by the next hook body."""
        self._index: dict[Any, tuple[torch.Tensor, torch.Tensor] | None] = {}
        """Per bucket plan (DDP) or module (FSDP2): where its sampled elements lie, and where they go."""
        self._local: torch.Tensor | None = None
        self._gathers: list[tuple[torch.Tensor, Any, torch.Tensor | None]] = []
        """The step's all-gathers in flight: (output, work, the sample columns it fills; None: all)."""
        self._bytes = 0  # the step's all-gathers' wire bytes
        self._scale: torch.Tensor | None = None  # the optimizer's scale at the window's first step

    # ---- the hook's part ------------------------------------------------------------
    def measuring(self, step: int) -> bool:
        return self.schedule.index(step) is not None

    def take(self, plan: BucketPlan, buffer: torch.Tensor, step: int, loss_scale: torch.Tensor | None,
             scale_of: Callable[[str], torch.Tensor | None] | None) -> None:
        """Copy this bucket's sampled elements of the local gradient (before any encode touches it). At a
        window's first step also the optimizer's scale there (`scale_of`: a parameter's sqrt(v) + eps),
        read in backward, before the optimizer steps, as `nfab calibrate` reads it at a phase start."""
        if plan.key not in self._index:
            self._index[plan.key] = self._positions(((sl.name, sl.offset) for sl in plan.slices),
                                                    lambda s, offset: s.positions + offset, buffer.device)
        idx = self._index[plan.key]
        if idx is None:
            return
        if self._local is None:
            self._local = torch.zeros(self.size, dtype=torch.float32, device=buffer.device)
            self._open(step, scale_of)
        src, dst = idx
        self._local.index_copy_(0, dst, _values(buffer, src, loss_scale))

    def take_rows(self, key: int, params: Sequence[ShardParam], chunk: int, inp: torch.Tensor) -> int:
        """FSDP2: one module's reduce-scatter input (W rows of `chunk`: every rank's padded dim-0 shard of
        each parameter, side by side): its sampled elements, all-gathered at once (asynchronously: the
        front end has no last call to wait for); its wire bytes. `key`: the module's, for the index.
        Element i of a parameter lies in row i // shard_numel, at its offset there plus i % shard_numel.
        (No optimizer scale: FSDP2's optimizer state is sharded, and its block routes round unscaled.)"""
        if key not in self._index:

            def rows(s: Sampled, p: ShardParam) -> torch.Tensor:
                return (torch.div(s.positions, p.shard_numel, rounding_mode="floor") * chunk + p.offset
                        + s.positions % p.shard_numel)

            self._index[key] = self._positions(((p.name, p) for p in params), rows, inp.device)
        idx = self._index[key]
        if idx is None:
            return 0
        src, dst = idx
        values = _values(inp.reshape(-1), src, None)
        return self._gather(values, dst)

    def launch(self) -> int:
        """From the step's last bucket: all-gather the step's samples (asynchronously); its wire bytes."""
        if self._local is None:
            return 0
        local, self._local = self._local, None
        return self._gather(local, None)

    def _gather(self, values: torch.Tensor, dst: torch.Tensor | None) -> int:
        """All-gather `values` (the sample's columns `dst`; None: all of it) asynchronously; its wire bytes."""
        out = torch.empty(self.world_size * values.numel(), dtype=torch.float32, device=values.device)
        self._gathers.append((out, all_gather_flat(out, values, group=self.group, async_op=True), dst))
        nbytes = (self.world_size - 1) * values.numel() * 4
        self._bytes += nbytes
        return nbytes

    def fold(self, step: int, reference: dict[str, list[float]]) -> int:
        """At the step boundary: keep the gathered samples; at a window's last step, fit (no collective).
        `reference`: the run's agreed loss and grad-norm series so far (the health thresholds' base).
        Returns the step's all-gather bytes (`StepStats.calibration_wire_bytes`)."""
        if not self._gathers:
            return 0
        gathers, self._gathers = self._gathers, []
        nbytes, self._bytes = self._bytes, 0
        full: torch.Tensor | None = None
        for out, work, dst in gathers:
            work.wait()
            rows = out.view(self.world_size, -1)
            if dst is None:
                full = rows
                continue
            if full is None:
                full = torch.zeros(self.world_size, self.size, dtype=torch.float32, device=rows.device)
            full.index_copy_(1, dst, rows)
        assert full is not None
        i = self.schedule.index(step)
        assert i is not None, "samples gathered outside a window"
        start = self.schedule.starts[i]
        if not self.windows or self.windows[-1].start != start:
            self.windows.append(WindowSamples(start, scale=self._scale))
            self._scale = None
        win = self.windows[-1]
        win.steps.append(full.cpu())
        if step == start + self.schedule.length - 1:
            with torch.device("cpu"):  # the fit is host work on host copies, whatever the caller's default device
                self.pending = self.fit(self, reference)
        return nbytes

    def agree(self, device: torch.device) -> Profile | None:
        """From a hook body, after a window's end: the fitted profile if every rank fitted the same
        routes (one MAX all-reduce of the codes and their negatives), else FP32 everywhere."""
        prof, self.pending = self.pending, None
        if prof is None:
            return None
        codes = torch.tensor(profile_codes(prof), dtype=torch.int64, device=device)
        both = torch.cat([codes, -codes])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        n = codes.numel()
        if not torch.equal(both[:n], -both[n:]):
            prof = Profile.static("fp32")
        self.decided = prof
        return prof

    # ---- resume ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # the kept samples are never written to again: the state holds them as they are
        return {"windows": [{"start": w.start, "steps": list(w.steps), "scale": w.scale} for w in self.windows],
                "decided": None if self.decided is None else self.decided.to_json(),
                "pending": None if self.pending is None else self.pending.to_json()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.windows = [WindowSamples(w["start"], list(w["steps"]), w["scale"]) for w in state["windows"]]
        self.decided = None if state["decided"] is None else Profile.from_dict(json.loads(state["decided"]))
        self.pending = None if state["pending"] is None else Profile.from_dict(json.loads(state["pending"]))

    # ---- internals -------------------------------------------------------------------
    def _positions(self, entries: Iterable[tuple[str, Any]], where: Callable[[Sampled, Any], torch.Tensor],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions in the gradient, positions in the step's sample) of the sampled elements of `entries`
        ((parameter name, what `where` needs to place its sample)); None where none is sampled."""
        src, dst = [], []
        for name, at in entries:
            s = self._by_name.get(name)
            if s is None or s.positions.numel() == 0:
                continue
            src.append(where(s, at))
            dst.append(torch.arange(s.positions.numel(), device="cpu") + self._offsets[name])
        return (torch.cat(src).to(device), torch.cat(dst).to(device)) if src else None

    def _open(self, step: int, scale_of: Callable[[str], torch.Tensor | None] | None) -> None:
        """A step's first sample: at a window's first step, also the optimizer's scale there."""
        if step in self.schedule.starts and scale_of is not None:
            self._scale = self._sampled_scale(scale_of)

    def _sampled_scale(self, scale_of: Callable[[str], torch.Tensor | None]) -> torch.Tensor | None:
        parts, any_scale = [], False
        for s in self.layout:
            q = scale_of(s.name)
            any_scale |= q is not None
            parts.append(torch.ones(s.positions.numel(), device="cpu") if q is None
                         else q.reshape(-1).cpu()[s.positions])
        return torch.cat(parts).to(torch.float32) if any_scale else None


def _values(flat: torch.Tensor, src: torch.Tensor, loss_scale: torch.Tensor | None) -> torch.Tensor:
    """The sampled elements of a local gradient in fp32 units of the optimizer's (a loss scaler's factor out)."""
    values = flat.index_select(0, src).to(torch.float32)
    return values / loss_scale if loss_scale is not None else values


def profile_codes(prof: Profile) -> list[int]:
    """The decision as integers every rank compares: per phase its EF flag and each region's route."""
    codes: list[int] = []
    for p in prof.phases:
        codes.append(int(p.error_feedback))
        codes.extend(ROUTES.index(p.routes.get(r, "fp32")) for r in REGIONS)
    return codes
