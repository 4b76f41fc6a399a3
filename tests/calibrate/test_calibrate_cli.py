"""`nfab calibrate` end to end on a tiny config, and `nfab fit`'s one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from nfab.calibrate import read_table
from nfab.cli.app import app
from nfab.cli.calibrate import VALIDATION_FAILED
from nfab.profile.schema import Profile, file_sha256
from nfab.report.artifacts import load_calibration

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cal") / "resnet18"
    res = runner.invoke(app, ["calibrate", "resnet18", "--steps", "8", "--phases", "2", "--trial-steps", "2",
                              "--routes", "fp32,q8,q2,sign", "--quick", "--out", str(out),
                              "model.width=4", "ef_steps=2", "eval_samples=32", "batch_size=8"])
    text = " ".join(res.output.split())
    failed = "validation over 8 steps of a 150-step run: FAILED" in text  # 8 steps of a width-4 net may
    assert res.exit_code == (VALIDATION_FAILED if failed else 0), res.output
    return out


def test_calibrate_writes_table_and_profile(calibrated: Path) -> None:
    frame, meta = read_table(calibrated / "calibration.parquet")
    assert {"model", "dataset", "world_size", "phase", "step", "region", "route", "error_feedback",
            "bits_per_element", "cosine", "rel_error", "sign_agreement", "loss_delta", "wire_bytes",
            "fp32_wire_bytes", "encode_decode_s", "capacity_ok"} <= set(frame.columns)
    schema = pq.read_schema(calibrated / "calibration.parquet")
    assert str(schema.field("world_size").type) == "int64" and str(schema.field("error_feedback").type) == "bool"
    assert len(frame) == 2 * len(frame["region"].unique()) * 4 * 2  # phases x regions x routes x EF
    q2 = frame[frame["route"] == "q2"]
    assert not q2["capacity_ok"].any() and q2["cosine"].isna().all()  # over capacity at W=4
    trials = frame[frame["trial_steps"].gt(0) & (frame["route"] != "fp32")]
    assert set(trials["route"]) <= {"q8", "sign"} and "sign" in set(trials["route"])  # --quick: sign and q8 only
    assert set(trials["screen"]) <= {"trial", "trial_stopped"} and trials["loss_delta"].notna().all()
    untried = frame[frame["trial_steps"].eq(0)]
    assert untried["loss_delta"].isna().all()
    assert set(untried["screen"]) <= {"replay", "cheaper", "bound", "budget", "no_trial"}
    assert set(frame.loc[frame["route"] == "fp32", "screen"]) == {"reference"}
    timing = meta["timing"]
    assert timing["reference_s"] > 0 and timing["ratio"] > 1 and timing["cpu_ratio"] > 1
    assert {"replay_s", "trials_s", "validation_s", "setup_s", "total_s"} <= set(timing)
    assert meta["world_size"] == 4 and meta["command"].startswith("nfab calibrate")
    assert schema.metadata[b"nfab.command"].startswith(b"nfab calibrate resnet18")
    assert meta["model_options"]["width"] == 4 and len(meta["reference"]["loss"]) == 8
    profile = Profile.load(calibrated / "profile.json")
    assert profile.provenance["calibration_sha256"] == file_sha256(calibrated / "calibration.parquet")
    assert profile.phases[0].start.fraction == 0.0
    assert "q2" not in profile.routes_used()
    # validation ran the profile over the whole window and left its verdict and curves in the evidence
    v = json.loads((calibrated / "profile.json").read_text())["evidence"]["validation"]
    assert v["steps"] == 8 and v["rounds"] and isinstance(v["passed"], bool)
    assert v["eval_steps"][-1] == 8 and len(v["reference_eval"]) == len(v["profile_eval"]) == len(v["eval_steps"])
    assert profile.provenance["timing"]["validation_s"] > 0
    # the report reads both files and shows the validation and the time split
    cal = load_calibration(calibrated, "resnet18")
    assert cal.table is not None and cal.profile is not None and cal.profile.model == "resnet18"
    assert cal.profile.validation == v and "validation" not in cal.profile.evidence
    from nfab.report.tables import calibration_notes

    notes = calibration_notes(cal)
    assert notes[0].startswith("validation over 8 steps of a 150-step run:") and "x the FP32 reference" in notes[1]


def test_fit_refits_with_other_tolerances(calibrated: Path, tmp_path: Path) -> None:
    out = tmp_path / "strict.json"
    res = runner.invoke(app, ["fit", str(calibrated / "calibration.parquet"), "--tol-cosine", "1.0",
                              "--tol-loss", "0", "-o", str(out)])
    assert res.exit_code == 0, res.output
    p = Profile.load(out)
    assert p.routes_used() <= {"fp32", "bf16"}  # nothing lossier passes a cosine of 1
    assert json.loads(out.read_text())["provenance"]["tol_cosine"] == 1.0


def test_fit_keeps_what_it_would_overwrite_and_refuses_tolerances_out_of_range(calibrated: Path,
                                                                               tmp_path: Path) -> None:
    """`nfab fit T -o T` wrote JSON over the Parquet table; `nfab fit T` replaced calibrate's validated,
    tightened profile.json with an unvalidated refit, with nothing said."""
    folder = tmp_path / "cal"
    folder.mkdir()
    for name in ("calibration.parquet", "profile.json"):
        (folder / name).write_bytes((calibrated / name).read_bytes())
    table, profile = folder / "calibration.parquet", folder / "profile.json"
    before = table.read_bytes(), profile.read_bytes()
    assert "is the calibration table itself" in _one_line_error(["fit", str(table), "-o", str(table)])
    assert "exists (a refit is not validated" in _one_line_error(["fit", str(table)])
    assert (table.read_bytes(), profile.read_bytes()) == before
    res = runner.invoke(app, ["fit", str(table), "--overwrite"])
    assert res.exit_code == 0, res.output
    assert json.loads(profile.read_text())["evidence"]["validation"]["passed"] is None  # a refit says so
    for args, match in ((["--tol-cosine", "1.5"], "in [-1, 1]"), (["--tol-cosine", "nan"], "in [-1, 1]"),
                        (["--tol-loss", "-0.5"], ">= 0")):
        assert match in _one_line_error(["fit", str(table), *args, "-o", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def _one_line_error(args: list[str]) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in res.output, res.output
    return lines[0]


def test_fit_rejects_truncated_foreign_and_incomplete_tables(calibrated: Path, tmp_path: Path) -> None:
    good = (calibrated / "calibration.parquet").read_bytes()
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good[: len(good) // 2])
    assert "truncated or not Parquet" in _one_line_error(["fit", str(truncated)])
    foreign = tmp_path / "foreign.parquet"
    pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}).to_parquet(foreign)
    assert "not an nfab calibration table" in _one_line_error(["fit", str(foreign)])
    partial = tmp_path / "partial.parquet"
    pd.read_parquet(calibrated / "calibration.parquet").drop(columns=["loss_delta"]).to_parquet(partial)
    assert "loss_delta" in _one_line_error(["fit", str(partial)])
    assert "does not exist" in _one_line_error(["fit", str(tmp_path / "nope.parquet")])


def test_fit_subprocess_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    proc = subprocess.run([sys.executable, "-c", "from nfab.cli.app import main; main()", "fit", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "error" in proc.stderr


def test_calibrate_bad_input_is_one_line() -> None:
    assert "already holds a calibration (calibration.parquet, profile.json): pass --overwrite" in _one_line_error(
        ["calibrate", "resnet18", "--out", str(REPO / "calibrations/resnet18")])  # the shipped one, from a clone
    assert "unknown model" in _one_line_error(["calibrate", "nosuchmodel", "--dataset", "digits"])
    assert "unknown route" in _one_line_error(["calibrate", "resnet18", "--routes", "fp32,q3"])
    assert "unknown option" in _one_line_error(["calibrate", "resnet18", "nosuchkey=1"])
    # an int() on the override crashed: exit 1, "calibration failed: ValueError" and a traceback log
    assert 'steps must be an integer, got "abc"' in _one_line_error(["calibrate", "resnet18", "steps=abc"])
    # the override won in silence: `--steps 2 steps=5` calibrated 5 steps
    assert "'steps=5' and --steps both set steps: give it once" in _one_line_error(
        ["calibrate", "resnet18", "--steps", "2", "steps=5"])
    # calibrated, then failed every validation round and exited 0 (fit refused these; calibrate did not)
    for flag, value, words in (("--tol-validate", "-1", "--tol-validate must be"),
                               ("--tol-validate", "nan", "gap >= 0"),
                               ("--tol-cosine", "5", "--tol-cosine must be a cosine"),
                               ("--tol-loss", "-0.5", "--tol-loss must be")):
        assert words in _one_line_error(["calibrate", "resnet18", flag, value, "--out", "/nonexistent/nfab"])


def test_a_failed_validation_writes_the_profile_and_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's `nfab calibrate && nfab train` went on to train a profile that FAILED its validation (exit 0).
    The validation really runs; only its tolerance is made impossible, as the validation tests do."""
    from nfab.calibrate import sweep

    real = sweep.validate_profile
    monkeypatch.setattr(sweep, "validate_profile", lambda *a, **k: real(*a, **{**k, "tolerance": -1.0}))
    out = tmp_path / "cal"
    res = runner.invoke(app, ["calibrate", "resnet18", "--steps", "8", "--phases", "2", "--trial-steps", "2",
                              "--routes", "fp32,sign", "--quick", "--out", str(out),
                              "model.width=4", "ef_steps=2", "eval_samples=32", "batch_size=8"])
    assert res.exit_code == VALIDATION_FAILED == 3, res.output
    text = " ".join(res.output.split())
    assert "validation over 8 steps of a 150-step run: FAILED" in text
    assert "validation FAILED: the profile is written" in text
    assert (out / "profile.json").is_file() and (out / "calibration.parquet").is_file()
    assert Profile.load(out / "profile.json").evidence  # complete, not half-written


