"""The hook body's work for one bucket: encode each group, then launch its collectives.

Every tensor is allocated on the bucket's device and nothing is read back to the host:
a non-finite element shows in the bucket's |g|^2, which travels in the control word.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from nfab.runtime import reads
from nfab.runtime.control import fidelity
from nfab.runtime.control import word as control
from nfab.runtime.control.controller import FP32, BucketRoutes, Group
from nfab.runtime.core import coalesce
from nfab.runtime.core.agreement import Agreement
from nfab.runtime.core.handoff import EncodedGroup, Probe, Sent
from nfab.runtime.core.plan import BucketPlan
from nfab.runtime.core.scales import AmaxHistory
from nfab.wire import host_slices, noise
from nfab.wire.contract import ScaleAgreement
from nfab.wire.registry import REDUCERS, all_gather_flat, allgather_factor, allreduce_factor
from nfab.wire.slices import Slices


@dataclass(frozen=True, slots=True)
class EncodeContext:
    """What encoding a bucket's groups needs from the runtime (residuals and scales are its state)."""

    world_size: int
    process_group: dist.ProcessGroup | None
    step: int
    seed: int
    rank: int
    param_index: dict[str, int]
    error_feedback: bool
    probing: frozenset[str]
    """Regions this step's probe samples (empty: no probe; `control/probes.py` rotates them)."""
    gathered: bool
    """The bucket goes out as one all-gather: qsum encodes with this rank's own scale."""
    residuals: dict[str, torch.Tensor]
    scales: AmaxHistory
    ef_off: frozenset[str] = frozenset()
    """Regions whose error feedback the drift monitor switched off: no residual added or staged."""
    quantization_scale: Callable[[Sequence[str], Sequence[int], torch.device], torch.Tensor | None] | None = None
    """The scale block-scaled qsum rounds a group's slices in (`Preconditioner.flat_scale`), or
    None: no optimizer second moment, plain block scales."""
    loss_scale: torch.Tensor | None = None
    """The loss scale this step's gradients carry (`attach(loss_scaler=)`: 1 element, on their
    device), or None. Error feedback's residuals and qsum's delayed amax history are kept in the
    optimizer's units, divided by it: a loss scaler halves its scale on an overflow and doubles it
    every growth interval, and an owed error kept in the old scale's units would be sent at twice
    or half its size."""


@dataclass(frozen=True, slots=True)
class Opened:
    """A bucket between its hook body and its launch: what `Runtime._complete` needs to encode
    and launch it, in the same hook body or (agreement in flight) the next one."""

    index: int
    plan: BucketPlan
    routes: BucketRoutes
    ctx: EncodeContext
    buffer: torch.Tensor
    first: bool
    last: bool
    bucket_sq: torch.Tensor | None
    """This rank's |g|^2 of the bucket, taken before any group was pre-scaled or encoded (less
    the groups whose encoders take theirs: their `EncodedGroup.sq` completes it; None when every
    group's does)."""
    prepared: tuple[Prepared, ...] | None
    """Every group, prepared in order (None on the two-level path: it encodes at completion)."""
    probe_parts: list[torch.Tensor]
    agreement: Agreement | None
    phases: tuple[float, float, float]
    """Thread CPU seconds of plan, norm and the encode's first part, in the bucket's own hook body."""


@dataclass(slots=True)
class Blocking:
    """Blocking scale agreements (qsum, exact) made while encoding: counted in the stats."""

    rounds: int = 0
    wire_bytes: float = 0.0


