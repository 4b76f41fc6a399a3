"""The callback's work for one bucket: decode every group into its slices, agree on non-finite.

Runs as a future callback (any thread, any order across buckets): it launches no
collective, writes only the bucket buffer, and returns an `Outcome`. Host reads: on the
CPU the non-finite flag is read directly (free there); on any other device (and on the CPU
under `dispatch.host_paths(False)`) the bucket is decoded regardless and masked on the
device, and the decoders take their torch paths, so no callback waits for the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from nfab.runtime import reads
from nfab.runtime.control import fidelity
from nfab.runtime.control import word as control
from nfab.runtime.control.controller import FP32, Group
from nfab.runtime.control.moment import NoiseMoment, rounding_variance
from nfab.runtime.core.encode import slices, unscaled, views
from nfab.runtime.core.handoff import Launch, Outcome, Sent
from nfab.wire.contract import ScaleAgreement, write_into
from nfab.wire.registry import REDUCERS, mean_of_ranks
from nfab.wire.segments import nonfinite_sum


def finish_bucket(launch: Launch, world_size: int,
                  inverse_rms: Callable[[str], torch.Tensor | None] | None = None,
                  moment: NoiseMoment | None = None) -> Outcome:
    """Decode `launch`'s groups into its bucket (NaN on every rank if any rank was non-finite: `_spoil_if`).

    `inverse_rms`: the optimizer's preconditioner (`optim.Preconditioner.inverse_rms`), read
    here, before any rank steps, so that a probe's region fidelity compares where it acts.
    `moment`: given, every block-scaled group's rounding variance is recorded for the optimizer
    (`runtime/control/moment.py`)."""
    t0 = time.thread_time()
    buffer = launch.buffer
    table = _control_table(launch, world_size)
    if table is None:  # FP32 only, no word: a non-finite element shows in the reduced sum itself, as in plain DDP
        bad = nonfinite_sum(buffer)
        return Outcome(launch.index, None, bad, (), (), time.thread_time() - t0)
    bad = control.nonfinite(table)
    amax: list[tuple[tuple[str, ...], torch.Tensor]] = []
    saturated: list[torch.Tensor] = []
    probed: list[tuple[Group, torch.Tensor]] = []
    if not _known_true(bad):
        for sent in launch.sent:
            out = _decode_group(launch, sent, table, world_size, amax, saturated)
            if moment is not None:
                _record_variance(moment, sent, world_size)
            if out is not None:
                probed.append((sent.enc.group, out))
    _spoil_if(buffer, bad)
    probe = _probe_sums(launch, probed, inverse_rms) if launch.probe is not None and probed else ()
    return Outcome(launch.index, table, None, tuple(amax), tuple(saturated), time.thread_time() - t0, probe)


def _probe_sums(launch: Launch, probed: list[tuple[Group, torch.Tensor]],
                inverse_rms: Callable[[str], torch.Tensor | None] | None) -> tuple:
    """Per probed group: its parameters and their probe sums (device values, no host read)."""
    assert launch.probe is not None
    ref = launch.probe.future.value()
    out, pos = [], 0
    for group, decoded in probed:
        layout = fidelity.sample_layout(group.lengths, decoded.device, _mask(launch, group))
        est = fidelity.sample(decoded, layout)
        out.append(fidelity.bucket_probe(est, ref[pos : pos + layout.numel], [(s.name, s.region) for s in group.slices],
                                         layout, inverse_rms))
        pos += layout.numel
    return tuple(out)


def _mask(launch: Launch, group: Group) -> tuple[bool, ...] | None:
    """The slices of a lossy group the bucket's probe sampled (as `encode.prepare_group` chose them)."""
    assert launch.probe is not None
    return fidelity.probe_mask([s.region for s in group.slices], launch.probe.regions)


def _control_table(launch: Launch, w: int) -> torch.Tensor | None:
    if launch.rows is not None and launch.ctrl_part is not None:
        return launch.ctrl_part.rows(launch.rows)
    if launch.ctrl is not None:
        return control.table(launch.ctrl, w)
    return None


