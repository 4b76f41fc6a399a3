"""`nfab profile check`: a profile whose validation failed is said first, in one line, and exits 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nfab.cli.app import app
from nfab.cli.calibrate import VALIDATION_FAILED
from nfab.profile.evidence import failed_validation

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def failed_profile(tmp_path: Path, **validation: object) -> Path:
    """The shipped gpt profile with its validation evidence rewritten as a failure."""
    data = json.loads((REPO / "calibrations/gpt/profile.json").read_text())
    data["evidence"]["validation"].update({"passed": False, "gap": 0.0241, **validation})
    path = tmp_path / "failed.json"
    path.write_text(json.dumps(data))
    return path


def test_check_of_a_failed_profile_says_so_first_in_one_line_and_exits_3(tmp_path: Path) -> None:
    path = failed_profile(tmp_path)
    res = runner.invoke(app, ["profile", "check", str(path)])
    assert res.exit_code == VALIDATION_FAILED == 3, res.output
    lines = res.output.splitlines()
    assert lines[0] == (f"{path}: validation FAILED over 300 steps: gap +2.41% vs tolerance 1.00%; recalibrate it "
                        "(nfab calibrate) before training with it (exit 3)")
    assert lines[-1] == f"{path}: a valid file, but its profile failed its validation"
    assert not any(line.endswith(": valid") for line in lines)


def test_check_of_a_passed_profile_exits_0_and_says_valid() -> None:
    res = runner.invoke(app, ["profile", "check", "gpt"])
    assert res.exit_code == 0, res.output
    assert "FAILED" not in res.output and res.output.splitlines()[-1].endswith("profile.json: valid")


@pytest.mark.parametrize(("change", "line"), [
    ({}, "validation FAILED over 300 steps: gap +2.41% vs tolerance 1.00%"),
    ({"gap": None}, "validation FAILED over 300 steps: diverged or stopped early (tolerance 1.00%)"),
    ({"judged_by": "noise", "judged_tolerance": 0.916}, "validation FAILED over 300 steps: gap +2.41% vs "
                                                        "tolerance 1.00%, judged at 91.6%"),
    ({"passed": True}, None),
    ({"passed": None, "stopped": "not run"}, None),
])
def test_failed_validation_line(change: dict, line: str | None) -> None:
    ev = {"passed": False, "gap": 0.0241, "tolerance": 0.01, "steps": 300, "judged_tolerance": 0.01,
          "judged_by": "tolerance", "rounds": [{"gap": 0.03, "change": "conv: sign -> q8"}] * 3, **change}
    assert failed_validation(ev) == line
    assert failed_validation(None) is None
