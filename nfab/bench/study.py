"""Accuracy study: FP32, static sign (with and without error feedback) and the calibrated
profile, side by side on the same model, data, seed and steps, each run through the real
`nfab train` CLI, then one `nfab report` over all of them.

Every compressed run uses `comm.cost_model=none`, and the profile runs a copy of the
shipped profile with `fallback.cost_gate: false`: on loopback the measured cost model
finds compression never pays and would send every bucket to FP32, and its noisy latency
terms would pick between signgather and signcount by chance. Without a cost model the
runtime takes the reducer with the fewest wire bytes, so the study measures accuracy and
traffic, deterministically. The results say so.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from nfab.errors import NfabError
from nfab.fsutil import atomic_write_json, atomic_write_text
from nfab.report.artifacts import load_run


@dataclass(frozen=True, slots=True)
class StudyModel:
    """A model in the study: its train config, default steps and the metric that judges it."""

    config: str
    steps: int
    metric: str
    """`accuracy` (final eval accuracy, higher is better) or `loss` (final eval loss, lower is better)."""
    profile: str


MODELS: dict[str, StudyModel] = {
    "resnet18": StudyModel(config="configs/resnet18-digits.yaml", steps=150, metric="accuracy",
                           profile="calibrations/resnet18/profile.json"),
    "gpt": StudyModel(config="configs/gpt-nano-stdlib.yaml", steps=300, metric="loss",
                      profile="calibrations/gpt/profile.json"),
}
STATIC_VARIANTS: dict[str, list[str]] = {
    "fp32": ["--fp32"],
    "sign": ["--route", "sign", "comm.error_feedback=false", "comm.cost_model=none"],
    "sign-ef": ["--route", "sign", "comm.cost_model=none"],
}
VARIANTS = (*STATIC_VARIANTS, "profile", "refit")
QUICK_STEPS = 40
MIN_RATIO = 8.0
"""Target: profile-guided runs send at least this many times fewer gradient bytes than FP32."""
MAX_ACC_DROP = 0.01
"""Target (accuracy models): at most 1.0 accuracy point below FP32."""
MAX_LOSS_RISE = 0.03
"""Target (loss models): final eval loss at most 3% above FP32."""


@dataclass(kw_only=True, slots=True)
class StudyConfig:
    """What to run; every run is `nfab train` with these settings."""

    out: Path = Path("bench/study")
    models: tuple[str, ...] = ("resnet18", "gpt")
    steps: int | None = None
    """Steps for every model (None: each model's default, 150 resnet18 / 300 gpt)."""
    quick: bool = False
    """QUICK_STEPS steps per run (for tests and smoke checks)."""
    nproc: int = 4
    extra_profiles: dict[str, str] = field(default_factory=dict)
    """model -> another profile (e.g. a refit) run as variant `refit`, also with the cost gate off."""
    overrides: tuple[str, ...] = ()
    """Extra `key=value` train overrides for every run (tests: smaller batches)."""
    variants: tuple[str, ...] | None = None
    """Run only these variants (fp32, sign, sign-ef, profile, refit); None: all."""

    def __post_init__(self) -> None:
        unknown = [m for m in (*self.models, *self.extra_profiles) if m not in MODELS]
        if unknown:
            raise ValueError(f"unknown study model {unknown[0]!r} (known: {', '.join(MODELS)})")
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        bad = [v for v in self.variants or () if v not in VARIANTS]
        if bad:
            raise ValueError(f"unknown study variant {bad[0]!r} (known: {', '.join(VARIANTS)})")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")

    def steps_for(self, model: str) -> int:
        if self.steps is not None:
            return self.steps
        return QUICK_STEPS if self.quick else MODELS[model].steps


@dataclass(slots=True)
class StudyRow:
    """One run's outcome (from its summary.json and metrics.parquet)."""

    model: str
    variant: str
    run_dir: str
    steps: int
    ok: bool
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    wire_mb: float | None = None
    baseline_wire_mb: float | None = None
    compression_ratio: float | None = None
    fallback_steps: int | None = None
    skipped_steps: int | None = None
    wall_time_s: float | None = None
    """Training wall time reported by the run (summary.json)."""
    elapsed_s: float = 0.0
    """The whole `nfab train` command, launch included."""
    command: str = ""
    phases: list[dict] = field(default_factory=list)
    """Per profile phase: steps, bytes ratio, mean route mix, fallback steps."""
    error: str = ""


def gate_off_profile(src: str | Path, dst: Path) -> Path:
    """A copy of a profile with `fallback.cost_gate: false` (everything else unchanged)."""
    doc = json.loads(Path(src).read_text())
    doc.setdefault("fallback", {})["cost_gate"] = False
    doc.setdefault("provenance", {})["study_note"] = f"copy of {src} with fallback.cost_gate=false (nfab bench study)"
    atomic_write_json(dst, doc)
    return dst


def phase_table(metrics: pd.DataFrame) -> list[dict]:
    """Per phase (in order of first step): steps, bytes, ratio, mean route mix, fallbacks."""
    out = []
    for phase, g in metrics.groupby("phase", sort=False):
        mixes = pd.DataFrame([json.loads(m) if m else {} for m in g["route_mix"]]).fillna(0.0)
        wire = int(g["wire_bytes"].sum())
        out.append({
            "phase": str(phase), "first_step": int(g["step"].min()), "steps": len(g),
            "wire_mb": wire / 1e6, "ratio": float(g["baseline_wire_bytes"].sum()) / wire if wire else None,
            "route_mix": {k: round(float(v), 4) for k, v in mixes.mean().items()},
            "fallback_steps": int(g["fallback"].sum()),
            "fallback_reasons": sorted({r for r in g["fallback_reason"] if r}),
        })
    return sorted(out, key=lambda p: p["first_step"])


def read_run(row: StudyRow) -> StudyRow:
    """Fill a row from the run dir's summary.json and metrics.parquet (the report's checked readers)."""
    run = load_run(Path(row.run_dir), row.variant)
    s = run.summary
    if s is None:
        raise NfabError(f"{row.run_dir} has no summary.json")
    row.eval_loss = s.final_loss
    row.eval_accuracy = s.final_accuracy
    row.wire_mb = s.wire_bytes_total / 1e6 if s.wire_bytes_total is not None else None
    row.baseline_wire_mb = s.baseline_wire_bytes_total / 1e6 if s.baseline_wire_bytes_total is not None else None
    if s.wire_bytes_total and s.baseline_wire_bytes_total is not None:
        row.compression_ratio = s.baseline_wire_bytes_total / s.wire_bytes_total
    row.fallback_steps = s.fallback_steps
    row.skipped_steps = s.skipped_steps
    row.wall_time_s = s.wall_time_s
    row.ok = s.complete
    if run.metrics is not None:
        row.phases = phase_table(run.metrics)
    return row


def _nfab() -> str:
    return str(Path(sys.executable).parent / "nfab")


def run_one(cfg: StudyConfig, model: str, variant: str, comm: list[str]) -> StudyRow:
    """`nfab train` for one (model, variant) into OUT/<model>-<variant>."""
    run_dir = cfg.out / f"{model}-{variant}"
    steps = cfg.steps_for(model)
    argv = ["train", "--config", MODELS[model].config, *comm, "--nproc", str(cfg.nproc), "--steps", str(steps),
            "--run-dir", str(run_dir), "--quiet", "--overwrite", *cfg.overrides]
    row = StudyRow(model=model, variant=variant, run_dir=str(run_dir), steps=steps, ok=False,
                   command=shlex.join(["nfab", *argv]))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    res = subprocess.run([_nfab(), *argv], capture_output=True, text=True, env=env, check=False)
    row.elapsed_s = time.perf_counter() - t0
    if res.returncode != 0:
        row.error = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
        return row
    try:
        return read_run(row)
    except NfabError as exc:  # the run exited 0 but its artifacts do not read: a failed row, not a crash
        row.error = str(exc)
        return row


def variants_for(cfg: StudyConfig, model: str) -> dict[str, list[str]]:
    """Variant name -> `nfab train` comm flags (profiles copied with the cost gate off)."""
    out = dict(STATIC_VARIANTS)
    prof_dir = cfg.out / "profiles"
    out["profile"] = ["--profile", str(gate_off_profile(MODELS[model].profile, prof_dir / f"{model}.json")),
                      "comm.cost_model=none"]
    if model in cfg.extra_profiles:
        out["refit"] = ["--profile", str(gate_off_profile(cfg.extra_profiles[model], prof_dir / f"{model}-refit.json")),
                        "comm.cost_model=none"]
    return {k: v for k, v in out.items() if cfg.variants is None or k in cfg.variants}


def targets(rows: list[StudyRow]) -> list[dict]:
    """Judge every profile-guided row against FP32 of the same model."""
    ref = {r.model: r for r in rows if r.variant == "fp32" and r.ok}
    out = []
    for r in rows:
        if r.variant not in ("profile", "refit") or not r.ok or r.model not in ref:
            continue
        fp = ref[r.model]
        ratio_ok = (r.compression_ratio or 0.0) >= MIN_RATIO
        if MODELS[r.model].metric == "accuracy":
            delta = (r.eval_accuracy or 0.0) - (fp.eval_accuracy or 0.0)
            quality_ok = delta >= -MAX_ACC_DROP
            quality = f"accuracy {delta * 100:+.2f} pt vs FP32 (target >= -{MAX_ACC_DROP * 100:.1f})"
        else:
            delta = (r.eval_loss or 0.0) / (fp.eval_loss or 1.0) - 1.0
            quality_ok = delta <= MAX_LOSS_RISE
            quality = f"loss {delta * 100:+.2f}% vs FP32 (target <= +{MAX_LOSS_RISE * 100:.0f}%)"
        out.append({"model": r.model, "variant": r.variant, "ratio": r.compression_ratio, "ratio_ok": ratio_ok,
                    "quality_delta": delta, "quality_ok": quality_ok, "quality": quality,
                    "met": ratio_ok and quality_ok})
    return out


def run_study(cfg: StudyConfig, command: str = "", log=print) -> dict:
    """Every model x variant, then `nfab report`; writes OUT/study.json and OUT/study.md."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows: list[StudyRow] = []
    for model in cfg.models:
        for variant, comm in variants_for(cfg, model).items():
            row = run_one(cfg, model, variant, comm)
            log(f"{model}-{variant}: {'ok' if row.ok else 'FAILED ' + row.error} ({row.elapsed_s:.0f} s)")
            rows.append(row)
    report_dir = cfg.out / "report"
    done = [r.run_dir for r in rows if r.ok]
    report_ok = False
    if done:
        res = subprocess.run([_nfab(), "report", *done, "--out", str(report_dir)], capture_output=True, text=True,
                             env={**os.environ, "COLUMNS": "200"}, check=False)
        report_ok = res.returncode == 0
    doc = {
        "schema": "nfab.bench.study", "version": 1, "command": command,
        "total_s": time.perf_counter() - t0, "nproc": cfg.nproc,
        "steps": {m: cfg.steps_for(m) for m in cfg.models},
        "note": "compressed runs use comm.cost_model=none (sign takes the reducer with the fewest wire bytes) and "
                "profile/refit runs a copy of the profile with fallback.cost_gate=false (OUT/profiles/): on "
                "loopback the cost gate would send every bucket to FP32",
        "report": str(report_dir) if report_ok else None,
        "rows": [asdict(r) for r in rows], "targets": targets(rows),
    }
    atomic_write_json(cfg.out / "study.json", doc)
    atomic_write_text(cfg.out / "study.md", markdown(doc))
    return doc


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(doc: dict) -> str:
    """The results table (plus targets and per-phase route mix of the profile runs)."""
    lines = [f"`{doc['command']}` — {doc['total_s']:.0f} s, W={doc['nproc']} gloo ranks, steps {doc['steps']}", "",
             f"Note: {doc['note']}.", "",
             "| model | variant | eval acc | eval loss | wire MB | ratio | fallback steps | wall s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in doc["rows"]:
        if not r["ok"]:
            lines.append(f"| {r['model']} | {r['variant']} | failed: {r['error']} | | | | | |")
            continue
        acc = _f(None if r["eval_accuracy"] is None else r["eval_accuracy"] * 100, ".2f")
        lines.append(f"| {r['model']} | {r['variant']} | {acc} | {_f(r['eval_loss'], '.4f')} | "
                     f"{_f(r['wire_mb'], '.1f')} | {_f(r['compression_ratio'], '.2f')}x | {r['fallback_steps']} | "
                     f"{_f(r['wall_time_s'], '.1f')} |")
    if doc["targets"]:
        lines += ["", "Targets (ratio >= 8x; digits within 1.0 pt, stdlib-text within 3% loss of FP32):", ""]
        for t in doc["targets"]:
            lines.append(f"- {t['model']} {t['variant']}: {'MET' if t['met'] else 'MISSED'} — ratio "
                         f"{t['ratio']:.2f}x ({'ok' if t['ratio_ok'] else 'short'}), {t['quality']} "
                         f"({'ok' if t['quality_ok'] else 'over'})")
    for r in doc["rows"]:
        if r["variant"] in ("profile", "refit") and r["phases"]:
            lines += ["", f"{r['model']} {r['variant']} by phase:", "",
                      "| phase | from step | steps | ratio | route mix (elements) | fallbacks |",
                      "| --- | ---: | ---: | ---: | --- | ---: |"]
            for p in r["phases"]:
                mix = ", ".join(f"{k} {v:.2f}" for k, v in p["route_mix"].items() if v)
                lines.append(f"| {p['phase']} | {p['first_step']} | {p['steps']} | {_f(p['ratio'], '.2f')}x | {mix} | "
                             f"{p['fallback_steps']} |")
    return "\n".join(lines) + "\n"
