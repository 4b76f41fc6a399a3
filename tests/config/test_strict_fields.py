"""Every config and profile field refuses a wrongly typed value: one line naming the field, exit 2.

The cases are generated from the typed models themselves, so a field added later is
covered without touching this file.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel

from nfab.bench.step import BenchConfig
from nfab.calibrate.config import CalibrationConfig
from nfab.cli.app import main
from nfab.config.run import TrainConfig
from nfab.errors import ConfigError
from nfab.models.options import options_model
from nfab.models.registry import MODELS
from nfab.profile.schema import Profile

REPO = Path(__file__).resolve().parents[2]
RESNET_YAML = yaml.safe_load((REPO / "configs/resnet18-digits.yaml").read_text())
SHIPPED_PROFILE = json.loads((REPO / "calibrations/resnet18/profile.json").read_text())


def wrong_value(annotation: Any) -> Any:
    """A JSON value of the wrong type for `annotation` (a string for numbers, a number for strings)."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        kinds = set(args)
        if kinds & {int, float, bool, dict} or any(typing.get_origin(a) in (dict, tuple, list) for a in args):
            return "fast" if str not in kinds else [1.5]
        return [1.5]
    if origin is Literal:
        return 7
    if annotation is bool:
        return "false"
    if annotation is int:
        return 25.5
    if annotation is float:
        return "fast"
    if annotation is str:
        return 5
    if origin in (dict, tuple, list):
        return "x"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "x"
    raise AssertionError(f"no wrong value for {annotation!r}")


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, annotation) of every field, descending into sub-models."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        path = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += leaf_fields(ann, path + ".")
        else:
            out.append((path, ann))
    return out


