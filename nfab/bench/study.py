"""The study: nfab against FP32, fp16 and PowerSGD, quality per byte, in a user's training loop.

Every setting runs every variant (see `studyloop.VARIANTS`) with the same model, data,
seed, optimizer and steps, one after another on this machine, then writes:
- OUT/study.json: the rows (schema `nfab.bench.study`, version 2) — the source of truth;
- OUT/study.md: the tables;
- OUT/report.html with one bytes-vs-quality (Pareto) plot per setting.
`--publish` also copies study.json to bench/study.json and regenerates bench/STUDY.md and
the README's study tables from it (`studydocs`), so no number is copied by hand.

Settings: `resnet18` on digits (SGD), `gpt` nano on stdlib text (AdamW), and `heldout`,
the user-style GPT nfab was not tuned on (`nfab.bench.heldout:user_gpt`, AdamW lr 3e-3,
wd 0.1, batch 16, constant LR): the known case where static sign with error feedback fails.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nfab.bench.studyloop import VARIANTS, RunResult, Setting, run_variants
from nfab.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text

SCHEMA = "nfab.bench.study"
VERSION = 2

SETTINGS: dict[str, Setting] = {
    "resnet18": Setting(
        name="resnet18", model="resnet18", dataset="digits", metric="accuracy",
        model_options={"width": 16, "small_input": True, "num_classes": 10, "in_channels": 1},
        optimizer="sgd", lr=0.05, weight_decay=5e-4, batch_size=32, steps=150, eval_samples=360,
        profile="calibrations/resnet18/profile.json", note="resnet18 width 16 on 8x8 digits, SGD momentum 0.9"),
    "gpt": Setting(
        name="gpt", model="gpt", dataset="stdlib-text", metric="loss", model_options={"size": "nano"},
        data_options={"max_bytes": 2_000_000}, optimizer="adamw", lr=3e-3, weight_decay=0.01, batch_size=16,
        steps=300, profile="calibrations/gpt/profile.json", note="nfab's GPT nano (2 layers, d=128), AdamW"),
    "heldout": Setting(
        name="heldout", model="nfab.bench.heldout:user_gpt", dataset="stdlib-text", metric="loss",
        data_options={"max_bytes": 2_000_000}, optimizer="adamw", lr=3e-3, weight_decay=0.1, batch_size=16,
        steps=300, profile="bench/calibrations/heldout/profile.json",
        note="user-style GPT nfab was not tuned on (nn.MultiheadAttention, tied head), AdamW wd 0.1"),
}
# a second user model, written after the control work had been measured on the first: nothing was chosen on it
SETTINGS["heldout2"] = Setting(
    name="heldout2", model="nfab.bench.heldout2:user_lm", dataset="stdlib-text", metric="loss",
    data_options={"max_bytes": 2_000_000}, optimizer="adamw", lr=1e-3, weight_decay=0.05, batch_size=16,
    steps=300, profile="bench/calibrations/heldout2/profile.json",
    note="a second user model (torch's nn.TransformerEncoder, untied head), AdamW lr 1e-3 wd 0.05")
# a third, written after the noise-corrected moment was worked out on heldout2: plain Adam (beta2 0.999)
SETTINGS["heldout3"] = Setting(
    name="heldout3", model="nfab.bench.heldout3:user_swiglu", dataset="stdlib-text", metric="loss",
    data_options={"max_bytes": 2_000_000}, optimizer="adamw", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999),
    batch_size=16, steps=300, profile="bench/calibrations/heldout3/profile.json",
    note="a third user model (RMSNorm, SwiGLU, SDPA attention, tied head), plain Adam lr 1e-3 (beta2 0.999)")
# the held-out profile (calibrated at W=4 over 300 steps) where it was not calibrated: twice the
# ranks, twice the steps
SETTINGS["heldout-w8"] = dataclasses.replace(SETTINGS["heldout"], name="heldout-w8", world_size=8,
                                             note="the held-out GPT at W=8, its profile calibrated at W=4")
SETTINGS["heldout-w8c"] = dataclasses.replace(SETTINGS["heldout"], name="heldout-w8c", world_size=8,
                                              profile="bench/calibrations/heldout-w8/profile.json",
                                              note="the held-out GPT at W=8, its profile calibrated at W=8")
SETTINGS["heldout-600"] = dataclasses.replace(SETTINGS["heldout"], name="heldout-600", steps=600,
                                              note="the held-out GPT over 600 steps, its profile calibrated over 300")
MIN_RATIO = 8.0
"""Target: nfab's profile sends at least this many times fewer gradient bytes than FP32."""
MAX_LOSS_RISE = 0.01
"""Target (loss settings): final held-out loss at most 1.0 % above FP32."""
MAX_ACC_DROP = 0.01
"""Target (accuracy settings): at most 1.0 point below FP32."""
FAIL_LOSS_RISE = 0.05
"""A static variant 'measurably fails' a loss setting beyond +5 % loss (1 point of accuracy ... x5)."""


