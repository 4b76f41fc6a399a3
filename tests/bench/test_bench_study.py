"""`nfab bench study`: every variant runs through the real CLI, the results have their schema."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nfab.bench import study
from nfab.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"model", "variant", "run_dir", "steps", "ok", "eval_loss", "eval_accuracy", "wire_mb", "baseline_wire_mb",
            "compression_ratio", "fallback_steps", "skipped_steps", "wall_time_s", "elapsed_s", "command", "phases",
            "error"}


def test_gate_off_profile_copies_everything_but_the_gate(tmp_path):
    src = ROOT / "calibrations/resnet18/profile.json"
    dst = study.gate_off_profile(src, tmp_path / "p.json")
    a, b = json.loads(src.read_text()), json.loads(dst.read_text())
    assert b["fallback"]["cost_gate"] is False
    b["fallback"]["cost_gate"] = a["fallback"]["cost_gate"]
    b["provenance"].pop("study_note")
    assert a == b


def test_targets_judge_ratio_and_quality_against_fp32():
    def row(variant, acc, ratio):
        return study.StudyRow(model="resnet18", variant=variant, run_dir="", steps=1, ok=True, eval_accuracy=acc,
                              compression_ratio=ratio)

    (t,) = study.targets([row("fp32", 0.98, 1.0), row("profile", 0.975, 9.0), row("sign", 0.5, 10.0)])
    assert t["met"] and t["ratio_ok"] and t["quality_ok"]
    (t,) = study.targets([row("fp32", 0.98, 1.0), row("profile", 0.96, 9.0)])
    assert not t["met"] and not t["quality_ok"]


@pytest.mark.slow  # five 2-rank runs + report: about a minute on two shared cores
@pytest.mark.world_size(2)
def test_study_runs_every_variant(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs/ and calibrations/ are relative to the repository root
    cfg = study.StudyConfig(out=tmp_path / "study", models=("resnet18",), steps=5, nproc=2,
                            extra_profiles={"resnet18": "calibrations/resnet18/profile.json"},
                            overrides=("data.batch_size=8", "eval_every=0", "checkpoint_every=0"))
    doc = study.run_study(cfg, command="test", log=lambda s: None)
    variants = [r["variant"] for r in doc["rows"]]
    assert variants == ["fp32", "sign", "sign-ef", "profile", "refit"]
    for r in doc["rows"]:
        assert set(r) == ROW_KEYS
        assert r["ok"], r["error"]
        assert r["steps"] == 5 and r["eval_accuracy"] is not None and r["wire_mb"] > 0
        assert Path(r["run_dir"], "metrics.parquet").exists()
    by = {r["variant"]: r for r in doc["rows"]}
    assert by["fp32"]["compression_ratio"] == pytest.approx(1.0)
    assert by["sign"]["compression_ratio"] > 4  # 2 ranks: 1-bit signs plus control words
    assert by["profile"]["phases"] and all("route_mix" in p for p in by["profile"]["phases"])
    assert json.loads((cfg.out / "profiles/resnet18.json").read_text())["fallback"]["cost_gate"] is False
    assert [t["variant"] for t in doc["targets"]] == ["profile", "refit"]
    saved = json.loads((cfg.out / "study.json").read_text())
    assert saved["schema"] == "nfab.bench.study" and saved["rows"] == doc["rows"]
    md = (cfg.out / "study.md").read_text()
    assert "| resnet18 | sign-ef |" in md and "by phase" in md
    assert doc["report"] is not None and (cfg.out / "report").is_dir()


@pytest.mark.parametrize("args, message", [
    (["--models", "bert"], "unknown study model 'bert'"),
    (["--variants", "fp32,int3"], "unknown study variant 'int3'"),
    (["--refit", "gpt"], "--refit expects MODEL=PROFILE.json"),
])
def test_cli_rejects_bad_arguments_in_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, ["bench", "study", "--out", str(tmp_path), *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
