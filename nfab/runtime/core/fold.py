"""Folding a finished step: every bucket's (Launch, Outcome) -> statistics and agreed values.

This is the one place device values come back to the host: once per step, in one copy.
Everything decided from them — skipped step, grad norm, loss, probe cosine, per-region
probe fidelity, qsum scale history, which error-feedback residuals to keep — is computed from the all-gathered
control words (identical bits on every rank) with the same host arithmetic in the same
order, so every rank folds to the same result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from nfab.runtime.control import fidelity
from nfab.runtime.control import word as control
from nfab.runtime.control.fidelity import RegionFidelity
from nfab.runtime.control.health import HealthEvent
from nfab.runtime.core.handoff import Launch, Outcome
from nfab.runtime.stats import StepStats
from nfab.wire.registry import allreduce_factor


@dataclass(slots=True)
class Folded:
    """One folded step: its statistics and what the runtime keeps from it."""

    stats: StepStats
    residuals: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    amax: dict[str, float] = field(default_factory=dict)
    cosine: tuple[float, frozenset[str]] | None = None
    """This rank's plain cosine over every parameter the step probed, and their regions:
    the next step's first word carries it."""
    fidelity_local: dict[str, RegionFidelity] = field(default_factory=dict)
    """This rank's per-region fidelity of the step's probes: the next step's first word carries it."""
    fidelity: dict[str, RegionFidelity] = field(default_factory=dict)
    """The previous step's per-region fidelity, agreed over ranks from this step's first word."""
    reasons: dict[str, set[str]] = field(default_factory=dict)

    def record(self, events: list[HealthEvent]) -> None:
        """Add the health events decided from this step to its statistics and fallback reasons."""
        st = self.stats
        if st.skipped:
            self.reasons.setdefault("nonfinite", set())
        for e in events:
            st.events.append(f"{e.kind}:{e.reason}:{','.join(e.regions)}")
            if e.kind == "fallback":
                self.reasons.setdefault(e.reason, set()).update(e.regions)
        st.flag_fallbacks(self.reasons.keys())
        st.fallback_reason = "; ".join(
            f"{why}({','.join(sorted(regs))})" if regs else why for why, regs in sorted(self.reasons.items()))


