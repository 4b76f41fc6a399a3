"""Tiny real artifacts for the report tests, written to the producers' contract.

Real Parquet files (pandas + pyarrow, the contract's dtypes) and real JSON, so the
report is tested against what `nfab train` and `nfab calibrate` write, not mocks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

FP32_BYTES_PER_STEP = 4_000_000  # 1M fp32 gradient elements


def _metrics(steps: int, wire_per_step: int, route_mix: dict[str, float],
             fallback_steps: tuple[int, ...] = (), lm: bool = False,
             final_loss: float = 0.3, final_accuracy: float = 0.9) -> pd.DataFrame:
    rows = []
    for step in range(steps):
        is_eval = (step + 1) % 5 == 0
        fallback = step in fallback_steps
        mix = {"fp32": 1.0} if fallback else route_mix
        loss = 2.5 * math.exp(-step / 10) + final_loss
        rows.append({
            "step": step, "phase": "warmup" if step < 5 else "main", "loss": loss,
            "lr": 0.1, "grad_norm": 1.0 / (step + 1),
            "wire_bytes": FP32_BYTES_PER_STEP if fallback else wire_per_step,
            "baseline_wire_bytes": FP32_BYTES_PER_STEP, "route_mix": json.dumps(mix),
            "fallback": fallback, "fallback_reason": "loss_spike" if fallback else "",
            "fidelity_cosine": 0.97 if step % 4 == 0 else math.nan,
            "hook_time_s": 0.001, "step_time_s": 0.05,
            "eval_loss": loss + 0.05 if is_eval else math.nan,
            "eval_accuracy": (final_accuracy - 0.4 * math.exp(-step / 8))
            if is_eval and not lm else math.nan,
        })
    frame = pd.DataFrame(rows)
    return frame.astype({"step": "int64", "wire_bytes": "int64", "baseline_wire_bytes": "int64",
                         "fallback": "bool", "phase": "string", "route_mix": "string",
                         "fallback_reason": "string"})


def write_run(root: Path, name: str, *, route: str | None, wire_per_step: int,
              route_mix: dict[str, float], steps: int = 20, accuracy: float = 0.9,
              loss: float = 0.4, fallback_steps: tuple[int, ...] = (),
              summary: bool = True, complete: bool = True, lm: bool = False, parallel: str | None = None,
              ) -> Path:
    """A run dir; totals in summary.json agree with the per-step metrics."""
    path = root / name
    path.mkdir(parents=True)
    metrics = _metrics(steps, wire_per_step, route_mix, fallback_steps, lm=lm,
                       final_loss=loss - 0.1, final_accuracy=accuracy)
    final_eval = ({"loss": loss, "perplexity": math.exp(loss)} if lm
                  else {"loss": loss, "accuracy": accuracy})
    metrics.to_parquet(path / "metrics.parquet", index=False)
    if summary:
        wire, fp32 = int(metrics["wire_bytes"].sum()), int(metrics["baseline_wire_bytes"].sum())
        (path / "summary.json").write_text(json.dumps({
            "model": "gpt-nano" if lm else "resnet18", "dataset": "text" if lm else "digits",
            "world_size": 4, "steps": steps, "complete": complete, "final_eval": final_eval,
            "wire_bytes_total": wire, "baseline_wire_bytes_total": fp32,
            "compression_ratio": fp32 / wire, "fallback_steps": len(fallback_steps),
            "skipped_steps": 0, "wall_time_s": 12.5, "route": route, "profile": None,
            "nfab_version": "0.1.0", "torch_version": "2.13", "command": "nfab train",
            **({} if parallel is None else {"parallel": parallel}),
        }))
    return path


def write_calibration(root: Path, name: str = "cal", profile: bool = True) -> Path:
    """A calibration dir with two phases x three regions x three routes, and its profile."""
    path = root / name
    path.mkdir(parents=True)
    rows = []
    bits = {"fp32": 32.0, "q8": 8.0, "sign": 1.0}
    for phase, step in (("warmup", 0), ("main", 50)):
        for region in ("conv", "linear", "norm"):
            for route, b in bits.items():
                for ef in (False, True):
                    cosine = 1.0 if route == "fp32" else (0.99 if route == "q8" else 0.8)
                    rows.append({
                        "model": "resnet18", "dataset": "digits", "world_size": 4,
                        "phase": phase, "step": step, "region": region, "route": route,
                        "error_feedback": ef, "bits_per_element": b, "cosine": cosine,
                        "rel_error": 1 - cosine, "sign_agreement": cosine,
                        "loss_delta": math.nan if route == "fp32" else 0.01 * (32 / b),
                        "wire_bytes": int(1000 * b), "baseline_wire_bytes": 32000,
                        "encode_decode_s": 0.001,
                    })
    table = pd.DataFrame(rows).astype({"world_size": "int64", "step": "int64",
                                       "wire_bytes": "int64", "baseline_wire_bytes": "int64"})
    table.to_parquet(path / "calibration.parquet", index=False)
    if profile:
        phases = [
            {"name": "warmup", "start": {"step": 0},
             "routes": {"conv": "q8", "linear": "q8", "norm": "fp32"}, "error_feedback": False},
            {"name": "main", "start": {"fraction": 0.2},
             "routes": {"conv": "sign", "linear": "q8", "norm": "fp32"}, "error_feedback": True},
        ]
        evidence = {
            "warmup": {"conv": {"route": "q8", "bits_per_element": 8.0, "cosine": 0.99,
                                "loss_delta": 0.04}},
            "main": {"conv": {"route": "sign", "bits_per_element": 1.0, "cosine": 0.8,
                              "loss_delta": 0.32},
                     "norm": {"route": "fp32", "bits_per_element": 32.0, "cosine": 1.0,
                              "loss_delta": None}},
        }
        (path / "profile.json").write_text(json.dumps({
            "schema": "nfab.profile", "version": 1,
            "model": {"name": "resnet18", "signature": None},
            "world_size": {"min": 2, "max": 8}, "phases": phases, "overrides": {},
            "health": {}, "evidence": evidence, "provenance": {},
        }))
    return path


@pytest.fixture
def make_run(tmp_path: Path) -> Callable[..., Path]:
    return lambda name, **kw: write_run(tmp_path / "runs", name, **kw)


@pytest.fixture
def make_calibration(tmp_path: Path) -> Callable[..., Path]:
    return lambda name="cal", **kw: write_calibration(tmp_path / "calibrations", name, **kw)


@pytest.fixture
def standard(make_run: Callable[..., Path], make_calibration: Callable[..., Path]
             ) -> dict[str, Path]:
    """One FP32 run, one compressed run (with fallbacks), one fitted calibration."""
    fp32 = make_run("fp32-run", route="fp32", wire_per_step=FP32_BYTES_PER_STEP,
                    route_mix={"fp32": 1.0}, accuracy=0.95, loss=0.40)
    sign = make_run("sign-run", route="sign", wire_per_step=200_000,
                    route_mix={"fp32": 0.1, "signgather": 0.9}, accuracy=0.93, loss=0.42,
                    fallback_steps=(7, 8))
    cal = make_calibration()
    return {"fp32": fp32, "sign": sign, "cal": cal}
