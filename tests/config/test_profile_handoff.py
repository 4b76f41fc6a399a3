"""The profile is the handoff: `--profile` alone reproduces the calibrated setting; models fit their data set.

Checked with the parent's own validation (no ranks start); `tests/cli/test_readme_quickstart.py`
trains for real.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nfab.calibrate import make_config
from nfab.cli.app import main
from nfab.cli.calibrate import VALIDATION_FAILED
from nfab.config.shipped import resolve_config as resolve_config_name
from nfab.config.shipped import shipped_names
from nfab.errors import ConfigError, NfabError, ProfileError
from nfab.profile.schema import Profile
from nfab.train.launch import resolve_config, validate

REPO = Path(__file__).resolve().parents[2]


def resolved(tmp_path: Path, *, config: str | None = None, overrides: list[str] | None = None,
             flags: list[str] | None = None, names: dict[str, str] | None = None):
    flags = [*(flags or []), f"run_dir={tmp_path / 'run'}"]
    return validate(resolve_config(config, list(overrides or []), flags, names=names or {}))


@pytest.mark.parametrize("name", shipped_names("calibrations"))
def test_every_shipped_profile_reproduces_its_setting_alone(name: str, tmp_path: Path) -> None:
    path = REPO / "calibrations" / name / "profile.json"
    cfg = resolved(tmp_path, flags=[f"comm.profile={path}"])
    setting = Profile.load(path).provenance["calibrated"]
    assert cfg.model.name == name
    assert cfg.data.name == setting["dataset"] and cfg.data.batch_size == setting["batch_size"]
    assert cfg.optim.name == setting["optimizer"]["name"] and cfg.optim.lr == setting["optimizer"]["lr"]
    assert cfg.steps == setting["steps"]
    assert cfg.launch.nproc == setting["world_size"]  # it trained on one rank before: no gradient was sent
    # by name, too; explicit flags and key=value win over the profile
    again = resolved(tmp_path, flags=[f"comm.profile={name}", "steps=7", "launch.nproc=2"],
                     overrides=["optim.lr=0.001"])
    assert again.comm.profile == str(path) and again.steps == 7 and again.optim.lr == 0.001
    assert again.launch.nproc == 2


@pytest.mark.parametrize("comm", [["comm.fp32=true"], ["comm.route=bq2"]])
def test_a_profile_beside_fp32_or_a_route_gives_its_setting_as_the_baseline(comm: list[str], tmp_path: Path) -> None:
    """`--profile P --fp32`: the FP32 run of P's calibrated setting (the same model, data and W), the
    fair baseline beside `--profile P` (the README's FP32 line ran a config file at another W)."""
    calibrated = resolved(tmp_path, flags=["comm.profile=resnet18"])
    cfg = validate(resolve_config(None, [], [*comm, f"run_dir={tmp_path / 'run'}"], setting="resnet18"))
    assert cfg.comm.profile is None and (cfg.comm.fp32 or cfg.comm.route == "bq2")
    for key in ("model", "data", "optim", "schedule", "launch"):
        assert getattr(cfg, key) == getattr(calibrated, key), key
    assert cfg.steps == calibrated.steps and cfg.seed == calibrated.seed


def test_a_profile_without_a_setting_pairs_the_named_model_with_its_task_data(tmp_path: Path) -> None:
    """A hand-written profile (no `provenance.calibrated`) with `--model resnet18` was paired with the config
    default's stdlib-text and refused; `--model` alone picks digits."""
    path = Profile.static("bq2", model_name="resnet18").save(tmp_path / "p.json")
    assert resolved(tmp_path, flags=[f"comm.profile={path}"], names={"model": "resnet18"}).data.name == "digits"


def test_a_changed_option_is_named_in_the_signature_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"options differ from the calibrated setting: "
                                           r"model\.width=8 \(calibrated: 16\)"):
        resolved(tmp_path, flags=["comm.profile=resnet18"], overrides=["model.width=8"])
    with pytest.raises(ProfileError, match="calibrated for model resnet18, this run builds vit"):
        resolved(tmp_path, flags=["comm.profile=resnet18"], names={"model": "vit"})


