"""Fitting a profile from a calibration table: a pure function of (table, tolerances).

Per phase and region class the fit takes the cheapest route (wire bits per element at
the calibrated W) that is exact at W and whose fidelity and loss delta meet the
tolerances (a trial's held-out and training loss deltas both within `tol_loss`: early in
training one alone is noisy; the held-out one judged, as validation judges its gap, down to what
one held-out prediction moves: `loss_tolerance`); a route without a trial passes only on a very high cosine. Each phase
runs with one error-feedback setting: the one whose validated routes send fewer bytes
(a tie keeps EF off). Health thresholds come from the reference run's own statistics.

Under an adaptive optimizer (anything but SGD) replay fidelity decides alone: a K-step trial
cannot see the harm an unfaithful route builds up over a run under Adam's per-coordinate
normalisation (held-out GPT: sign passed its 20-step trials at ~0 and cost +5..7% over 300
steps). There replay fidelity is measured where the optimizer acts — estimate and truth both
divided by the phase's sqrt(v)+eps, and block-scaled qsum rounding in that space as the hook
does — and separates the routes (held-out GPT, 4 phases x 5 regions): sign 0.01-0.92 (0.33-0.73
on the linear layers), per-tensor q4 0.001-0.95 and q8 0.01-1.0, block-scaled bq2 0.78-0.98
(+0.8% over 300 steps in the user loop), bq3 0.94-0.995 (+0.9%), bq4 0.985-0.999.
So there every lossy route needs `ADAPTIVE_COSINE` and passes on it without a trial; what
builds up over the run is then validation's to see. Among routes within `BITS_SLACK` of the
cheapest passing one's bits, the most faithful is chosen: 2 % fewer bytes are not worth a
coarser block.
"""

from __future__ import annotations

import datetime as _dt
import math
import sys
from typing import Any

import pandas as pd
import torch

from nfab import __version__
from nfab.calibrate.table import check_columns
from nfab.profile.schema import REGIONS, Health, ModelRef, Phase, PhaseStart, Profile, WorldRange
from nfab.wire.registry import candidates
from nfab.wire.routes import ROUTES

TOL_COSINE = 0.3
"""Default: a route's estimate must point within ~73 degrees of the true mean gradient."""
TOL_LOSS = 0.02
"""Default: at most 2 % higher held-out loss than FP32 after a K-step trial."""
MAX_REL_ERROR = 2.0
"""A route whose error is more than twice the true gradient's norm is noise with a bias."""
HIGH_COSINE = 0.99
"""A route with no trial passes only at or above this cosine (e.g. bf16 on a tiny region)."""
ADAPTIVE_COSINE = 0.75
"""Under an adaptive optimizer a lossy route needs at least this (preconditioned) replay cosine, and
passes on it without a trial: below the 0.78-0.98 of block-scaled 2-bit (static bq2 everywhere ran
+0.8% over 300 steps of the held-out GPT's user loop), above sign's 0.33-0.73 on its big regions."""
NOT_UNDER_ADAPTIVE = ("sign",)
"""Routes the fit never chooses under an adaptive optimizer (the table still measures them). Sign
sends one magnitude per parameter, so Adam's second moment is built from that magnitude instead of
each coordinate's: a feedback the FP32 replay cannot see. Held-out GPT, user loop: static sign
+5.5%; the calibrated profile with sign on the norms and biases (replay cosine 0.76-0.92) +1.09%,
with bq2 there +0.82%."""
BITS_SLACK = 0.05
"""Passing routes within this fraction of the cheapest one's bits count as equally cheap: the most
faithful (highest replay cosine) of them is chosen."""
MARGIN = 1.5
"""Health thresholds are the reference run's worst ratio times this margin."""
MAX_WORLD = 1 << 16


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def passes(row: pd.Series | dict[str, Any], tol_cosine: float, tol_loss: float, high_cosine: float,
           max_rel_error: float = MAX_REL_ERROR) -> bool:
    """Does one table row (or a row under construction) meet the tolerances? A route without a
    trial passes only at `high_cosine`; with one, both its loss deltas must be within `tol_loss`."""
    if row["route"] == "fp32":
        return True
    if not bool(row.get("capacity_ok", True)):
        return False
    cos, delta = _num(row["cosine"]), _num(row["loss_delta"])
    if cos is None or cos < tol_cosine:
        return False
    rel = _num(row.get("rel_error"))
    if rel is not None and rel > max_rel_error:
        return False
    if delta is None:
        return cos >= high_cosine
    train = _num(row.get("train_loss_delta"))  # the trial must not hurt the training loss either
    return delta <= loss_tolerance(row, tol_loss) and (train is None or train <= tol_loss)


def loss_tolerance(row: pd.Series | dict[str, Any], tol_loss: float) -> float:
    """The held-out loss delta a trial may show: `tol_loss`, or the relative gap one held-out prediction
    makes (`loss_resolved`, validation's resolution floor) where that is larger (tables without it: `tol_loss`)."""
    resolved = _num(row.get("loss_resolved"))
    return max(tol_loss, resolved) if resolved is not None and math.isfinite(resolved) else tol_loss