def test_routes_help_lists_the_default_routes() -> None:
    from nfab.calibrate.config import DEFAULT_ROUTES

    res = runner.invoke(app, ["calibrate", "--help"], env={"COLUMNS": "200"})
    text = "".join(res.output.replace("│", "").split())
    assert res.exit_code == 0 and ",".join(DEFAULT_ROUTES) in text


BROKEN_MODEL = '''
from torch import nn


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        raise RuntimeError("the user's forward is broken")


def build(**options):
    return Broken()
'''


def test_a_user_models_failure_is_one_line_naming_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """It was a 73-line traceback; `nfab train` said the same in one line."""
    (tmp_path / "brokenmodel.py").write_text(BROKEN_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = runner.invoke(app, ["calibrate", "brokenmodel:build", "--dataset", "digits", "-w", "2", "--steps", "4",
                              "--quick", "--out", str(tmp_path / "cal")])
    assert res.exit_code == 2, res.output
    line = res.output.strip().splitlines()[-1]
    assert "the model's forward (under the default loss) raised RuntimeError: the user's forward is broken " \
           "(traceback: " in line, res.output
    log = Path(line.rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert "Traceback" not in res.output and "in forward" in log.read_text()
    log.unlink()


def test_a_cosine_bar_below_the_adaptive_one_is_named(tmp_path: Path) -> None:
    """Under AdamW every lossy route needs 0.75: `--tol-cosine 0.5` fitted the default's profile in silence."""
    table = Path(__file__).resolve().parents[2] / "calibrations/gpt/calibration.parquet"
    res = runner.invoke(app, ["fit", str(table), "--tol-cosine", "0.5", "-o", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert "note: --tol-cosine 0.5 is below the 0.75" in " ".join(res.output.split())
    res = runner.invoke(app, ["fit", str(table), "--tol-cosine", "0.9", "-o", str(tmp_path / "q.json")])
    assert res.exit_code == 0 and "note:" not in res.output


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_trial_labels_say_whether_trials_ran(optimizer: str, tmp_path: Path) -> None:
    """Under AdamW no trial can change the fit and none runs: the header said "trials of 2 steps" and a
    "short trials (phases) 2/2" bar filled anyway. The labels now follow what the table records."""
    out = tmp_path / "cal"
    res = runner.invoke(app, ["calibrate", "resnet18", "--steps", "8", "--phases", "2", "--trial-steps", "2",
                              "--routes", "fp32,q8,q2,sign", "--quick", "--no-validate", "--out", str(out),
                              "model.width=4", "ef_steps=2", "eval_samples=32", "batch_size=8",
                              f"optim.name={optimizer}"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    trialled = (read_table(out / "calibration.parquet")[0]["screen"].isin(["trial", "trial_stopped"])).any()
    assert trialled == (optimizer == "sgd")
    assert ("short trials (phases)" in text) == trialled, text
    assert ("trials of 2 steps" in text) == trialled, text
    assert ("no short trials (adamw: replay fidelity decides)" in text) == (not trialled), text


def test_a_budget_below_the_reference_and_replay_is_one_line(tmp_path: Path) -> None:
    res = runner.invoke(app, ["calibrate", "resnet18", "--budget", "0.5", "--out", str(tmp_path / "cal")])
    assert res.exit_code == 2 and "--budget must be at least 1.2 reference runs" in res.output
    assert not (tmp_path / "cal").exists()
