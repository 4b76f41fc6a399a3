"""Bad input through the real CLI: one clear line on stderr, exit 2, no traceback, nothing written.

Every case is refused by the parent before any rank starts, so these stay in the fast suite.
Most run through the console-script entry in this process (`inprocess.nfab_main`: a
subprocess would be mostly the interpreter and torch starting); the cases in `SUBPROCESS`
run the installed `nfab` script, two at a time, so the real process's exit path, environment
(NFAB_FAULT) and weights-only checkpoint load are covered as a user meets them.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from inprocess import nfab_main
from relrun import GPT, REPO, RESNET, Result, nfab, one_line_error, tree, write_profile

from nfab.models import build_model, model_signature
from nfab.train.metrics import write_metrics, write_summary

W2 = ["--nproc", "2"]


@dataclass
class Case:
    args: list[str]
    expect: str
    env: dict[str, str] = field(default_factory=dict)
    watch: Path | None = None  # a folder that must be left exactly as it was (or absent)


class _Evil:
    """Unpickling this would run a shell command; a weights-only load must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def fake_checkpoint(run_dir: Path, model_state: object, world: int = 2, complete: bool = False) -> Path:
    """A run dir as a crashed (or finished) run leaves it: config, summary, metrics, one checkpoint."""
    ckpt = run_dir / "checkpoints" / "step-000003"
    ckpt.mkdir(parents=True)
    torch.save({"model": model_state, "step": 3}, ckpt / "state.pt")
    for r in range(world):
        torch.save({"rng": None, "hook": None}, ckpt / f"rank{r}.pt")
    (run_dir / "checkpoints" / "latest").write_text("step-000003\n")
    (run_dir / "config.json").write_text(json.dumps({"model": {"name": "gpt", "options": {"size": "nano"}}}))
    (run_dir / "summary.json").write_text(json.dumps({"complete": complete, "steps": 3}))
    write_metrics(run_dir / "metrics.parquet", [])
    return run_dir


