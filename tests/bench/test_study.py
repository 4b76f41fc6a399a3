"""`python -m bench.study`: every variant in a user's loop, verdicts, and docs generated from the JSON."""

import json
import math
from pathlib import Path

import pytest

from bench import study, studydocs, studyspec

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"setting", "variant", "ok", "seed", "steps", "world_size", "eval_loss", "eval_accuracy", "wire_mb",
            "fp32_mb", "ratio", "fallback_steps", "probe_mb", "shadow_mb", "alarms", "false_alarms", "health_events",
            "wall_s",
            "train_losses", "error"}


def _doc(rows: list[dict], metric: str = "loss") -> dict:
    return {"settings": {"s": {"metric": metric}}, "rows": [{"setting": "s", "ok": True, **r} for r in rows]}


def test_judge_checks_the_profile_and_names_failing_static_variants() -> None:
    doc = _doc([{"variant": "fp32", "eval_loss": 2.0, "ratio": 1.0},
                {"variant": "sign", "eval_loss": 2.05, "ratio": 15},
                {"variant": "sign-ef", "eval_loss": 3.0, "ratio": 15},
                {"variant": "profile", "eval_loss": 2.01, "ratio": 9.0}])
    (v,) = study.judge(doc)
    assert v["failing_static"] == ["sign-ef"] and v["met"] and v["profile_delta"] == pytest.approx(0.005)
    doc["rows"][-1].update(eval_loss=2.1)
    (v,) = study.judge(doc)
    assert not v["met"] and not v["quality_ok"] and v["ratio_ok"]


def test_several_seeds_are_judged_on_the_mean_paired_delta() -> None:
    """Each seed's run is paired with FP32 of the same seed; the main table keeps the study's seed."""
    rows = [{"variant": "fp32", "seed": 0, "eval_loss": 2.0, "ratio": 1.0},
            {"variant": "profile", "seed": 0, "eval_loss": 2.01, "ratio": 9.0},  # +0.5%
            {"variant": "fp32", "seed": 1, "eval_loss": 3.0, "ratio": 1.0},
            {"variant": "profile", "seed": 1, "eval_loss": 3.06, "ratio": 9.0},  # +2.0%
            {"variant": "fp32", "seed": 2, "eval_loss": 1.0, "ratio": 1.0},
            {"variant": "profile", "seed": 2, "eval_loss": 1.02, "ratio": 9.0}]  # +2.0%
    doc = {**_doc(rows), "seed": 0}
    (spread,) = study.seed_spread(doc, "s")
    assert spread.seeds == (0, 1, 2) and spread.deltas == pytest.approx((0.005, 0.02, 0.02))
    assert spread.mean == pytest.approx(0.015) and spread.sd == pytest.approx(0.00866, abs=1e-5)
    (v,) = study.judge(doc)
    assert v["profile_delta"] == pytest.approx(0.005)  # seed 0 alone would pass
    assert v["profile_delta_mean"] == pytest.approx(0.015) and not v["quality_ok"] and not v["met"]
    assert [r["seed"] for r in study.main_rows(doc, "s")] == [0, 0]
    doc["settings"]["s"].update(world_size=4, steps=3, batch_size=1, optimizer="adamw", lr=1e-3, weight_decay=0.0,
                                model="m", dataset="d", note="")
    table = "\n".join(studydocs.seed_table(doc, "s"))
    assert "| **nfab calibrated profile** | 0, 1, 2 | +1.50% | 0.87% | +0.50% | +2.00% | 9.0x |" in table
    assert "+1.50% ± 0.87 (mean ± sd over seeds 0, 1, 2; seed 0: +0.50%)" in "\n".join(studydocs.verdict_lines(
        {**doc, "verdicts": [v]}))
    for r in doc["rows"]:
        r.update(wire_mb=1.0, fallback_steps=None)
    assert studydocs.setting_table(doc, "s")[2].startswith("| FP32 DDP | 2.000 |")


def test_the_noise_corrected_profile_is_judged_beside_the_profile() -> None:
    doc = _doc([{"variant": "fp32", "eval_loss": 2.0, "ratio": 1.0},
                {"variant": "profile", "eval_loss": 2.04, "ratio": 9.0},
                {"variant": "profile-nm", "eval_loss": 2.01, "ratio": 9.0}])
    (v,) = study.judge(doc)
    assert not v["met"] and v["nm_met"] and v["nm_profile_delta"] == pytest.approx(0.005)
    lines = studydocs.verdict_lines({**doc, "seed": 0, "verdicts": [v]})
    assert "profile +2.00% at 9.0x" in lines[0] and "profile + noise-corrected second moment +0.50%" in lines[0]