def adaptive(optimizer: str | None) -> bool:
    """Is the optimizer family adaptive (per-coordinate step sizes: AdamW)? Unknown counts as SGD-like."""
    return optimizer is not None and optimizer not in ("sgd", "", "auto")


def fidelity_bars(optimizer: str | None, tol_cosine: float, high_cosine: float) -> tuple[float, float]:
    """(cosine a trialled route needs, cosine that passes without a trial) under this optimizer family."""
    if adaptive(optimizer):
        return max(tol_cosine, ADAPTIVE_COSINE), min(high_cosine, max(tol_cosine, ADAPTIVE_COSINE))
    return tol_cosine, high_cosine


def trials_can_run(optimizer: str | None, tol_cosine: float, high_cosine: float = HIGH_COSINE) -> bool:
    """Can any short trial change the fit? Not when the bar a trialled route needs is at or above the
    cosine that passes without a trial (an adaptive optimizer: AdamW): then replay fidelity decides
    alone, the search runs no trial, and the CLI must not show a trials stage as if it had run one."""
    bar, high = fidelity_bars(optimizer, tol_cosine, high_cosine)
    return high > bar


def adaptive_cosine_note(profile: Profile, asked: float | None) -> str | None:
    """One line when the cosine bar asked for sits below the adaptive optimizer's, which then holds:
    `--tol-cosine 0.5` under AdamW fits exactly what the default does, and should say so."""
    used = profile.provenance.get("tol_cosine")
    if asked is None or used is None or asked >= used:
        return None
    return (f"note: --tol-cosine {asked} is below the {used} every lossy route needs under an adaptive "
            f"optimizer (ADAPTIVE_COSINE): the fit used {used}")


def optimizer_of(table: pd.DataFrame, meta: dict[str, Any] | None) -> str | None:
    """The optimizer family the table was measured under (meta first, then the table's column)."""
    opt = (meta or {}).get("optimizer")
    if isinstance(opt, dict) and opt.get("name"):
        return str(opt["name"])
    if "optimizer" in table.columns and len(table):
        return str(table["optimizer"].iloc[0])
    return None


def _choose(rows: pd.DataFrame, tol_cosine: float, tol_loss: float, high_cosine: float) -> dict[str, Any]:
    """The cheapest passing route among one (phase, region, EF) group's rows (the most faithful of
    those within BITS_SLACK of the cheapest); fp32 if none."""
    ok = [r for _, r in rows.iterrows() if passes(r, tol_cosine, tol_loss, high_cosine)]
    if not ok:
        fp = rows[rows["route"] == "fp32"]
        ok = [fp.iloc[0]] if len(fp) else []
    if not ok:
        return {"route": "fp32", "bits_per_element": None, "cosine": 1.0, "loss_delta": None}
    order = {r: i for i, r in enumerate(ROUTES)}
    cheapest = min(float(r["bits_per_element"]) for r in ok)
    near = [r for r in ok if float(r["bits_per_element"]) <= cheapest * (1 + BITS_SLACK)]
    best = min(near, key=lambda r: (-(_num(r["cosine"]) or 0.0), float(r["bits_per_element"]),
                                    order.get(r["route"], 99)))
    return {"route": str(best["route"]), "bits_per_element": _num(best["bits_per_element"]),
            "cosine": _num(best["cosine"]), "loss_delta": _num(best["loss_delta"])}


def _numel(rows: pd.DataFrame) -> float:
    return float(rows["numel"].iloc[0]) if "numel" in rows.columns and len(rows) else 1.0


def fit_phase(phase_rows: pd.DataFrame, tol_cosine: float, tol_loss: float,
              high_cosine: float = HIGH_COSINE) -> tuple[bool, dict[str, dict[str, Any]]]:
    """(error feedback, {region: choice}) for one phase's rows."""
    best: tuple[float, bool, dict[str, dict[str, Any]]] | None = None
    for ef in (False, True):
        rows = phase_rows[phase_rows["error_feedback"].astype(bool) == ef]
        if rows.empty:
            continue
        choice, cost = {}, 0.0
        for region, group in rows.groupby("region", sort=False):
            c = _choose(group, tol_cosine, tol_loss, high_cosine)
            choice[str(region)] = c
            fp32_bits = group.loc[group["route"] == "fp32", "bits_per_element"]
            bits = c["bits_per_element"] if c["bits_per_element"] is not None else (
                float(fp32_bits.iloc[0]) if len(fp32_bits) else 32.0)
            cost += bits * _numel(group)
        if best is None or cost < best[0]:
            best = (cost, ef, choice)
    if best is None:
        return False, {}
    _, ef, choice = best
    if all(c["route"] == "fp32" for c in choice.values()):
        ef = False  # nothing lossy: EF would only cost memory
    return ef, choice


