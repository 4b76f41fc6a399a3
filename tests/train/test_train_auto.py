"""`nfab train --profile auto`: the CLI's DDP run calibrates inside itself, writes what it fitted into the
run dir, and that profile trains a second run as any calibrated profile does."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from nfab.calibrate.table import read_table
from tests.train.trainrun import GPT, NFAB, metrics, nfab_train


@pytest.mark.slow
def test_train_profile_auto_writes_the_profile_it_fitted_and_a_second_run_trains_with_it(tmp_path: Path) -> None:
    run = tmp_path / "auto"
    r = nfab_train(*GPT, "--profile", "auto", "--nproc", "2", "--run-dir", str(run), "optim.name=adamw",
                   "comm.calibration_window=2", timeout=300)
    assert r.code == 0, r.stderr[-2000:]
    frame, meta = read_table(run / "calibration" / "calibration.parquet")
    assert meta["world_size"] == 2 and len(frame)
    profile = run / "calibration" / "profile.json"
    assert json.loads(profile.read_text())["evidence"]["validation"]["passed"] is None
    m = metrics(run)
    assert "calibrating" in m.columns and m["calibrating"].iloc[0]
    again = nfab_train(*GPT, "--profile", str(profile), "--nproc", "2", "--run-dir", str(tmp_path / "again"),
                       "optim.name=adamw", timeout=300)
    assert again.code == 0, again.stderr[-2000:]
    # the report reads the run with what it calibrated inside itself
    rep = subprocess.run([NFAB, "report", str(run), str(tmp_path / "again"), "--out", str(tmp_path / "report")],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    summary = pd.read_csv(tmp_path / "report" / "summary.csv")
    steps = dict(zip(summary["run"], summary["calibration_steps"], strict=True))
    assert steps["auto"] == int(m["calibrating"].sum()) and pd.isna(steps["again"])
    assert "auto/calibration" in rep.stdout
