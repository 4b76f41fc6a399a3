"""The CLI surface: help, version, inspect, and one-line errors with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from inprocess import nfab_main
from typer.testing import CliRunner

from nfab import __version__
from nfab.cli.app import app

REPO = Path(__file__).resolve().parents[2]

runner = CliRunner()
NFAB = str(Path(sys.executable).parent / "nfab")


def test_help_lists_every_subcommand():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("calibrate", "fit", "train", "report", "inspect", "bench"):
        assert cmd in res.output


def test_version():
    res = subprocess.run([NFAB, "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and __version__ in res.stdout


def test_inspect_plans_a_billion_parameter_model_on_meta():
    res = subprocess.run([NFAB, "inspect", "gpt", "--size", "1.3b", "--world-size", "64"],
                         capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "PATH": ""})
    assert res.returncode == 0, res.stderr
    assert "1,315,819,520 parameters" in res.stdout
    assert "signcount" in res.stdout and "fewer bytes" in res.stdout


def test_inspect_mixed_route_keeps_norms_fp32():
    res = runner.invoke(app, ["inspect", "resnet18", "--world-size", "4", "--route",
                              "conv:sign,norm:fp32,bias:fp32", "width=16", "small_input=true", "num_classes=10"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    norm_row = next(line for line in res.output.splitlines() if line.strip().startswith("│ norm"))
    assert "fp32" in norm_row


def test_user_errors_are_one_line_and_exit_2():
    # through the console-script entry in this process; the installed script's own exit path is
    # test_version's and tests/report/test_report_cli.py::test_console_entry_exits_2_without_traceback's
    for args in (["inspect", "nosuchmodel"], ["inspect", "gpt", "--size", "huge"],
                 ["inspect", "gpt", "--profile", "/nonexistent/profile.json"]):
        res = nfab_main(*args)
        assert res.code == 2, (args, res.stderr)
        assert "Traceback" not in res.stderr + res.stdout
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_usage_and_file_system_errors_are_one_line_and_exit_2(tmp_path: Path):
    """click's own refusals (it boxes them in several lines) and an OSError on a path the user gave
    (a folder that cannot be made, a folder where a file goes) end as one line too."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    parquet = str(REPO / "calibrations/vit/calibration.parquet")
    for args, says in ((["train", "--steps", "abc"], "Invalid value for '--steps'"),
                       (["bogus"], "No such command 'bogus'"),
                       (["bench", "tta", "--steps", "0"], "greater than or equal to 1"),
                       (["demo", "--steps", "0", "--out", str(tmp_path / "demo")], "greater than or equal to 1"),
                       (["report", str(REPO / "calibrations/vit"), "--out", str(blocker / "report")], "a-file"),
                       (["fit", parquet, "-o", str(tmp_path)], "is a folder")):
        res = nfab_main(*args)
        assert res.code == 2, (args, res.stderr)
        assert "Traceback" not in res.stderr + res.stdout and says in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert blocker.read_text() == "not a folder\n"
    assert not (tmp_path / "demo").exists()  # refused before its calibration ran


def test_a_signal_to_the_launcher_exits_with_the_shells_code_for_it(monkeypatch, capsys):
    """torchrun's launcher turns SIGINT and SIGTERM into one SignalException: SIGTERM exited 130, 'interrupted'."""
    import signal

    import pytest
    from torch.distributed.elastic.multiprocessing.api import SignalException

    import nfab.cli.app as cli

    for signum, line in ((signal.SIGINT, "error: interrupted"), (signal.SIGTERM, "error: terminated (SIGTERM)")):
        def raiser(*_a, sig=signum, **_k):
            raise SignalException("stop", sig)

        monkeypatch.setattr(cli, "app", raiser)
        with pytest.raises(SystemExit) as info:
            cli.main()
        assert info.value.code == 128 + signum
        assert capsys.readouterr().err.strip() == line


def test_the_demo_carries_on_past_a_failed_validation_and_nothing_else(monkeypatch) -> None:
    """calibrate's exit 3 (profile written, validation failed) must not end `make demo`; any other code does."""
    import pytest

    from nfab.cli import demo
    from nfab.cli.calibrate import VALIDATION_FAILED

    for code in (VALIDATION_FAILED, 1):
        monkeypatch.setattr(demo.subprocess, "run",
                            lambda args, check, code=code: subprocess.CompletedProcess(args, code))
        if code == VALIDATION_FAILED:
            demo._run(["calibrate", "resnet18"], carry_on=VALIDATION_FAILED)
        with pytest.raises(SystemExit) as done:
            demo._run(["train"])  # a stage without carry_on: every non-zero code ends the demo
        assert done.value.code == code


def test_a_runs_last_line_names_the_steps_the_cost_gate_kept_at_fp32() -> None:
    """Under `--quiet` attach's cost-gate warning reaches only the log: `make demo`'s profile run on
    loopback ended "compression 1.0x" with nothing to say why. The line now names the gated steps,
    why and the override; an ungated run's line is as it was."""
    from nfab.cli.train import summary_text

    run = {"steps": 150, "wall_time_s": 15.1, "final_eval": {"loss": 0.0593, "accuracy": 0.9805},
           "compression_ratio": 1.0, "cost_gated_steps": 150}
    line = summary_text(run)
    assert line.startswith("150 steps, 15.1 s, eval loss 0.0593, accuracy 98.05%, compression 1.0x, ")
    assert "cost gate: some regions kept at FP32 on 150 of 150 steps" in line and "comm.cost_model=none" in line
    # on a declared link (make demo's) the gate priced the user's own link: no override to suggest
    declared = summary_text({**run, "cost_gated_steps": 140, "compression_ratio": 21.1}, "link:100mbit")
    assert declared.endswith("cost gate: some regions kept at FP32 on 140 of 150 steps (low bits were not modelled "
                             "15% cheaper on the declared link:100mbit)")
    assert summary_text({**run, "cost_gated_steps": 0, "compression_ratio": 30.7}) == (
        "150 steps, 15.1 s, eval loss 0.0593, accuracy 98.05%, compression 30.7x")