def views(buffer: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """The group's slices as views of the bucket (encode sources, decode destinations)."""
    return [buffer[s.offset : s.offset + s.numel] for s in group.slices]


def slices(buffer: torch.Tensor, *groups: Group) -> Slices:
    """The groups' slices where they lie in the bucket, for a decode or encode that takes them
    all at once (views made only if a path asks for them)."""
    if len(groups) == 1:
        return Slices(buffer, groups[0].offsets, groups[0].lengths)
    return Slices(buffer, np.concatenate([g.offsets for g in groups]), [n for g in groups for n in g.lengths])


def gather_slices(buffer: torch.Tensor, *groups: Group) -> torch.Tensor:
    """The groups' slices as one new tensor: one compiled copy on the host, `torch.cat` of
    their views elsewhere."""
    return host_slices.concat(slices(buffer, *groups))


def local_sq(buffer: torch.Tensor, groups: Sequence[Group] = (),
             ctx: EncodeContext | None = None) -> torch.Tensor | None:
    """This rank's |g|^2 of a bucket, fp32, on its device (non-finite iff an element is). With
    `ctx`, groups whose encoder takes their share on its own read (`reads_sq`) are left out:
    `Runtime._complete` adds `EncodedGroup.sq` back, one pass over those slices fewer (None: every
    group's encoder takes its own)."""
    rest = [g for g in groups if not reads_sq(ctx, buffer, g)] if ctx is not None else []
    if ctx is None or len(rest) == len(groups):
        return torch.linalg.vector_norm(buffer, dtype=torch.float32).square()
    if not rest:
        return None
    sq = host_slices.slices_sq(slices(buffer, *rest))  # the rest read where it lies: no copy of a large FP32 group
    return sq if sq is not None else torch.linalg.vector_norm(gather_slices(buffer, *rest),
                                                              dtype=torch.float32).square()


def add_sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b of two 0-d fp32 |x|^2 shares (in numpy on the host: the same float32 sum, no dispatch)."""
    return reads.of(a.device).add(a, b)


def _in_place(ctx: EncodeContext, buffer: torch.Tensor, group: Group) -> bool:
    """A lossy group with nothing to add or sample: encoded from its slices where they lie (a
    whole-bucket group too when its encoder reads the bucket and takes its |x|^2 on the way).
    A group that needs a shared scale only in a gathered bucket, where qsum rounds in its own
    scale (`Reducer.own_scale_when_gathered`): no agreement to wait for."""
    red = REDUCERS[group.key]
    if group.key == FP32 or ctx.error_feedback:
        return False
    if ctx.probing and fidelity.probe_mask([s.region for s in group.slices], ctx.probing) is not None:
        return False
    if red.needs_shared_scale:
        return ctx.gathered and red.own_scale_when_gathered and not group.whole
    return not group.whole or red.reads_sq(buffer)


def reads_sq(ctx: EncodeContext | None, buffer: torch.Tensor, group: Group) -> bool:
    """Whether the group's encoder takes its |x|^2 on its own read of the bucket (in place, by a
    reducer that can: the compiled sign votes on the CPU)."""
    return ctx is not None and _in_place(ctx, buffer, group) and REDUCERS[group.key].reads_sq(buffer)


@dataclass(frozen=True, slots=True)
class Prepared:
    """One group read out of the bucket, up to what its encoding needs agreed across ranks.

    The hook prepares every group of a bucket first, launches their scale agreement as one
    collective (`runtime/core/agreement.py`), and encodes them (`finish_group`) once the agreed
    scales are needed: the round trip overlaps the bucket's other work, or the backward pass
    when a later hook body finishes the bucket. An empty `Prepared` (`x` None) means the
    group reads nothing before it is finished (FP32, or encoded where its slices lie)."""

    group: Group
    x: torch.Tensor | None = None
    """What gets encoded: the group's values (+ residuals), divided by `weights` when given."""
    raw: torch.Tensor | None = None
    """The group's values (+ residuals) before `weights`: error feedback keeps raw - decoded."""
    weights: torch.Tensor | None = None
    local: torch.Tensor | None = None
    """This rank's local scale (block max / max |x|), when the reducer needs a shared scale."""
    shared: torch.Tensor | None = None
    """The shared scale when known without agreeing (delayed history, or own when gathered)."""

    @property
    def agree(self) -> tuple[str, torch.Tensor] | None:
        """(reducer key, local scale) when the shared scale must be agreed now (exact), else None."""
        return (self.group.key, self.local) if self.local is not None and self.shared is None else None


