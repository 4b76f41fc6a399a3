"""The profile carries the whole step: accumulation, precision and clipping come back under `--profile P`.

A tiny real calibration (resnet18 width 4, 6 steps, no validation) under `accum_steps: 2`, `precision:
bf16` and a clip; `nfab train --profile P` then trains with them (its config.json), explicit values win
with one warning line, and a profile written before these keys were recorded still loads and trains
as it was calibrated (one micro-batch, fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nfab.cli.app import app
from nfab.config.calibrated import calibrated_setting, recipe_changes
from nfab.profile.schema import Profile
from nfab.train.launch import resolve_config, validate

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cal") / "resnet18"
    res = runner.invoke(app, ["calibrate", "resnet18", "--steps", "6", "--phases", "2", "--trial-steps", "2",
                              "--routes", "fp32,q8,sign", "--quick", "--no-validate", "--world-size", "2",
                              "--out", str(out), "model.width=4", "ef_steps=2", "eval_samples=32",
                              "batch_size=8", "accum_steps=2", "precision=bf16", "grad_clip=1.0"])
    assert res.exit_code == 0, res.output
    return out / "profile.json"


def _resolved(tmp_path: Path, path: Path, *extra: str, warn=None):
    cfg = resolve_config(None, list(extra), [f"comm.profile={path}", f"run_dir={tmp_path / 'run'}"])
    return validate(cfg, **({"warn": warn} if warn else {}))


def test_the_profile_records_the_step(profile: Path) -> None:
    setting = calibrated_setting(Profile.load(profile))
    assert setting is not None
    assert (setting.accum_steps, setting.precision, setting.optimizer.grad_clip) == (2, "bf16", 1.0)


def test_profile_alone_trains_the_calibrated_step(profile: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = runner.invoke(app, ["train", "--profile", str(profile), "--steps", "2", "--quiet", "--run-dir", str(run),
                              "comm.cost_model=none", "data.eval_batches=1"])
    assert res.exit_code == 0, res.output
    saved = json.loads((run / "config.json").read_text())
    assert (saved["accum_steps"], saved["precision"], saved["optim"]["grad_clip"]) == (2, "bf16", 1.0)
    assert saved["launch"]["nproc"] == 2 and saved["data"]["batch_size"] == 8
    summary = json.loads((run / "summary.json").read_text())
    assert summary["complete"] and summary["steps"] == 2
    assert "steps otherwise" not in res.output  # nothing was overridden


def test_explicit_values_win_with_one_line(profile: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    cfg = _resolved(tmp_path, profile, "accum_steps=1", "precision=fp32", warn=lines.append)
    assert (cfg.accum_steps, cfg.precision) == (1, "fp32")
    changed = [line for line in lines if "steps otherwise" in line]
    assert len(changed) == 1
    assert "accum_steps=1 (calibrated: 2)" in changed[0] and "precision=fp32 (calibrated: bf16)" in changed[0]
    assert recipe_changes(Profile.load(profile), _resolved(tmp_path, profile, "steps=3")) is None  # length: free


def test_an_old_profile_without_the_step_keys_loads_and_trains_as_calibrated(profile: Path, tmp_path: Path) -> None:
    old = json.loads(profile.read_text())
    for key in ("accum_steps", "precision"):
        del old["provenance"]["calibrated"][key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    cfg = _resolved(tmp_path, path)
    assert (cfg.accum_steps, cfg.precision) == (1, "fp32")  # the run config's defaults, as it was calibrated
    shipped = _resolved(tmp_path, REPO / "calibrations" / "resnet18" / "profile.json")
    assert (shipped.accum_steps, shipped.precision) == (1, "fp32")
    lines: list[str] = []
    _resolved(tmp_path, path, "accum_steps=4", warn=lines.append)  # nothing recorded: nothing to differ from
    assert not [line for line in lines if "steps otherwise" in line]