def test_published_docs_match_the_study_json() -> None:
    """docs/study.md's study block is exactly what the JSON renders (no hand edits), its plots beside the JSON."""
    doc = json.loads((ROOT / studydocs.STUDY_JSON).read_text())
    assert doc["schema"] == studyspec.SCHEMA and doc["version"] == studyspec.VERSION
    page = (ROOT / studydocs.STUDY_DOC).read_text()
    assert studydocs.replace_block(page, studydocs.doc_block(doc)) == page
    for name in doc["settings"]:
        assert (ROOT / "bench" / f"pareto_{name}.png").is_file()
        assert f"]({studydocs.PNG_FROM_DOC}/pareto_{name}.png)" in page


def test_the_study_modules_import_no_circle() -> None:
    """studyspec <- studyverdict <- studydocs <- study: each imports only the ones before it."""
    import ast

    order = ["studyspec", "studyverdict", "studydocs", "study"]
    for i, name in enumerate(order):
        tree = ast.parse((ROOT / "bench" / f"{name}.py").read_text())
        imported = {n.module.rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                    and n.module.startswith(("nfab.bench.", "bench.")) and n.module.rsplit(".", 1)[-1] != "userloop"}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                     and n.module in ("nfab.bench", "bench") for a in n.names}
        assert imported <= set(order[:i]), (name, imported)


