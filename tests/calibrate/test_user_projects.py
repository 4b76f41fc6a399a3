"""The user's own training, calibrated: six projects written as their users write them (bench/projects),
each through `nfab calibrate --data --loss` and through `nfab.calibrate`, then trained with the profile
in the user's own DDP loop on gloo. Short settings: these check the contract end to end, not the quality
(the W=4, 300-step comparison is `python -m bench.userprojects`, its figures in docs/calibrate-your-own.md)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

import nfab
from bench.projects import files
from nfab.profile.schema import Profile
from tests.inprocess import nfab_main

PROJECTS = {
    "cnn-npz": ("bench.projects.cnn:build", "npz", None, []),
    "autoencoder-mse": ("bench.projects.autoencoder:build", "npy", "bench.projects.autoencoder:mse", []),
    "denoiser": ("bench.projects.denoiser:build", "bench.projects.denoiser:data", "bench.projects.denoiser:loss",
                 []),
    "contrastive": ("bench.projects.contrastive:build", "bench.projects.contrastive:data",
                    "bench.projects.contrastive:info_nce", []),
    "nanogpt-tokens": ("bench.projects.nanogpt:build", "tokens", None, ["optimizer=adamw", "block_size=32"]),
    "gpt2-modeloutput": ("bench.projects.hf_gpt2:build", "bench.projects.hf_gpt2:data", None, ["optimizer=adamw"]),
}


def _data(kind: str, tmp: Path) -> str:
    if kind == "npz":
        return f"npz:{files.digits_npz(tmp / 'digits.npz')}"
    if kind == "npy":
        return f"npy:{files.digits_rows_npy(tmp / 'rows.npy')}"
    if kind == "tokens":
        return f"tokens:{files.nanogpt_dir(tmp / 'shakespeare_char', chars=20_000)}"
    return kind


def _cli(name: str, tmp: Path, out: Path) -> list[str]:
    model, kind, loss, extra = PROJECTS[name]
    args = ["calibrate", model, "--data", _data(kind, tmp), "-w", "2", "--steps", "12", "--quick", "--no-validate",
            "--out", str(out), "batch_size=16", *extra]
    return args + (["--loss", loss] if loss else [])


def _rows(table: pd.DataFrame) -> pd.DataFrame:
    """The measured cells, less the wall-clock column."""
    return table.drop(columns=["encode_decode_s"]).reset_index(drop=True)


@pytest.mark.parametrize("name", sorted(PROJECTS))
def test_each_project_calibrates_through_the_cli(name: str, tmp_path: Path) -> None:
    out = tmp_path / "cal"
    ran = nfab_main(*_cli(name, tmp_path, out))
    assert ran.code == 0, ran.stderr + ran.stdout
    table, meta = nfab.calibrate.read_table(out / "calibration.parquet")
    model, _, loss, _ = PROJECTS[name]
    assert meta["model"] == model and meta["loss"] == (loss or "default")
    assert len(table) > 0 and table["cosine"].notna().any()
    profile = Profile.load(out / "profile.json")
    assert profile.model.name == model and profile.phases


@pytest.mark.parametrize("name", ["cnn-npz", "denoiser"])
def test_the_cli_and_the_python_api_give_the_same_table_and_profile(name: str, tmp_path: Path) -> None:
    """Same setting, same cells, same profile. The denoiser's loss draws its noise from torch's global
    generator: calibration seeds it per step, rank and micro-batch, so two runs agree too."""
    assert nfab_main(*_cli(name, tmp_path, tmp_path / "cli")).code == 0
    model, kind, loss, extra = PROJECTS[name]
    import importlib

    module, _, fn = model.partition(":")
    factory = getattr(importlib.import_module(module), fn)
    loss_fn = None
    if loss:
        loss_module, _, loss_attr = loss.partition(":")
        loss_fn = getattr(importlib.import_module(loss_module), loss_attr)
    data = _data(kind, tmp_path)
    if ":" in data and not data.startswith(("npz:", "npy:", "tokens:")):
        data_module, _, data_attr = data.partition(":")
        data = getattr(importlib.import_module(data_module), data_attr)  # the factory itself
    result = nfab.calibrate(factory, data, loss=loss_fn, world_size=2, steps=12, quick=True, validate=False,
                            batch_size=16, out=tmp_path / "api", **dict(kv.split("=") for kv in extra))
    cli_table, cli_meta = nfab.calibrate.read_table(tmp_path / "cli" / "calibration.parquet")
    pd.testing.assert_frame_equal(_rows(result.table), _rows(cli_table))
    assert result.meta["dataset"] == cli_meta["dataset"] and result.meta["loss"] == cli_meta["loss"]
    cli_profile = Profile.load(tmp_path / "cli" / "profile.json")
    assert [p.routes for p in result.profile.phases] == [p.routes for p in cli_profile.phases]
    assert result.table_path == tmp_path / "api" / "calibration.parquet"


def test_the_python_api_takes_objects_no_module_can_import(tmp_path: Path) -> None:
    """A Dataset instance (its last 10% held out), a lambda loss and a built model; nothing written
    without `out`."""
    from bench.projects import autoencoder

    rows = torch.tensor(__import__("numpy").load(files.digits_rows_npy(tmp_path / "rows.npy")))
    data = torch.utils.data.TensorDataset(rows)
    result = nfab.calibrate(autoencoder.build(), data, loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[0]),
                            world_size=2, steps=10, quick=True, validate=False, batch_size=16)
    assert result.table_path is None and len(result.table) > 0 and result.profile.phases
    assert "<lambda>" in result.meta["loss"] and not list(tmp_path.glob("**/*.parquet"))


def test_a_failing_user_loss_is_one_line_exit_2_with_its_traceback(tmp_path: Path) -> None:
    ran = nfab_main("calibrate", "bench.projects.autoencoder:build", "--data",
                    f"npy:{files.digits_rows_npy(tmp_path / 'rows.npy')}", "--loss", f"{__name__}:reads_a_dict",
                    "-w", "2", "--steps", "4", "--quick", "--out", str(tmp_path / "cal"))
    assert ran.code == 2, ran.stderr
    line = ran.stderr.strip().splitlines()[-1]
    assert f"loss {__name__}:reads_a_dict raised IndexError" in line and "(traceback: " in line
    assert "Traceback" not in ran.stderr and not (tmp_path / "cal" / "profile.json").exists()


def reads_a_dict(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """A loss written for dict batches, given the rows of an .npy."""
    return model(batch["image"]).mean()


def test_an_optimizer_factory_maps_onto_nfabs_config(tmp_path: Path) -> None:
    """A factory over parameters (or a built torch optimizer) is read back into nfab's config; one that has
    no equivalent is one line."""
    from bench.projects import autoencoder

    rows = f"npy:{files.digits_rows_npy(tmp_path / 'rows.npy')}"
    result = nfab.calibrate(autoencoder.build, rows, loss=autoencoder.mse, world_size=2, steps=6, quick=True,
                            validate=False, optimizer=lambda ps: torch.optim.AdamW(ps, lr=2e-3, weight_decay=0.05))
    optim = result.config.setting.optim
    assert (optim.name, optim.lr, optim.weight_decay) == ("adamw", 2e-3, 0.05)
    with pytest.raises(nfab.NfabError, match="RMSprop has no equivalent in nfab's optimizer config"):
        nfab.calibrate(autoencoder.build, rows, loss=autoencoder.mse, optimizer=lambda ps: torch.optim.RMSprop(ps))
