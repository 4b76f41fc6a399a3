"""Folding a finished step: every bucket's (Launch, Outcome) -> statistics and agreed values.

This is the one place device values come back to the host: once per step, in one copy.
Everything decided from them — skipped step, grad norm, loss, probe cosine, qsum scale
history, which error-feedback residuals to keep — is computed from the all-gathered
control words (identical bits on every rank) with the same host arithmetic in the same
order, so every rank folds to the same result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nfab.runtime import control
from nfab.runtime.handoff import Launch, Outcome
from nfab.runtime.health import HealthEvent
from nfab.runtime.stats import StepStats


@dataclass(slots=True)
class Folded:
    """One folded step: its statistics and what the runtime keeps from it."""

    stats: StepStats
    residuals: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    amax: dict[str, float] = field(default_factory=dict)
    cosine: tuple[torch.Tensor, frozenset[str]] | None = None
    """This rank's cosine of the step's probe and its regions (the next step's first word carries it)."""
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
        # `fallback` flags a safety event (health, capacity, non-finite); the cost gate's
        # steady routing to FP32 where compression does not pay is named in the reason only
        st.fallback = any(why != "cost" for why in self.reasons)
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


def fold_step(step: int, phase: str, launches: list[Launch], outcomes: list[Outcome], world_size: int) -> Folded:
    """The step's statistics and agreed values (see the module doc)."""
    by_index = {o.index: o for o in outcomes}
    pairs = [(la, by_index[la.index]) for la in sorted(launches, key=lambda la: la.index)]
    reads: list[torch.Tensor] = []
    for _, o in pairs:
        reads += [o.table if o.table is not None else o.unsent_bad, *(a for _, a in o.amax), *o.saturated]
    host = iter(read_to_host([t for t in reads if t is not None]))
    st = StepStats(step=step, phase=phase, buckets=len(pairs))
    out = Folded(st)
    grad_sq = 0.0
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
        else:
            bad = next(host)[0] > 0
            st.skipped |= bad
        amax = [(names, next(host)) for names, _ in o.amax]
        st.saturated_slices += sum(int(next(host)[0]) for _ in o.saturated)
        _account(st, la, o)
        for why, region in la.routes.fallbacks:
            out.reasons.setdefault(why, set()).add(region)
        if not bad:
            for sent in la.sent:
                out.residuals.extend(sent.enc.residuals)
            if la.levels is not None:
                out.residuals.extend(la.levels.residuals)
            for names, values in amax:
                out.amax.update(zip(names, values, strict=True))
            if o.cosine is not None and la.probe is not None:
                out.cosine = (o.cosine, la.probe.regions)
    # a skipped step applies no gradient (every bucket is zeroed): its norm is 0, as the
    # health monitor and metrics have always read it, not the finite part of a poisoned sum
    st.grad_norm = 0.0 if st.skipped else math.sqrt(grad_sq / world_size)
    return out


def _account(st: StepStats, la: Launch, o: Outcome) -> None:
    st.wire_bytes += int(round(la.wire_bytes))
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