def prepare_group(ctx: EncodeContext, buffer: torch.Tensor, group: Group,
                  probe_parts: list[torch.Tensor]) -> Prepared:
    """Read a group out of the bucket up to its local scale (probe sample, residuals, the
    optimizer's weights); nothing here depends on another rank."""
    red = REDUCERS[group.key]
    if group.key == FP32 or _in_place(ctx, buffer, group):
        return Prepared(group)
    # a whole-bucket group works on the bucket itself: it is overwritten by the result
    x = buffer if group.whole else gather_slices(buffer, group)
    mask = fidelity.probe_mask([s.region for s in group.slices], ctx.probing) if ctx.probing else None
    # per parameter, so a parameter's sample does not depend on its bucket. Before EF where the probe
    # reads in the optimizer's preconditioned space (the drift monitor's truth is the gradient itself:
    # stale residuals under Adam are what it must see); after EF where it reads plain cosines (SGD):
    # there it asks whether the route sent what it was given, and a step's gradient alone, small late
    # in a run beside the error it carries, read 0.04-0.15 on a healthy bq2 + EF (the CNN recipe)
    after_ef = mask is not None and ctx.error_feedback and _weights(ctx, group, x) is None
    if mask is not None and not after_ef:
        probe_parts.append(fidelity.sample(x, fidelity.sample_layout(group.lengths, x.device, mask)))
    if ctx.error_feedback:
        add_residuals(ctx.residuals, x, group, ctx.ef_off, ctx.loss_scale)
    if after_ef:
        probe_parts.append(fidelity.sample(x, fidelity.sample_layout(group.lengths, x.device, mask)))
    raw, weights, local, shared = x, None, None, None
    if red.scale_agreement is ScaleAgreement.PER_BLOCK:  # one uint8 code per block, always agreed (exact)
        weights = _weights(ctx, group, x)
        if weights is not None:  # round in the optimizer's preconditioned space
            x = x / weights
        # a non-finite element already shows in the bucket's |g|^2 (control word): no column here
        local = red.local_scale(x, group.lengths)
    elif red.needs_shared_scale:
        local = red.local_scale(x, group.lengths)
        shared = local if ctx.gathered else ctx.scales.delayed((s.name for s in group.slices), ctx.step, x.device)
        if shared is not None and not ctx.gathered:  # the history is unscaled (`EncodeContext.loss_scale`)
            shared = scaled(shared, ctx.loss_scale)
    return Prepared(group, x, raw, weights, local, shared)


def finish_group(ctx: EncodeContext, buffer: torch.Tensor, prep: Prepared, agreed: torch.Tensor | None,
                 word: control.Builder) -> EncodedGroup:
    """One group's payload from its `Prepared` and, when it agreed one, its agreed scale; its
    scales / max |x| appended to the control word being built."""
    group = prep.group
    red, w = REDUCERS[group.key], ctx.world_size
    if prep.x is None:
        if group.key == FP32:
            x = buffer if group.whole else gather_slices(buffer, group)
            _flush_residuals(ctx.residuals, x, group, ctx.loss_scale)
            x.mul_(1.0 / w)  # pre-scale exactly as DDP does (x * (1/W), not x / W), in the bucket's dtype
            return EncodedGroup(group, x)
        # nothing to add or sample: encode the slices where they lie, no gathered copy
        fused = reads_sq(ctx, buffer, group)
        if red.own_scale_when_gathered:  # in place with a shared scale: a gathered bucket's, own scale in the word
            enc, own = red.encode_own_views(slices(buffer, group), group.lengths, w,
                                            _noise(ctx, group, buffer.device, False), with_sq=fused)
            assert enc.sq is not None or not fused, "a group left out of the norm pass must bring its |x|^2"
            return EncodedGroup(group, enc.payload, None, word.add(own), own, sq=enc.sq)
        enc = red.encode_views(slices(buffer, group), group.lengths, w, with_sq=fused, tie=tie(ctx))
        assert enc.sq is not None or not fused, "a group left out of the norm pass must bring its |x|^2"
        return EncodedGroup(group, enc.payload, scale_cols=_cols(word, enc.scales), sq=enc.sq)
    x, weights = prep.x, prep.weights
    shared = prep.shared if prep.agree is None else agreed
    assert shared is not None or prep.local is None, "a group that agrees its scale needs the agreed value"
    per_slice = red.scale_agreement is ScaleAgreement.PER_SLICE  # its max |x| feeds the history: in the word
    amax_cols = word.add(prep.local) if prep.local is not None and per_slice else None
    dither = _noise(ctx, group, x.device, red.stratified_rounding) if red.needs_shared_scale else None
    enc = red.encode(x, group.lengths, w, shared, dither, tie=tie(ctx))
    residuals: tuple[tuple[str, torch.Tensor], ...] = ()
    if ctx.error_feedback and enc.local is not None:
        resid = unscaled(prep.raw - (enc.local if weights is None else enc.local * weights), ctx.loss_scale)
        residuals = tuple((s.name, part) for s, part in zip(group.slices, resid.split(group.lengths), strict=True)
                          if s.region not in ctx.ef_off)  # the drift monitor switched it off
    return EncodedGroup(group, enc.payload, _cols(word, enc.scales), amax_cols, shared, residuals, weights)