def read_to_host(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values as host floats, in ONE device-to-host copy."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors]).tolist()
    out, pos = [], 0
    for t in tensors:
        out.append(flat[pos : pos + t.numel()])
        pos += t.numel()
    return out


def fidelity_word(fidelity: dict[str, RegionFidelity],
                  device: torch.device) -> tuple[tuple[str, ...], torch.Tensor]:
    """This rank's per-region fidelity as control-word values (regions sorted, a
    `RegionFidelity.as_row` each), on `device`."""
    names = tuple(sorted(fidelity))
    vals = [v for r in names for v in fidelity[r].as_row()]
    # host values made at the fold: copied without waiting for the device (the hook body never syncs)
    return names, torch.tensor(vals, dtype=torch.float32, device="cpu").to(device, non_blocking=True)


def fidelity_columns(word: control.Builder, fidelity: dict[str, RegionFidelity],
                     device: torch.device) -> tuple[tuple[str, ...], control.Columns] | None:
    """Append this rank's region fidelity to the word being built; its regions and columns."""
    if not fidelity:
        return None
    names, values = fidelity_word(fidelity, device)
    return names, word.add(values)


def agree_fidelity(rows: list[list[float]], names: tuple[str, ...], cols: control.Columns) -> dict[str, RegionFidelity]:
    """The ranks' per-region fidelity, agreed: cosine and relative error averaged in rank
    order, preconditioned only where every rank was (identical on every rank)."""
    k = len(fidelity.ROW_FIELDS)
    out: dict[str, RegionFidelity] = {}
    for i, region in enumerate(names):
        each = [RegionFidelity.from_row(r[cols.start + i * k : cols.start + (i + 1) * k]) for r in rows]
        n = len(each)
        out[region] = RegionFidelity(sum(f.cosine for f in each) / n, sum(f.rel_error for f in each) / n,
                                     all(f.preconditioned for f in each), max(f.samples for f in each))
    return out


def fold_step(step: int, phase: str, launches: list[Launch], outcomes: list[Outcome], world_size: int) -> Folded:
    """The step's statistics and agreed values (see the module doc)."""
    by_index = {o.index: o for o in outcomes}
    pairs = [(la, by_index[la.index]) for la in sorted(launches, key=lambda la: la.index)]
    reads: list[torch.Tensor] = []
    for _, o in pairs:
        reads += [o.table if o.table is not None else o.unsent_bad, *(a for _, a in o.amax), *o.saturated,
                  *(sums for _, sums in o.probe)]
    host = iter(read_to_host([t for t in reads if t is not None]))
    st = StepStats(step=step, phase=phase, buckets=len(pairs))
    out = Folded(st)
    grad_sq = 0.0
    params: dict[str, fidelity.ParamProbe] = {}
    for la, o in pairs:
        if o.table is not None:
            flat = next(host)
            width = len(flat) // world_size
            rows = [flat[r * width : (r + 1) * width] for r in range(world_size)]
            agreed = control.agree(rows)
            bad = agreed.nonfinite
            st.skipped |= bad or control.carried_nonfinite(rows)
            grad_sq += agreed.grad_sq
            if st.loss is None:
                st.loss = agreed.loss
            if agreed.cosine is not None:
                st.fidelity_cosine = agreed.cosine
            if la.fidelity_cols is not None and not out.fidelity:
                out.fidelity = agree_fidelity(rows, *la.fidelity_cols)
        else:
            bad = next(host)[0] > 0
            st.skipped |= bad
        amax = [(names, next(host)) for names, _ in o.amax]
        st.saturated_slices += sum(int(next(host)[0]) for _ in o.saturated)
        probed = [(meta, next(host)) for meta, _ in o.probe]
        _account(st, la, o, world_size)
        for why, region in la.routes.fallbacks:
            out.reasons.setdefault(why, set()).add(region)
        if not bad:
            for sent in la.sent:
                out.residuals.extend(sent.enc.residuals)
            if la.levels is not None:
                out.residuals.extend(la.levels.residuals)
            for names, values in amax:
                out.amax.update(zip(names, values, strict=True))
            for meta, flat in probed:
                params.update(fidelity.read_params(meta, flat))
    # every probed parameter of the step, summed per region in name order (bucket-independent)
    cosine, out.fidelity_local = fidelity.fold_probes(params)
    if cosine is not None:
        out.cosine = (cosine, frozenset(p.region for p in params.values()))
    st.region_cosine = {k: v.cosine for k, v in sorted(out.fidelity.items())}
    # a skipped step applies no gradient (its buckets are non-finite, no optimizer steps on them): its norm
    # is 0, as the health monitor and metrics have always read it, not the finite part of a poisoned sum
    st.grad_norm = 0.0 if st.skipped else math.sqrt(grad_sq / world_size)
    return out


def _account(st: StepStats, la: Launch, o: Outcome, world_size: int) -> None:
    st.wire_bytes += int(round(la.wire_bytes))
    if la.probe is not None:  # sent as one FP32 all-reduce of its samples (counted in wire_bytes too)
        st.probe_wire_bytes += int(round(allreduce_factor(world_size) * la.probe.numel * 4))
    st.baseline_wire_bytes += int(round(la.baseline_bytes))
    if la.levels is not None:
        st.intra_node_bytes += int(round(la.levels.intra_bytes))
        st.inter_node_bytes += int(round(la.levels.inter_bytes))
    for label, n in la.elements:
        st.route_elements[label] = st.route_elements.get(label, 0) + n
    for name, s in (*la.phases, ("decode", o.callback_time_s)):
        st.hook_phases[name] = st.hook_phases.get(name, 0.0) + s
        st.hook_time_s += s
    st.scale_rounds += la.scale_rounds
    st.collectives += la.collectives


def drop_ef_residuals(residuals: dict[str, torch.Tensor], regions: dict[str, str], events: list[HealthEvent]) -> None:
    """Forget the residuals of regions whose error feedback the drift monitor switched off:
    under Adam-style optimizers they are what bent the update."""
    off = {r for e in events if e.kind == "ef_off" for r in e.regions}
    for name in [n for n in residuals if regions.get(n) in off]:
        del residuals[name]


def carried_state(cosine: tuple[float, frozenset[str]] | None,
                  fidelity: dict[str, RegionFidelity]) -> dict[str, Any]:
    """The probe values the next step's first word will carry, for a checkpoint."""
    return {"cosine": None if cosine is None else [cosine[0], sorted(cosine[1])],
            "fidelity": {r: f.as_row() for r, f in sorted(fidelity.items())}}


def load_carried(state: dict[str, Any] | None) -> tuple[tuple[float, frozenset[str]] | None, dict[str, RegionFidelity]]:
    """`carried_state`'s inverse (absent in older checkpoints: nothing carried)."""
    if not state:
        return None, {}
    c = state.get("cosine")
    cosine = None if c is None else (float(c[0]), frozenset(c[1]))
    fid = {r: RegionFidelity.from_row(v) for r, v in state["fidelity"].items()}
    return cosine, fid