def set_path(data: dict, path: str, value: Any) -> None:
    keys = path.split(".")
    for k in keys[:-1]:
        data = data.setdefault(k, {})
    data[keys[-1]] = value


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["nfab", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    return int(exc.value.code or 0), capsys.readouterr().err


def one_line(code: int, err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return " ".join(lines[0].split())


TRAIN_FIELDS = leaf_fields(TrainConfig)


@pytest.mark.parametrize(("path", "annotation"), TRAIN_FIELDS, ids=[p for p, _ in TRAIN_FIELDS])
def test_every_train_config_field_refuses_a_wrong_type(path, annotation, tmp_path, capsys, monkeypatch) -> None:
    data = {**json.loads(json.dumps(RESNET_YAML)), "steps": 2}  # should a case slip through, it stays short
    set_path(data, path, wrong_value(annotation))
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(data))
    choice = [] if path.startswith("comm.") else ["--fp32"]  # a choice flag would override comm.*
    run_dir = [] if path == "run_dir" else ["--run-dir", str(tmp_path / "run")]  # the flag would override it
    code, err = run_cli(["train", "--config", str(config), *choice, *run_dir], capsys, monkeypatch)
    line = one_line(code, err)
    assert path in line, line
    assert not (tmp_path / "run").exists()


PROFILE_FIELDS = [(p, a) for p, a in leaf_fields(Profile) if p not in ("phases",)]
PHASE_FIELDS = [("phases[0]." + p, a) for p, a in leaf_fields(Profile.model_fields["phases"].annotation.__args__[0])]


@pytest.mark.parametrize(("path", "annotation"), PROFILE_FIELDS + PHASE_FIELDS,
                         ids=[p for p, _ in PROFILE_FIELDS + PHASE_FIELDS])
def test_every_profile_field_refuses_a_wrong_type(path, annotation, tmp_path, capsys, monkeypatch) -> None:
    data = json.loads(json.dumps(SHIPPED_PROFILE))
    value = wrong_value(annotation)
    if path.startswith("phases[0]."):
        set_path(data["phases"][0], path.removeprefix("phases[0]."), value)
    else:
        set_path(data, path, value)
    profile = tmp_path / "bad.json"
    profile.write_text(json.dumps(data))
    code, err = run_cli(["train", "--profile", str(profile), "--run-dir", str(tmp_path / "run")], capsys, monkeypatch)
    line = one_line(code, err)
    assert f"profile.{path}" in line, line
    assert not (tmp_path / "run").exists()


def test_the_issue_examples_are_refused() -> None:
    doc = json.loads(json.dumps(SHIPPED_PROFILE))
    for mutate, expect in [
        (lambda d: d["phases"][0].update(error_feedback="false"), 'error_feedback must be true or false, got "false"'),
        (lambda d: d["fallback"].update(cost_gate="no"), 'cost_gate must be true or false, got "no"'),
        (lambda d: d["health"].update(probe_every=25.5), "probe_every must be an integer, got 25.5"),
    ]:
        d = json.loads(json.dumps(doc))
        mutate(d)
        with pytest.raises(ConfigError.__base__, match=expect):
            Profile.from_dict(d)


SWEEP_FIELDS = [(p, a) for p, a in leaf_fields(CalibrationConfig) if not p.startswith("setting.")]


@pytest.mark.parametrize(("path", "annotation"), SWEEP_FIELDS, ids=[p for p, _ in SWEEP_FIELDS])
def test_every_calibrate_field_refuses_a_wrong_type(path, annotation, tmp_path, capsys, monkeypatch) -> None:
    value = json.dumps(wrong_value(annotation))
    code, err = run_cli(["calibrate", "resnet18", "--out", str(tmp_path / "cal"), f"{path}={value}"],
                        capsys, monkeypatch)
    line = one_line(code, err)
    assert path in line, line
    assert not (tmp_path / "cal").exists()


def test_calibrate_setting_fields_are_the_train_config() -> None:
    assert CalibrationConfig.model_fields["setting"].annotation is TrainConfig


BENCH_FIELDS = [(name, typing.get_type_hints(BenchConfig)[name]) for name in BenchConfig.__dataclass_fields__]


@pytest.mark.parametrize(("name", "annotation"), BENCH_FIELDS, ids=[n for n, _ in BENCH_FIELDS])
def test_every_bench_field_refuses_a_wrong_type(name, annotation) -> None:
    data = {**BenchConfig().to_dict(), name: wrong_value(annotation)}
    with pytest.raises(ConfigError, match=rf"bench\.{name}") as info:
        BenchConfig.from_dict(data)
    assert "\n" not in str(info.value)


def test_unknown_keys_are_refused_everywhere(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown key 'bench.colour'"):
        BenchConfig.from_dict({**BenchConfig().to_dict(), "colour": 1})
    doc = json.loads(json.dumps(SHIPPED_PROFILE))
    doc["health"]["colour"] = 1
    with pytest.raises(ConfigError.__base__, match="unknown key 'profile.health.colour'"):
        Profile.from_dict(doc)


MODEL_OPTIONS = [(m, name, field.annotation) for m, builder in MODELS.items()
                 for name, field in options_model(builder).model_fields.items()]


@pytest.mark.parametrize(("model", "option", "annotation"), MODEL_OPTIONS,
                         ids=[f"{m}.{o}" for m, o, _ in MODEL_OPTIONS])
def test_every_model_option_refuses_a_wrong_type(model, option, annotation, tmp_path, capsys, monkeypatch) -> None:
    value = json.dumps(wrong_value(annotation))
    config = {"resnet18": "resnet18-digits", "vit": "vit-digits", "gpt": "gpt-nano-stdlib"}[model]
    code, err = run_cli(["train", "--config", config, "--fp32", f"model.{option}={value}",
                         "--run-dir", str(tmp_path / "run")], capsys, monkeypatch)
    line = one_line(code, err)
    assert f"option {option}" in line, line


def test_a_value_that_fits_no_member_of_a_union_is_one_plain_line() -> None:
    """`comm.error_feedback=maybe` read 'comm.error_feedback.bool must be true or false, got "maybe" (and 1 more
    problem)': pydantic's name of a union member in the key path, and the other member hidden."""
    from nfab.errors import ConfigError
    from nfab.train.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, ["comm.error_feedback=maybe"])
    assert str(info.value) == "comm.error_feedback must be true or false or 'auto', got \"maybe\""
