"""`nfab train --precision bf16|fp16`: autocast, and for fp16 a loss scaler nfab is told of (real runs, 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

from trainrun import GPT, metrics, nfab_train

from nfab.train import checkpoint


def test_bf16_and_fp16_train_as_fp32_does(tmp_path: Path) -> None:
    runs = {}
    for precision in ("fp32", "bf16", "fp16"):
        run = tmp_path / precision
        res = nfab_train(*GPT, "--route", "bq2", "--nproc", "2", "--precision", precision, "--run-dir", str(run))
        assert res.code == 0, res.stderr
        runs[precision] = metrics(run)
    first, last = runs["fp32"]["grad_norm"].iloc[0], runs["fp32"]["loss"].iloc[-1]
    for precision in ("bf16", "fp16"):
        m = runs[precision]
        assert m["loss"].iloc[0] != runs["fp32"]["loss"].iloc[0]  # the forward ran under autocast: its loss rounds
        assert not m["skipped"].any()
        assert abs(m["grad_norm"].iloc[0] / first - 1) < 0.02  # the optimizer's norm, not the scaled one
        assert abs(m["loss"].iloc[-1] / last - 1) < 0.05
        assert m["route_mix"].iloc[-1] == runs["fp32"]["route_mix"].iloc[-1]  # bq2 throughout, as in fp32


def test_fp16_skips_an_overflow_and_checkpoints_its_scaler(tmp_path: Path) -> None:
    """An overflow (rank 0's loss infinite at step 1): the scaler skips the step and halves its scale, and
    the checkpoint carries that scale, so a resumed run goes on from it."""
    run = tmp_path / "run"
    res = nfab_train(*GPT, "--route", "bq2", "--nproc", "2", "--precision", "fp16", "--run-dir", str(run),
                     env={"NFAB_FAULT": "inf@step=1,rank=0"})
    assert res.code == 0, res.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["replicas_identical"] is True
    state = checkpoint.read(checkpoint.latest(run) / "state.pt")
    assert state["scaler"]["scale"] == 65536.0 / 2


def test_an_unknown_precision_is_one_line(tmp_path: Path) -> None:
    res = nfab_train(*GPT, "--route", "bq2", "--precision", "fp8", "--run-dir", str(tmp_path / "run"))
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert res.code == 2 and len(lines) == 1 and "precision" in lines[0], res.stderr
    assert not (tmp_path / "run").exists()