def _decode_group(launch: Launch, sent: Sent, table: torch.Tensor, w: int,
                  amax: list, saturated: list) -> torch.Tensor | None:
    """Decode one group into its slices; its decoded values when the bucket is probed."""
    enc, buffer = sent.enc, launch.buffer
    group, red = enc.group, REDUCERS[enc.group.key]
    # the W ranks' copies of this group's payload, one row each (a (W, n) tensor reads as a sequence of rows)
    gathered = sent.part.rows(launch.rows) if sent.part is not None and launch.rows is not None else None
    amax_cols = enc.amax_cols.of(table) if enc.amax_cols is not None else None  # (W, slices): each rank's
    if amax_cols is not None:
        assert enc.shared is not None
        agreed = _amax_over_ranks(amax_cols)
        amax.append((tuple(s.name for s in group.slices), unscaled(agreed, launch.loss_scale)))  # kept unscaled
        if gathered is None:  # a rank's own scale never saturates
            saturated.append((agreed > enc.shared).sum())
    if gathered is not None and red.own_scale_when_gathered:  # each row with its own rank's scales
        assert amax_cols is not None
        decode = partial(red.decode_gathered, gathered, amax_cols, group.numel, group.lengths)
    else:
        reduced = red.combine(gathered) if gathered is not None else _value(sent)
        if group.key == FP32:
            if not group.whole:
                write_into(views(buffer, group), reduced)
            return None
        scale_mean = mean_of_ranks(enc.scale_cols.of(table)) if enc.scale_cols is not None else enc.shared
        decode = partial(red.decode, reduced, scale_mean, group.numel, group.lengths, w)
    probed = launch.probe is not None and group.lossy and _mask(launch, group) is not None
    if enc.weights is not None:  # decoded in the preconditioned space: scale back, then write
        out = decode(out=None).mul_(enc.weights)
        write_into(buffer if group.whole else views(buffer, group), out)
    elif group.whole:  # decode straight into the bucket: no temporary, no copy
        out = decode(out=buffer)
    elif not probed:  # decode, scale and write each slice at its offset, one pass
        decode(out=slices(buffer, group))
        return None
    else:  # the probe compares the group's decoded values as one tensor
        out = decode(out=None)
        write_into(views(buffer, group), out)
    return out if probed else None


def _record_variance(moment: NoiseMoment, sent: Sent, w: int) -> None:
    """A block-scaled group's rounding variance per parameter (its agreed codes are `enc.shared`)."""
    enc = sent.enc
    red = REDUCERS[enc.group.key]
    if red.scale_agreement is ScaleAgreement.PER_BLOCK and enc.shared is not None:
        var = rounding_variance(red, enc.shared, enc.group.lengths, w, enc.weights)
        moment.record([s.name for s in enc.group.slices], enc.group.lengths, var)


def _amax_over_ranks(cols: torch.Tensor) -> torch.Tensor:
    """Each slice's max over the W ranks' max |x| (NaN if any is): numpy on the host, the same values."""
    return reads.of(cols.device).amax_rows(cols)


def _value(sent: Sent) -> torch.Tensor:
    assert sent.future is not None
    return sent.future.value()


def _known_true(flag: torch.Tensor | bool) -> bool:
    """The flag's value where reading it costs nothing (a host bool, or a CPU tensor); False
    (decode anyway) elsewhere."""
    if isinstance(flag, bool):
        return flag
    return reads.of(flag.device).known_true(flag)


def _spoil_if(buffer: torch.Tensor, flag: torch.Tensor | bool) -> None:
    """Fill the bucket with NaN when `flag` (a host bool, or a 0-d bool tensor) is set: read on the CPU,
    masked on the device elsewhere.

    Why NaN: plain DDP's reduced bucket is non-finite when any rank's gradient is, and loops rely on
    it -- a loss scaler (`torch.amp.GradScaler`) skips that step and lowers its scale, a
    `clip_grad_norm_(error_if_nonfinite=True)` raises. A lossy codec cannot carry which elements
    were non-finite, so the whole bucket says so, the same on every rank. Zeroing it (before
    2026-12-05) made such a step look finite: the scaler stepped with a zero gradient (AdamW still
    moved the weights by its momentum) and kept the scale that overflowed."""
    if isinstance(flag, bool):
        if flag:
            buffer.fill_(float("nan"))
    else:
        reads.of(flag.device).spoil_if(buffer, flag)
