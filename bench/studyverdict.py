"""How the study's rows are judged: each run against FP32 of its own seed, and the targets.

Pure functions of the published JSON (`bench/study.json`): the renderer and the command both use
them, and neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bench.studyspec import FAIL_LOSS_RISE, MAX_ACC_DROP, MAX_LOSS_RISE, MIN_RATIO, VARIANTS


def quality_delta(setting: dict[str, Any], row: dict[str, Any], fp32: dict[str, Any]) -> float | None:
    """Loss settings: relative loss change vs FP32; accuracy settings: accuracy change in points (fraction)."""
    if not row.get("ok") or not fp32.get("ok"):
        return None
    if setting["metric"] == "accuracy":
        return (row["eval_accuracy"] or 0.0) - (fp32["eval_accuracy"] or 0.0)
    return row["eval_loss"] / fp32["eval_loss"] - 1.0


def row_seed(doc: dict[str, Any], row: dict[str, Any]) -> int:
    """The seed a row ran with (rows written before seeds were recorded ran with the study's seed)."""
    return int(row.get("seed", doc.get("seed", 0)))


def main_rows(doc: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """One setting's rows of the study's own seed: the main tables, plots and verdicts."""
    return [r for r in doc["rows"] if r["setting"] == name and row_seed(doc, r) == doc.get("seed", 0)]


@dataclass(frozen=True, slots=True)
class SeedSpread:
    """One variant's quality delta vs FP32 over seeds, each run paired with FP32 of its own seed."""

    variant: str
    seeds: tuple[int, ...]
    deltas: tuple[float, ...]
    ratio: float | None
    """Mean fewer-bytes factor over those runs."""

    @property
    def mean(self) -> float:
        return sum(self.deltas) / len(self.deltas)

    @property
    def sd(self) -> float:
        """Sample standard deviation (0 for one seed)."""
        n = len(self.deltas)
        return 0.0 if n < 2 else (sum((d - self.mean) ** 2 for d in self.deltas) / (n - 1)) ** 0.5


def seed_spread(doc: dict[str, Any], name: str) -> list[SeedSpread]:
    """Per variant (study order): the paired deltas of every seed that has both it and FP32."""
    setting = doc["settings"][name]
    by_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for r in doc["rows"]:
        if r["setting"] == name:
            by_seed.setdefault(row_seed(doc, r), {})[r["variant"]] = r
    out = []
    for variant in VARIANTS:
        seeds, deltas, ratios = [], [], []
        for seed in sorted(by_seed):
            rows = by_seed[seed]
            if variant in rows and "fp32" in rows and variant != "fp32":
                d = quality_delta(setting, rows[variant], rows["fp32"])
                if d is not None:
                    seeds.append(seed)
                    deltas.append(d)
                    ratios.append(rows[variant]["ratio"] or 0.0)
        if seeds:
            out.append(SeedSpread(variant, tuple(seeds), tuple(deltas), sum(ratios) / len(ratios)))
    return out


def judge(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per setting: the profile against the targets, and which static variants measurably fail.

    Where the profile ran with several seeds, its quality is judged on the mean paired delta
    (`profile_delta_mean`, with `profile_delta_sd` and `profile_seeds`); otherwise on the one run.
    The profile with the noise-corrected second moment (`profile-nm`) is judged the same way, its
    keys prefixed `nm_`."""
    out = []
    for name, setting in doc["settings"].items():
        rows = {r["variant"]: r for r in main_rows(doc, name)}
        fp32 = rows.get("fp32")
        if fp32 is None or not fp32["ok"]:
            continue
        verdict: dict[str, Any] = {"setting": name, "failing_static": []}
        for variant, r in rows.items():
            d = quality_delta(setting, r, fp32)
            bad = d is None or (d > FAIL_LOSS_RISE if setting["metric"] == "loss" else d < -5 * MAX_ACC_DROP)
            if variant in ("sign", "sign-ef") and bad:
                verdict["failing_static"].append(variant)
        caught = rows.get("sign-ef")
        if caught is not None and caught["ok"] and setting["metric"] == "loss":
            # forced error feedback under AdamW: the monitor must act (events) and hold the loss
            d = quality_delta(setting, caught, fp32)
            verdict.update(monitor_events=len(caught.get("health_events") or []), monitor_delta=d,
                           monitor_ok=bool(caught.get("health_events")) and d is not None and d <= FAIL_LOSS_RISE)
        spreads = {s.variant: s for s in seed_spread(doc, name)}
        verdict.update(_profile_verdict(setting, rows, fp32, spreads, "profile", ""))
        verdict.update(_profile_verdict(setting, rows, fp32, spreads, "profile-nm", "nm_"))
        out.append(verdict)
    return out


def loss_tolerance(setting: dict[str, Any], fp32: dict[str, Any]) -> float:
    """The relative loss rise a loss setting allows: MAX_LOSS_RISE, or what one held-out prediction
    moves FP32's final loss where that is more (ln(C) / n nats over its `eval_samples` predictions of
    `classes` classes), as calibration's validation judges a gap (`nfab.calibrate.validate.resolution`):
    on a classifier whose loss goes to ~0.013 on 360 digits, 1% is 0.00013 nats, a fiftieth of one digit."""
    classes, n, loss = setting.get("classes") or 0, setting.get("eval_samples") or 0, fp32.get("eval_loss")
    if classes < 2 or n < 1 or not loss or not math.isfinite(loss) or loss <= 0:
        return MAX_LOSS_RISE
    return max(MAX_LOSS_RISE, math.log(classes) / n / loss)


def _profile_verdict(setting: dict[str, Any], rows: dict[str, dict[str, Any]], fp32: dict[str, Any],
                     spreads: dict[str, SeedSpread], variant: str, prefix: str) -> dict[str, Any]:
    """A profile variant against the targets (keys prefixed by `prefix`); empty when it did not run."""
    prof = rows.get(variant)
    if prof is None or not prof["ok"]:
        return {}
    d = quality_delta(setting, prof, fp32)
    v: dict[str, Any] = {"profile_delta": d, "profile_ratio": prof["ratio"]}
    spread = spreads.get(variant)
    if spread is not None and len(spread.seeds) > 1:
        d = spread.mean
        v.update(profile_delta_mean=d, profile_delta_sd=spread.sd, profile_seeds=list(spread.seeds))
    allowed = loss_tolerance(setting, fp32)
    if allowed > MAX_LOSS_RISE:
        v["judged_at"] = allowed
    quality_ok = d is not None and (d <= allowed if setting["metric"] == "loss" else d >= -MAX_ACC_DROP)
    ratio_ok = (prof["ratio"] or 0.0) >= MIN_RATIO
    v.update(quality_ok=quality_ok, ratio_ok=ratio_ok, met=quality_ok and ratio_ok)
    return {prefix + k: x for k, x in v.items()}