def tie(ctx: EncodeContext) -> int:
    """Which way this rank's exact zeros vote on the sign routes this step (`Reducer.encode`): group
    rank + step, so that at even W the ranks' zeros cancel, and at odd W the vote left over changes
    sign from step to step (`codec.sign_bits`)."""
    return ctx.rank + ctx.step


def encode_group(ctx: EncodeContext, buffer: torch.Tensor, group: Group, word: control.Builder,
                 probe_parts: list[torch.Tensor], blocking: Blocking) -> EncodedGroup:
    """One group's payload, its scale agreed on the spot (blocking): `prepare_group`, the MAX,
    `finish_group` (the two-level path's FP32 groups; the hook launches agreements early)."""
    prep = prepare_group(ctx, buffer, group, probe_parts)
    agreed = None
    if prep.agree is not None:
        red = REDUCERS[group.key]
        agreed = red.agree(prep.agree[1], ctx.process_group)
        blocking.rounds += 1
        blocking.wire_bytes += allreduce_factor(ctx.world_size) * agreed.numel() * agreed.element_size()
    return finish_group(ctx, buffer, prep, agreed, word)


def _weights(ctx: EncodeContext, group: Group, x: torch.Tensor) -> torch.Tensor | None:
    """The group's per-element preconditioning scale (1 for a slice without one), or None."""
    if ctx.quantization_scale is None:
        return None
    return ctx.quantization_scale([s.name for s in group.slices], group.lengths, x.device)


def launch_each(encoded: Sequence[EncodedGroup], ctrl: torch.Tensor | None, w: int,
                pg: dist.ProcessGroup | None) -> tuple[list[Sent], torch.Tensor | None, list, float, int]:
    """One collective per group, as its reducer sends it, plus the control word's all-gather.
    Returns the sent groups, the control words' receive buffer, the futures, the bytes and the
    collectives (a two-phase reducer's one future stands for its two)."""
    sent, futs, nbytes, collectives = [], [], 0.0, 0
    for enc in encoded:
        red = REDUCERS[enc.group.key]
        nbytes += red.collective_factor(w) * enc.payload.numel() * enc.payload.element_size()
        fut = red.launch(enc.payload, w, pg)
        sent.append(Sent(enc, fut, None))
        futs.append(fut)
        collectives += red.payload_collectives
    recv = None
    if ctrl is not None:
        recv = torch.empty(w * ctrl.numel(), dtype=ctrl.dtype, device=ctrl.device)
        futs.append(all_gather_flat(recv, ctrl, group=pg, async_op=True).get_future())
        nbytes += allgather_factor(w) * ctrl.numel() * 4
        collectives += 1
    return sent, recv, futs, nbytes, collectives