def test_models_fit_their_data_set(tmp_path: Path) -> None:
    for model, data in (("resnet18", "digits"), ("vit", "digits"), ("gpt", "stdlib-text")):
        # `--model M` alone: M's task picks the data set, as calibrate does (resnet18 got stdlib-text)
        assert resolved(tmp_path, flags=["comm.route=sign"], names={"model": model}).data.name == data
    cfg = resolved(tmp_path, flags=["comm.route=sign"], names={"model": "resnet18", "data": "digits"})
    assert cfg.model.options == {"num_classes": 10, "in_channels": 1, "image_size": 8, "small_input": True}
    vit = resolved(tmp_path, flags=["comm.route=sign"], names={"model": "vit", "data": "digits"})
    assert vit.model.options["image_size"] == 8 and vit.model.options["in_channels"] == 1
    gpt = resolved(tmp_path, flags=["comm.route=sign"], overrides=["data.block_size=32"],
                   names={"model": "gpt", "data": "stdlib-text"})
    assert gpt.model.options["block_size"] == 32 and gpt.model.options["vocab_size"] == 256
    big = resolved(tmp_path, flags=["comm.route=sign"], overrides=["data.image_size=64"],
                   names={"model": "resnet18", "data": "synthetic-images"})
    assert big.model.options["small_input"] is False  # 64 px keeps the ImageNet stem
    keep = resolved(tmp_path, flags=["comm.route=sign"], overrides=["model.small_input=false"],
                    names={"model": "resnet18", "data": "digits"})
    assert keep.model.options["small_input"] is False  # explicit options win
    with pytest.raises(ConfigError, match="model resnet18 has 1000 classes, data set digits 10"):
        resolved(tmp_path, flags=["comm.route=sign"], overrides=["model.num_classes=1000"],
                 names={"model": "resnet18", "data": "digits"})


def test_calibrate_and_train_read_the_same_config(tmp_path: Path) -> None:
    cal = make_config("resnet18", config=str(REPO / "configs/resnet18-digits.yaml"), overrides={"model.width": 8})
    train = resolved(tmp_path, config="resnet18-digits", overrides=["model.width=8"], flags=["comm.fp32=true"])
    assert cal.setting.model == train.model and cal.setting.data.name == train.data.name
    assert cal.batch_size == train.data.batch_size and cal.steps == train.steps
    assert cal.schedule == train.schedule
    assert cal.optimizer.model_dump(exclude={"name", "lr", "weight_decay"}) == train.optim.model_dump(
        exclude={"name", "lr", "weight_decay"})
    assert (cal.optimizer.name, cal.optimizer.lr, cal.optimizer.weight_decay) == (
        train.optim.name, train.optim.lr, train.optim.weight_decay)


def test_a_user_model_is_calibrated_under_its_declared_optimizer() -> None:
    cfg = make_config("bench.heldout.gpt:user_gpt")
    assert cfg.optimizer.name == "adamw" and cfg.optimizer.lr == 3e-3 and cfg.dataset == "stdlib-text"


def test_shipped_configs_resolve_by_name() -> None:
    assert resolve_config_name("gpt-nano-stdlib") == REPO / "configs" / "gpt-nano-stdlib.yaml"
    with pytest.raises(ConfigError, match="no shipped config of that name.*gpt-nano-stdlib"):
        resolve_config_name("gpt-nano")


