"""User errors end in one line and exit 2 with nothing written (the CLI in-process: no ranks start)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nfab.cli.app import main
from nfab.errors import ConfigError
from nfab.models import build_model, model_signature
from nfab.profile.schema import ModelRef, Profile
from nfab.train.config import load_config
from nfab.train.fault import Fault, parse_faults
from nfab.train.launch import check_gpus, explain_failure

REPO = Path(__file__).resolve().parents[2]
RESNET = ["--config", str(REPO / "configs/resnet18-digits.yaml"), "model.width=8", "--nproc", "2"]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["nfab", "train", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    return int(exc.value.code or 0), capsys.readouterr().err


def gpt_profile(tmp_path: Path) -> Path:
    spec = build_model("gpt", size="nano", device="meta")
    prof = Profile.static("sign")
    data = {**prof.to_dict(), "model": {**prof.to_dict()["model"], "name": "gpt"}}
    data["model"]["signature"] = model_signature(spec.module)
    path = tmp_path / "gpt-profile.json"
    path.write_text(json.dumps(data))
    assert Profile.load(path).model == ModelRef(name="gpt", signature=model_signature(spec.module))
    return path


@pytest.mark.parametrize("case", ["bad-yaml", "unknown-key", "unknown-option", "no-route", "missing-profile",
                                  "other-model-profile", "bad-fault", "resume-nothing",
                                  "unknown-parallel"])
def test_user_errors_are_one_line_exit_2_nothing_written(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    args = {
        "bad-yaml": ["--config", str(bad), "--fp32"],
        "unknown-key": [*RESNET, "--fp32", "optim.learning_rate=0.1"],
        "unknown-option": [*RESNET, "--fp32", "model.depth=3"],
        "no-route": RESNET,
        "missing-profile": [*RESNET, "--profile", str(tmp_path / "nope.json")],
        "other-model-profile": [*RESNET, "--profile", str(gpt_profile(tmp_path))],
        "bad-fault": [*RESNET, "--fp32"],
        "resume-nothing": [*RESNET, "--fp32", "--resume"],
        "unknown-parallel": [*RESNET, "--fp32", "--parallel", "zero"],
    }[case]
    if case == "bad-fault":
        monkeypatch.setenv("NFAB_FAULT", "crash@rank=1")
    code, err = run_cli([*args, "--run-dir", str(run_dir)], capsys, monkeypatch)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:"), err
    assert not run_dir.exists()


@pytest.mark.parametrize("args,named", [
    (["--fp32", "--steps", "2", "steps=abc"], "'steps=abc' and --steps both set steps"),
    (["--route", "sign", "--steps", "1", "comm.route=q8"], "'comm.route=q8' and --route both set comm.route"),
    (["--fp32", "--steps", "1", "--model", "resnet18", "model.name=vit"], "'model.name=vit' and --model"),
    (["--fp32", "--steps", "1", "launch={nproc: 3}"], "and --nproc both set launch.nproc"),
])
def test_a_key_given_as_option_and_override_is_refused(
    args: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`steps=abc --steps 2` trained 2 steps and never said abc was no number: --steps won in silence."""
    run_dir = tmp_path / "run"
    code, err = run_cli([*RESNET, *args, "--run-dir", str(run_dir)], capsys, monkeypatch)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:") and named in err, err
    assert "give it once" in err and not run_dir.exists()


def test_overrides_are_typed_and_dotted() -> None:
    cfg = load_config(REPO / "configs/resnet18-digits.yaml", ["optim.lr=0.1", "model.width=8", "steps=7",
                                                              "comm.route={conv: sign, '*.bias': fp32}"])
    assert cfg.optim.lr == 0.1 and cfg.model.options["width"] == 8 and cfg.steps == 7
    assert cfg.comm.route == {"conv": "sign", "*.bias": "fp32"}


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = load_config(path, ["comm.fp32=true"])
    cfg.comm.check_choice()


def test_fault_syntax() -> None:
    assert parse_faults("crash@step=3,rank=1") == (Fault("crash", 3, 1, 0),)
    assert parse_faults("crash@step=2;crash@step=4,rank=1,attempt=1")[1] == Fault("crash", 4, 1, 1)
    assert parse_faults("") == ()


def test_more_ranks_than_gpus_is_one_line_before_launch() -> None:
    """A GPU node runs one rank per GPU; a CPU machine (no GPU) any number of gloo ranks."""
    check_gpus(4, 0)
    check_gpus(8, 8)
    with pytest.raises(ConfigError, match=r"^--nproc 9 on a node with 8 GPUs: nfab runs one rank per GPU; pass "
                                          r"--nproc 8 or fewer$"):
        check_gpus(9, 8)


def test_a_rank_nccls_watchdog_aborted_is_named_a_collective_timeout() -> None:
    """Under NCCL a timed-out collective is ended by the watchdog (SIGABRT), so the rank never prints
    nfab's own timeout line; the launcher tells it from the watchdog's line in the log."""
    log = ("[rank1]:[E1206 00:30:34 ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught "
           "collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=3, NumelOut=3, "
           "Timeout(ms)=10000) ran for 10012 milliseconds before timing out.\n")
    line, code = explain_failure(log, 1, -6)
    assert code == 1 and line.startswith("rank 1: a collective timed out after launch.timeout_s and NCCL's watchdog")
    assert "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=3, NumelOut=3, Timeout(ms)=10000)" in line
    assert explain_failure("", 1, -6) == ("rank 1 was killed by signal 6", 1)  # an abort without the watchdog's line