def test_the_study_is_no_nfab_command() -> None:
    """The study runs from a checkout (`python -m bench.study`); the installed `nfab bench` has no `study`."""
    from typer.testing import CliRunner

    from nfab.cli.app import app

    result = CliRunner().invoke(app, ["bench", "study"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "No such command 'study'" in result.output


def test_replace_block_needs_the_markers() -> None:
    text = f"a\n{studydocs.DOC_BEGIN}\nold\n{studydocs.DOC_END}\nb\n"
    assert studydocs.replace_block(text, "NEW") == "a\nNEW\nb\n"
    with pytest.raises(Exception, match="no study block"):
        studydocs.replace_block("no markers", "NEW")


@pytest.mark.slow  # W=2 ranks spawned once, seven variants of 3 steps each, tiny resnet18
@pytest.mark.world_size(2)
def test_study_runs_every_variant_in_a_user_loop(tmp_path: Path) -> None:
    cfg = study.StudyConfig(out=tmp_path / "study", settings=("resnet18",), steps=3, world_size=2, tweaks={
        "model_options": {"width": 4, "small_input": True, "num_classes": 10, "in_channels": 1},
        "batch_size": 8, "eval_samples": 64, "routes_only": True})
    doc = study.run_study(cfg, command="test", log=lambda s: None, root=ROOT)
    assert [r["variant"] for r in doc["rows"]] == list(study.VARIANTS)
    by = {r["variant"]: r for r in doc["rows"]}
    for r in doc["rows"]:
        assert set(r) == ROW_KEYS and r["ok"], r["error"]
        assert r["steps"] == 3 and r["world_size"] == 2 and r["eval_accuracy"] is not None
        assert r["fp32_mb"] == pytest.approx(by["fp32"]["fp32_mb"])  # the same gradients every time
    assert by["fp32"]["ratio"] == pytest.approx(1.0) and by["fp16"]["ratio"] == pytest.approx(2.0)
    assert by["bf16"]["ratio"] == pytest.approx(2.0) and by["bf16"]["eval_loss"] != by["fp32"]["eval_loss"]
    # PowerSGD runs vanilla all-reduce for its first 2 steps, then P/Q: the third step is cheaper
    assert 1.0 < by["powersgd-r2"]["ratio"] and by["powersgd-r8"]["ratio"] < by["powersgd-r2"]["ratio"]
    assert by["sign"]["ratio"] > 2 and by["sign-ef"]["ratio"] > 2 and by["profile"]["ratio"] > 1
    assert by["fp32"]["fallback_steps"] is None and by["sign"]["fallback_steps"] is not None
    assert by["fp32"]["probe_mb"] is None and 0 < by["sign"]["probe_mb"] < by["sign"]["wire_mb"]
    saved = json.loads((cfg.out / "study.json").read_text())
    assert saved["rows"] == doc["rows"] and saved["verdicts"] == doc["verdicts"]
    assert (cfg.out / "pareto_resnet18.png").read_bytes()[:4] == b"\x89PNG"
    html = (cfg.out / "report.html").read_text()
    assert "pareto_resnet18.png" in html and "PowerSGD rank 8" in html
    assert "| nfab static sign + error feedback forced (health monitor on) |" in (cfg.out / "study.md").read_text()


@pytest.mark.slow  # W=2: two seeds of two variants, then a third seed appended
@pytest.mark.world_size(2)
def test_study_runs_seeds_and_appends_more(tmp_path: Path) -> None:
    tweaks = {"model_options": {"width": 4, "small_input": True, "num_classes": 10, "in_channels": 1},
              "batch_size": 8, "eval_samples": 64, "routes_only": True, "metric": "loss"}
    cfg = study.StudyConfig(out=tmp_path / "study", settings=("resnet18",), variants=("fp32", "sign"), steps=2,
                            world_size=2, seeds=(3, 1), tweaks=tweaks)
    doc = study.run_study(cfg, command="first", log=lambda s: None, root=ROOT)
    assert doc["seed"] == 3 and [(r["variant"], r["seed"]) for r in doc["rows"]] == [
        ("fp32", 1), ("fp32", 3), ("sign", 1), ("sign", 3)]
    by = {(r["variant"], r["seed"]): r for r in doc["rows"]}
    assert by["fp32", 1]["eval_loss"] != by["fp32", 3]["eval_loss"]  # another init and data order
    more = study.StudyConfig(out=cfg.out, settings=("resnet18",), variants=("sign",), steps=2, world_size=2,
                             seeds=(5,), tweaks=tweaks, append=True)
    doc = study.run_study(more, command="second", log=lambda s: None, root=ROOT)
    assert doc["seed"] == 3 and doc["command"] == "first ; second" and len(doc["rows"]) == 5
    (spread,) = study.seed_spread(doc, "resnet18")  # seed 5 has no FP32 row to pair with
    assert spread.variant == "sign" and spread.seeds == (1, 3)
    assert "Across seeds" in (cfg.out / "study.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0,x"], "--seeds must be comma-separated integers"),
    (["--seeds", "1,1"], "--seeds must be distinct integers >= 0"),
    (["--settings", "bert"], "unknown study setting 'bert'"),
    (["--variants", "fp32,int3"], "unknown study variant 'int3'"),
])
def test_cli_rejects_bad_arguments_in_one_line(tmp_path, capsys, args, message):
    assert study.main(["--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.world_size(2)
def test_every_profile_variant_reports_a_missing_profile(tmp_path: Path) -> None:
    from dataclasses import replace

    from bench.userloop import run_variants

    setting = replace(study.SETTINGS["resnet18"], profile="no/such/profile.json", world_size=2, steps=1)
    rows = run_variants(setting, ("profile", "profile-nm"), seed=3, root=tmp_path)
    assert [(r.variant, r.ok, r.seed) for r in rows] == [("profile", False, 3), ("profile-nm", False, 3)]
    assert all("profile no/such/profile.json not found" in r.error for r in rows)


def test_a_classifier_loss_verdict_allows_one_held_out_predictions_worth() -> None:
    rows = [{"variant": "fp32", "eval_loss": 0.0131, "ratio": 1.0},
            {"variant": "profile", "eval_loss": 0.0165, "ratio": 9.5}]  # +26%, +0.0034 nats
    doc = _doc(rows)
    (v,) = study.judge(doc)
    assert not v["quality_ok"]  # judged at 1%
    doc["settings"]["s"].update(classes=10, eval_samples=360)  # one of 360 digits: ln(10)/360 = 0.0064 nats
    (v,) = study.judge(doc)
    assert v["quality_ok"] and v["judged_at"] == pytest.approx(math.log(10) / 360 / 0.0131)
    doc["rows"][1]["eval_loss"] = 0.0200  # +0.0069 nats: more than one digit's worth
    (v,) = study.judge(doc)
    assert not v["quality_ok"]


def test_the_command_runs_from_the_repository_root(tmp_path: Path) -> None:
    """`python -m bench.study` (as `make study` runs it): a bad argument is one line and exit 2."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "bench.study", "--out", str(tmp_path), "--settings", "bert"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown study setting 'bert'"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_regen_docs_needs_the_published_json(tmp_path: Path, capsys) -> None:
    assert study.main(["--regen-docs"], root=tmp_path) == 2
    assert "bench/study.json not found: run `python -m bench.study --publish` first" in capsys.readouterr().err