def test_user_model_profile_round_trip(tmp_path: Path, capsys, monkeypatch) -> None:
    """calibrate a `module:factory` model, then `train --profile` alone validates against it."""
    out = tmp_path / "cal"
    monkeypatch.setattr(sys, "argv", [
        "nfab", "calibrate", "bench.heldout.gpt:user_gpt", "--steps", "4", "--phases", "1", "--trial-steps", "1",
        "--routes", "fp32,sign", "--quick", "--out", str(out), "data.max_bytes=40000", "batch_size=2",
        "eval_samples=4", "ef_steps=1", "d_model=32"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code in (0, None, VALIDATION_FAILED)  # 4 steps: a verdict either way
    profile = Profile.load(out / "profile.json")
    setting = profile.provenance["calibrated"]
    assert setting["optimizer"]["name"] == "adamw" and setting["model"] == "bench.heldout.gpt:user_gpt"
    cfg = resolved(tmp_path, flags=[f"comm.profile={out / 'profile.json'}"])
    assert cfg.model.name == "bench.heldout.gpt:user_gpt" and cfg.model.options["d_model"] == 32
    assert cfg.optim.name == "adamw" and cfg.steps == 4 and cfg.data.batch_size == 2


@pytest.mark.slow
def test_model_and_dataset_flags_alone_train(tmp_path: Path) -> None:
    """The issue's command: `nfab train --model resnet18 --dataset digits --route sign --nproc 2` trains."""
    import json
    import os
    import subprocess

    nfab = str(Path(sys.executable).parent / "nfab")
    res = subprocess.run([nfab, "train", "--model", "resnet18", "--dataset", "digits", "--route", "sign", "--nproc",
                          "2", "--steps", "2", "--quiet", "--run-dir", str(tmp_path / "run")],
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=280,
                         check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["complete"] and summary["world_size"] == 2


def test_model_and_dataset_flags_win_over_the_config_file(tmp_path: Path) -> None:
    cfg = resolved(tmp_path, config="resnet18-digits", flags=["comm.route=sign"], names={"model": "vit"})
    assert cfg.model.name == "vit" and "width" not in cfg.model.options  # resnet's options do not follow
    assert cfg.data.name == "digits" and cfg.model.options["image_size"] == 8


@pytest.mark.parametrize(("flags", "match"), [
    (["comm.route=bq2", "comm.error_feedback=true"], "error_feedback=True is not offered on FSDP2"),
    (["comm.route=bq2", "comm.hierarchy=1x2"], "hierarchy= is not offered on FSDP2"),
    (["comm.route=bf16"], "route bf16 is not offered on FSDP2"),
    (["comm.route=q8", "comm.qsum_scale=delayed"], "qsum_scale='delayed' is not offered on FSDP2"),
    (["comm.route=bq2", "comm.bucket_cap_mb=4"], "comm.bucket_cap_mb sizes DDP's buckets"),
])
def test_what_fsdp2_refuses_is_refused_before_the_ranks_start(tmp_path: Path, flags: list[str], match: str) -> None:
    """It was refused inside rank 0, after the run dir was made ("training failed: rank 0 ...")."""
    from nfab.runtime.frontends import fsdp2

    if fsdp2.unsupported() is not None:
        pytest.skip(fsdp2.unsupported())
    with pytest.raises(NfabError, match=match):
        resolved(tmp_path, config="gpt-nano-stdlib", flags=[*flags, "parallel=fsdp"])
    assert not (tmp_path / "run").exists()


def test_a_model_with_nothing_to_train_is_refused_before_the_ranks_start(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP refuses a module without a trainable parameter, inside every rank after the run dir is made."""
    (tmp_path / "frozenmodel.py").write_text(
        "from torch import nn\n\n\ndef build(**options):\n    m = nn.Linear(64, 10)\n"
        "    m.requires_grad_(False)\n    return m\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="model frozenmodel:build has no trainable parameter"):
        resolved(tmp_path, flags=["comm.route=sign"], names={"model": "frozenmodel:build", "data": "digits"})
    assert not (tmp_path / "run").exists()


def test_a_profile_that_failed_its_validation_says_so_when_it_trains(tmp_path: Path) -> None:
    """calibrate printed 'FAILED' once; `profile check` then said only 'valid' and train used it with no notice.
    The notice is one short line (it was ~1,000 characters: every round's gap and change); `nfab profile
    check` exits 3 on it (tests/cli/test_profile_cli.py)."""
    import json

    data = json.loads((REPO / "calibrations/gpt/profile.json").read_text())
    data["evidence"]["validation"].update(passed=False, gap=0.0241)
    (path := tmp_path / "failed.json").write_text(json.dumps(data))
    said: list[str] = []
    validate(resolve_config(None, [], [f"comm.profile={path}", f"run_dir={tmp_path / 'run'}"]), warn=said.append)
    failed = [line for line in said if "FAILED" in line]
    assert failed == [f"profile {path}: validation FAILED over 300 steps: gap +2.41% vs tolerance 1.00%; it trains "
                      "as calibrated: recalibrate it (nfab calibrate) or train --fp32"], said
    said.clear()
    validate(resolve_config(None, [], ["comm.profile=gpt", f"run_dir={tmp_path / 'run2'}"]), warn=said.append)
    assert not any("FAILED" in line for line in said)