def launch_coalesced(encoded: Sequence[EncodedGroup], ctrl: torch.Tensor | None, w: int, pg: dist.ProcessGroup | None,
                     device: torch.device) -> tuple[list[Sent], coalesce.Part | None, torch.Tensor, list, float]:
    """The control word and every group's payload as the bytes of ONE all-gather."""
    tensors = ([ctrl] if ctrl is not None else []) + [e.payload for e in encoded]
    row, parts = coalesce.pack(tensors, device)
    ctrl_part = parts.pop(0) if ctrl is not None else None
    rows, table = reads.of(device).gathered_rows(w, row.numel(), device)
    fut = all_gather_flat(rows, row, group=pg, async_op=True).get_future()
    sent = [Sent(e, None, p) for e, p in zip(encoded, parts, strict=True)]
    return sent, ctrl_part, table, [fut], allgather_factor(w) * row.numel()


def launch_probe(parts: list[torch.Tensor], w: int, pg: dist.ProcessGroup | None,
                 regions: frozenset[str] = frozenset()) -> Probe | None:
    """The bucket's probe samples (its lossy groups' slices in `regions`), FP32-mean all-reduced beside it."""
    if not parts:
        return None
    sample = torch.cat(parts).mul_(1.0 / w)
    return Probe(REDUCERS[FP32].launch(sample, w, pg), sample.numel(), regions)


def _cols(word: control.Builder, scales: torch.Tensor | None) -> control.Columns | None:
    return word.add(scales) if scales is not None else None


def _noise(ctx: EncodeContext, group: Group, device: torch.device,
           stratified: bool) -> list[torch.Generator] | noise.Seeds | noise.Stratum:
    """One rounding-noise key per slice, drawn by a generator on the bucket's device seeded by
    (seed, rank, step, parameter): every rank follows the same seed schedule and rounds
    independently, and a parameter's noise does not depend on which bucket it travels in (a
    resumed run's first step, on DDP's initial buckets, rounds as the uninterrupted run did).
    Stratified rounding (block-scaled qsum) leaves the rank out of the seed — every rank draws
    the same keys — and shifts by the rank instead (`noise.Stratum`). On the CPU the seeds
    stand for the generators (`noise.Seeds`): the keys are computed from them (the generators'
    bits), by `noise.seeded_keys` or inside the kernel that rounds, never drawn from a
    generator made per slice."""
    who = -1 if stratified else ctx.rank
    seeds = [hash((ctx.seed, who, ctx.step, ctx.param_index[s.name])) & 0x7FFF_FFFF_FFFF for s in group.slices]
    source = reads.of(device).noise_source(seeds, device)
    return noise.Stratum(source, ctx.rank, ctx.world_size) if stratified else source


def scaled(values: torch.Tensor, loss_scale: torch.Tensor | None) -> torch.Tensor:
    """Values kept in the optimizer's units (residuals, delayed amax) in this step's gradient units."""
    return values if loss_scale is None else values * loss_scale.to(values.device)


def unscaled(values: torch.Tensor, loss_scale: torch.Tensor | None) -> torch.Tensor:
    """This step's gradient-unit values in the optimizer's units (`EncodeContext.loss_scale`)."""
    return values if loss_scale is None else values / loss_scale.to(values.device)


def add_residuals(residuals: dict[str, torch.Tensor], x: torch.Tensor, group: Group,
                  ef_off: frozenset[str], loss_scale: torch.Tensor | None = None) -> None:
    """Add what error feedback owes each slice to `x` (the group's slices, concatenated), in this
    step's units (`loss_scale`), except in regions whose error feedback the drift monitor switched off."""
    pos = 0
    for s in group.slices:
        r = None if s.region in ef_off else residuals.get(s.name)
        if r is not None:
            x[pos : pos + s.numel].add_(scaled(r, loss_scale))
        pos += s.numel


def _flush_residuals(residuals: dict[str, torch.Tensor], x: torch.Tensor, group: Group,
                     loss_scale: torch.Tensor | None) -> None:
    """A slice back on fp32 sends what error feedback still owed it, then forgets it."""
    if not residuals:
        return
    pos = 0
    for s in group.slices:
        r = residuals.pop(s.name, None)
        if r is not None:
            start = s.offset if group.whole else pos
            x[start : start + s.numel].add_(scaled(r, loss_scale))
        pos += s.numel