def world_range(routes: set[str]) -> WorldRange:
    """W in [1, max]: the largest W at which every route still has a reducer with capacity."""

    def ok(w: int) -> bool:
        return all(any(r.capacity(w).ok for r in candidates(route)) for route in routes)

    if ok(MAX_WORLD):
        return WorldRange(min=1, max=MAX_WORLD)
    lo, hi = 1, MAX_WORLD  # ok(lo), not ok(hi): capacity only shrinks as W grows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return WorldRange(min=1, max=lo)


def _max_ratio(values: list[float], beta: float, skip: int) -> float:
    """Largest value / running EMA baseline (as the health monitor computes it) after `skip` steps."""
    base, worst = None, 1.0
    for i, v in enumerate(values):
        if not math.isfinite(v):
            continue
        if base is not None and i >= skip and base > 0:
            worst = max(worst, v / base)
        base = v if base is None else beta * base + (1 - beta) * v
    return worst


def fit_health(reference: dict[str, Any] | None, min_cosine: float | None) -> Health:
    """Thresholds from the reference run: its worst loss and grad-norm ratio x MARGIN."""
    d = Health()
    kwargs: dict[str, Any] = {}
    if reference and reference.get("loss") and reference.get("grad_norm"):
        # a step without a finite value (no loss observed: a loop that never calls observe_loss) is None
        loss = [math.nan if v is None else float(v) for v in reference["loss"]]
        norm = [math.nan if v is None else float(v) for v in reference["grad_norm"]]
        kwargs["loss_spike_ratio"] = round(max(1.5, MARGIN * _max_ratio(loss, d.baseline_beta, d.warmup_steps)), 3)
        kwargs["grad_norm_jump"] = round(max(2.0, MARGIN * _max_ratio(norm, d.baseline_beta, d.warmup_steps)), 3)
    if min_cosine is not None:
        kwargs["min_fidelity_cosine"] = probe_floor(min_cosine)
    return Health(**kwargs)


def probe_floor(cosine: float) -> float:
    """`Health.min_fidelity_cosine` for routes whose lowest healthy fidelity is `cosine`: half of it, at least 0.05."""
    return round(max(0.05, 0.5 * cosine), 3)


def fit_profile(
    table: pd.DataFrame,
    tol_cosine: float = TOL_COSINE,
    tol_loss: float = TOL_LOSS,
    *,
    meta: dict[str, Any] | None = None,
    high_cosine: float = HIGH_COSINE,
    provenance: dict[str, Any] | None = None,
) -> Profile:
    """The operating profile a calibration table supports at these tolerances."""
    check_columns(table)
    meta = meta or {}
    optimizer = optimizer_of(table, meta)
    tol_cosine, high_cosine = fidelity_bars(optimizer, tol_cosine, high_cosine)
    if adaptive(optimizer):
        table = table[~table["route"].isin(NOT_UNDER_ADAPTIVE)]
    starts = table.groupby("phase", sort=False).agg(step=("step", "min"), fraction=("phase_fraction", "min"))
    starts = starts.sort_values("step")
    phases, evidence, chosen_cos = [], {}, []
    for i, (name, st) in enumerate(starts.iterrows()):
        ef, choice = fit_phase(table[table["phase"] == name], tol_cosine, tol_loss, high_cosine)
        routes = {r: choice[r]["route"] for r in REGIONS if r in choice}
        fraction = 0.0 if i == 0 else round(float(st["fraction"]), 6)
        phases.append(Phase(name=str(name), start=PhaseStart(fraction=fraction), routes=routes, error_feedback=ef))
        evidence[str(name)] = {r: choice[r] for r in routes}
        chosen_cos += [c["cosine"] for c in choice.values() if c["route"] != "fp32" and c["cosine"] is not None]
    used = {r for p in phases for r in p.routes.values()}
    model = meta.get("model") or (str(table["model"].iloc[0]) if "model" in table.columns else "any")
    prov = {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "nfab_version": __version__,
        "torch_version": torch.__version__,
        "command": " ".join(sys.argv),
        "tol_cosine": tol_cosine,
        "tol_loss": tol_loss,
        "high_cosine": high_cosine,
        "adaptive_optimizer": adaptive(optimizer),
        "bits_slack": BITS_SLACK,
        "calibrated": {k: meta[k] for k in ("model", "model_options", "dataset", "data_options", "world_size",
                                            "optimizer", "schedule", "accum_steps", "precision",
                                            "steps", "run_steps", "trial_steps", "ef_steps", "batch_size", "seed",
                                            "command", "loss", "eval_data", "collate", "parameters",
                                            "nfab_version", "torch_version", "created") if k in meta},
        **(provenance or {}),
    }
    return Profile(
        model=ModelRef(name=str(model), signature=meta.get("signature")),
        phases=tuple(phases),
        world_size=world_range(used),
        health=fit_health(meta.get("reference"), min(chosen_cos) if chosen_cos else None),
        noise_moment=bool(meta.get("noise_moment", False)),  # tables written before it: not modelled
        evidence=evidence,
        provenance=prov,
    )