@dataclass(kw_only=True, slots=True)
class StudyConfig:
    """What to run."""

    out: Path = Path("bench/study")
    settings: tuple[str, ...] = tuple(SETTINGS)
    variants: tuple[str, ...] = VARIANTS
    steps: int | None = None
    """Steps for every setting (None: each setting's own)."""
    world_size: int | None = None
    """Ranks for every setting (None: each setting's own, 4)."""
    tweaks: dict[str, Any] = field(default_factory=dict)
    """Setting fields replaced in every setting (tests: smaller batches, tiny models)."""
    seeds: tuple[int, ...] = (0,)
    """Every (setting, variant) runs once per seed. The main tables show the study's own seed (the
    first of a new study, an appended study's own); `seed_table` shows the spread over all of them,
    each run paired with FP32 of its seed: at the 1% line one run's rounding noise (±0.3-0.5%) is
    of the order of the differences, so a verdict needs several."""
    append: bool = False
    """Merge into OUT/study.json: rows of other (setting, variant, seed) triples are kept (results do not
    depend on timing: same seeds, same rows); the commands that made them are all listed."""

    def __post_init__(self) -> None:
        bad = [s for s in self.settings if s not in SETTINGS]
        if bad:
            raise ValueError(f"unknown study setting {bad[0]!r} (known: {', '.join(SETTINGS)})")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"unknown study variant {bad[0]!r} (known: {', '.join(VARIANTS)})")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds must be distinct integers >= 0, got {list(self.seeds)}")
        for k, v in (("steps", self.steps), ("world_size", self.world_size)):
            if v is not None and v < 1:
                raise ValueError(f"{k} must be >= 1, got {v}")

    def setting(self, name: str) -> Setting:
        changes = dict(self.tweaks)
        if self.steps is not None:
            changes["steps"] = self.steps
        if self.world_size is not None:
            changes["world_size"] = self.world_size
        return dataclasses.replace(SETTINGS[name], **changes)


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
    quality_ok = d is not None and (d <= MAX_LOSS_RISE if setting["metric"] == "loss" else d >= -MAX_ACC_DROP)
    ratio_ok = (prof["ratio"] or 0.0) >= MIN_RATIO
    v.update(quality_ok=quality_ok, ratio_ok=ratio_ok, met=quality_ok and ratio_ok)
    return {prefix + k: x for k, x in v.items()}


def _previous(cfg: StudyConfig) -> dict[str, Any] | None:
    """The study.json to append to (None when there is none yet)."""
    import json

    path = cfg.out / "study.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA or doc.get("version") != VERSION or not isinstance(doc.get("seed"), int):
        raise ValueError(f"{path} is not a version-{VERSION} study: cannot append to it")
    return doc


def run_study(cfg: StudyConfig, command: str = "", log: Callable[[str], None] = print,
              root: Path | None = None) -> dict[str, Any]:
    """Every setting x variant; writes OUT/study.json, OUT/study.md, OUT/report.html and the Pareto PNGs."""
    from nfab.bench import studydocs

    cfg.out.mkdir(parents=True, exist_ok=True)
    old = _previous(cfg) if cfg.append else None  # checked before hours of runs, not after
    t0 = time.perf_counter()
    rows: list[RunResult] = []
    settings = {name: cfg.setting(name) for name in cfg.settings}
    for name, setting in settings.items():
        for seed in cfg.seeds:
            for row in run_variants(setting, cfg.variants, seed=seed, root=root):
                log(f"{name} {row.variant} seed {seed}: " + (
                    f"loss {row.eval_loss:.4f}, {row.ratio:.1f}x" if row.ok and row.ratio else f"FAILED {row.error}")
                    + f" ({row.wall_s:.0f} s)")
                rows.append(row)
    primary = old["seed"] if old else cfg.seeds[0]
    new_rows = [asdict(r) for r in rows]
    done = {(r["setting"], r["variant"], r["seed"]) for r in new_rows}
    kept = [{**r, "seed": r.get("seed", primary)} for r in (old or {}).get("rows", [])]
    kept = [r for r in kept if (r["setting"], r["variant"], r["seed"]) not in done]
    order = {(n, v): i for i, (n, v) in enumerate((n, v) for n in SETTINGS for v in VARIANTS)}
    doc: dict[str, Any] = {
        "schema": SCHEMA, "version": VERSION,
        "command": " ; ".join([*([old["command"]] if old else []), command]),
        "total_s": round(time.perf_counter() - t0 + (old["total_s"] if old else 0.0), 1),
        "seed": primary,
        "settings": {**(old or {}).get("settings", {}), **{name: asdict(s) for name, s in settings.items()}},
        "note": "one user-style DDP loop per run (constant LR), W gloo ranks on loopback, same seed for every "
                "variant; nfab variants attach with cost_model=None (on loopback the cost gate would send every "
                "bucket to FP32); PowerSGD gets one bucket (it aborts on gloo with several)",
        "rows": sorted(kept + new_rows, key=lambda r: (order.get((r["setting"], r["variant"]), 1 << 30), r["seed"])),
    }
    doc["settings"] = {n: doc["settings"][n] for n in SETTINGS if n in doc["settings"]}
    doc["verdicts"] = judge(doc)
    atomic_write_json(cfg.out / "study.json", doc)
    atomic_write_text(cfg.out / "study.md", studydocs.study_markdown(doc, images=True))
    for name in settings:
        atomic_write_bytes(cfg.out / f"pareto_{name}.png", studydocs.pareto_png(doc, name))
    atomic_write_text(cfg.out / "report.html", studydocs.report_html(doc))
    return doc