def build_cases(root: Path) -> dict[str, Case]:
    gpt = build_model("gpt", size="nano", device="meta").module
    (bad_json := root / "bad.json").write_text('{"schema": "nfab.profile", "version": 1,\n')
    other_version = write_profile(root / "v1.json", "sign")
    other_version.write_text(other_version.read_text().replace('"version": 1', '"version": 2'))
    (pickled := root / "profile.json.pkl").write_bytes(pickle.dumps({"schema": "nfab.profile"}))
    other_model = root / "gpt-profile.json"
    data = json.loads(write_profile(other_model, "sign", model="gpt").read_text())
    data["model"]["signature"] = model_signature(gpt)
    other_model.write_text(json.dumps(data))
    strict = {"fallback": {"on_capacity": "error"}}
    narrow = write_profile(root / "w4-8.json", "sign", world_size={"min": 4, "max": 8}, **strict)
    q2 = write_profile(root / "q2.json", "q2", **strict)
    finished = fake_checkpoint(root / "finished", {}, complete=True)
    gpt_ckpt = fake_checkpoint(root / "gpt-run", build_model("gpt", size="nano").module.state_dict())
    evil = fake_checkpoint(root / "evil-run", {"x": _Evil(root / "PWNED")})
    shipped = REPO / "calibrations" / "gpt" / "calibration.parquet"
    (truncated := root / "truncated.parquet").write_bytes(shipped.read_bytes()[: shipped.stat().st_size // 2])
    (not_parquet := root / "calibration.parquet").write_text("step,loss\n0,1.0\n")
    bad_run = root / "bad-run"
    bad_run.mkdir()
    write_summary(bad_run / "summary.json", {"model": "gpt", "dataset": "stdlib-text", "world_size": 2}, [],
                  lm=True, complete=True, wall_time_s=1.0)
    (bad_run / "metrics.parquet").write_bytes(b"PAR1" + b"\0" * 64)
    run = root / "run"  # must never be created by a refused `nfab train`
    train_gpt = ["train", *GPT, *W2, "--run-dir", str(run)]
    train_resnet = ["train", *RESNET, *W2, "--run-dir", str(run)]
    return {
        "malformed-json-profile": Case([*train_gpt, "--profile", str(bad_json)],
                                       f"profile {bad_json} is not valid JSON"),
        "other-schema-version": Case([*train_gpt, "--profile", str(other_version)],
                                     "profile schema version 2 is not supported (this nfab reads 1)"),
        "pickled-profile": Case([*train_gpt, "--profile", str(pickled)],
                                "is a pickle, not JSON: profiles are JSON only, never pickles"),
        "profile-for-another-model": Case([*train_resnet, "--profile", str(other_model)],
                                          "profile was made for model 'gpt' with another parameter layout"),
        "world-outside-range-strict": Case([*train_gpt, "--profile", str(narrow)],
                                           "is valid for world sizes 4..8, this run has 2 ranks "
                                           "(fallback.on_capacity is 'error')"),
        "over-capacity-strict": Case(["train", *GPT, "--nproc", "4", "--run-dir", str(run), "--profile", str(q2)],
                                     "route q2 cannot run exactly at W=4 (qsum: 2-bit lanes leave fewer than 2 "
                                     "levels per rank); fallback.on_capacity is 'error'"),
        "unknown-model": Case([*train_gpt, "--route", "sign", "--model", "gpt5"], "unknown model 'gpt5'"),
        "unknown-dataset": Case([*train_gpt, "--route", "sign", "--dataset", "imagenet"],
                                "unknown data set 'imagenet'"),
        "unknown-route": Case([*train_gpt, "--route", "q3"], "route: unknown route 'q3'"),
        # a glob that matches no parameter was refused inside rank 0, ~17 s later, after the run dir was made
        "route-glob-matching-nothing": Case([*train_resnet, "--route", "conv:sign,lyr1.*:bq2"],
                                            "route glob 'lyr1.*' matches no trainable parameter"),
        "inspect-profile-of-another-model": Case(["inspect", "resnet18", "--profile", "vit"],
                                                 "it was calibrated for model vit, this run builds resnet18"),
        "inspect-glob-matching-nothing": Case(["inspect", "resnet18", "--route", "conv:sign,lyr1.*:bq2"],
                                              "route glob 'lyr1.*' matches no trainable parameter"),
        "unknown-config-key": Case([*train_gpt, "--route", "sign", "optim.learning_rate=0.1"],
                                   "unknown key 'optim.learning_rate' (keys: betas, grad_clip, lr, momentum, name, "
                                   "weight_decay)"),
        "bad-fault": Case([*train_gpt, "--route", "sign"], "NFAB_FAULT: 'spike@step=2' needs factor=VALUE",
                          env={"NFAB_FAULT": "spike@step=2"}),
        "finished-run-dir": Case(["train", *GPT, *W2, "--route", "sign", "--run-dir", str(finished)],
                                 "already holds a finished run; pass --resume to continue it or --overwrite",
                                 watch=finished),
        "checkpoint-of-another-model": Case(
            ["train", *RESNET, *W2, "--route", "sign", "--resume", "--run-dir", str(gpt_ckpt)],
            "was written for another model", watch=gpt_ckpt),
        "pickle-code-in-checkpoint": Case(
            ["train", *GPT, *W2, "--route", "sign", "--resume", "--run-dir", str(evil)],
            "state.pt holds objects other than tensors and plain containers (posix.system); nfab loads "
            "checkpoints weights-only and refuses it", watch=evil),
        "fit-truncated-parquet": Case(["fit", str(truncated), "-o", str(root / "fit-out" / "p.json")],
                                      f"cannot read {truncated}", watch=root / "fit-out"),
        "fit-not-parquet": Case(["fit", str(not_parquet), "-o", str(root / "fit-out" / "p.json")],
                                "(truncated or not Parquet?)", watch=root / "fit-out"),
        "fit-missing": Case(["fit", str(root / "nope.parquet")], "does not exist"),
        "report-truncated-metrics": Case(["report", str(bad_run), "--out", str(root / "report")],
                                         f"cannot read {bad_run / 'metrics.parquet'}", watch=root / "report"),
    }


SUBPROCESS = {"bad-fault", "pickle-code-in-checkpoint", "fit-truncated-parquet", "report-truncated-metrics"}
"""Cases run as a real `nfab` process: the environment-driven one, the hostile checkpoint, and one per
other command."""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Case, Result, dict, dict]]:
    root = tmp_path_factory.mktemp("bad-input")
    cases = build_cases(root)
    assert all(not case.env for name, case in cases.items() if name not in SUBPROCESS)  # in-process: no env

    def job(case: Case, in_process: bool) -> Callable[[], tuple[Case, Result, dict, dict]]:
        def go() -> tuple[Case, Result, dict, dict]:
            before = tree(case.watch) if case.watch and case.watch.exists() else {}
            if in_process:
                ran = nfab_main(*case.args)
                result = Result(ran.code, ran.stdout, ran.stderr, ran.seconds)
            else:
                result = nfab(*case.args, env=case.env, timeout=120)
            after = tree(case.watch) if case.watch and case.watch.exists() else {}
            return case, result, before, after
        return go

    with ThreadPoolExecutor(max_workers=2) as pool:  # the subprocesses start first and overlap the rest
        futures = {name: pool.submit(job(cases[name], False)) for name in sorted(SUBPROCESS)}
        done = {name: job(case, True)() for name, case in cases.items() if name not in SUBPROCESS}
        done |= {name: f.result() for name, f in futures.items()}
    assert not (root / "run").exists(), "a refused run created its run dir"
    assert not (root / "PWNED").exists(), "a checkpoint ran code while loading"
    assert not (root / "profile.json").exists(), "a refused fit wrote a profile beside its table"
    return done


CASES = ["malformed-json-profile", "other-schema-version", "pickled-profile", "profile-for-another-model",
         "world-outside-range-strict", "over-capacity-strict", "unknown-model", "unknown-dataset", "unknown-route",
         "unknown-config-key", "bad-fault", "finished-run-dir", "checkpoint-of-another-model",
         "pickle-code-in-checkpoint", "fit-truncated-parquet", "fit-not-parquet", "fit-missing",
         "report-truncated-metrics", "route-glob-matching-nothing", "inspect-profile-of-another-model",
         "inspect-glob-matching-nothing"]


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_exit_2_nothing_written(name: str, outcomes) -> None:
    case, result, before, after = outcomes[name]
    line = one_line_error(result)
    assert case.expect in line, line
    assert after == before, "the refused command changed files it must not touch"


def test_cases_cover_the_table(outcomes) -> None:
    assert sorted(outcomes) == sorted(CASES) and SUBPROCESS <= set(CASES)

