"""`nfab report` through the CLI: tables printed, files written, user errors in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from nfab.cli.app import app

NFAB = Path(sys.executable).parent / "nfab"


def test_report_prints_tables_and_writes_files(standard: dict[str, Path], tmp_path: Path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["report", *map(str, standard.values()), "--out", str(out)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "sign-run" in result.output and "fp32-run" in result.output
    assert "Against the FP32 run" in result.output
    assert "Calibration cal" in result.output
    assert "6.9x" in result.output  # 80 MB fp32-equivalent / 11.6 MB sent
    assert (out / "report.html").is_file() and (out / "summary.csv").is_file()


def test_default_out_is_report_in_cwd(standard: dict[str, Path], tmp_path: Path,
                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["report", str(standard["sign"])])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report" / "report.html").is_file()


def test_incomplete_run_is_marked_in_terminal(make_run, tmp_path: Path):
    run = make_run("going", route="sign", wire_per_step=10, route_mix={"sign": 1.0},
                   summary=False)
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "o")],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "incomplete" in result.output


def test_broken_path_is_one_line_and_exit_2(tmp_path: Path):
    result = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "does not exist" in lines[0]


def test_console_entry_exits_2_without_traceback(tmp_path: Path):
    proc = subprocess.run([str(NFAB), "report", "/nonexistent"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "does not exist" in proc.stderr
    assert not (tmp_path / "report").exists()
