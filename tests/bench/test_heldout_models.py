"""The held-out user models: causal language models nfab reads as a user's, and calibrates as one."""

import sys
from pathlib import Path

import pytest
import torch

from bench.heldout.encoder import user_lm
from bench.heldout.gpt import user_gpt
from bench.heldout.swiglu import user_swiglu
from nfab.cli.app import main
from nfab.cli.calibrate import VALIDATION_FAILED
from nfab.profile.schema import Profile
from nfab.runtime.bindings import classify


@pytest.mark.parametrize("factory", [user_gpt, user_lm, user_swiglu])
def test_a_token_sees_no_later_token(factory) -> None:
    """Causal: changing the last tokens leaves every earlier position's logits as they were."""
    torch.manual_seed(0)
    model = factory(d_model=32).eval()
    idx = torch.randint(0, 256, (2, 16))
    later = idx.clone()
    later[:, 12:] = (later[:, 12:] + 1) % 256
    a, b = model(idx), model(later)
    assert a.shape == (2, 16, 256)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-5)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_the_second_models_regions_are_what_a_user_model_gives() -> None:
    """nn.MultiheadAttention's packed in-projection and a bare position parameter are `other`; the
    untied head is `head`: the regions the calibrated profile routes apart."""
    regions = {b.name: b.region for b in classify(user_lm()).values()}
    assert regions["encoder.layers.0.self_attn.in_proj_weight"] == "other"
    assert regions["position"] == "other"
    assert regions["encoder.layers.0.linear1.weight"] == "linear"
    assert regions["embed.weight"] == "embedding" and regions["head.weight"] == "head"
    assert regions["encoder.layers.0.norm1.weight"] == "norm" and regions["head.bias"] == "bias"


def test_the_second_model_calibrates_as_a_user_model(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "cal"
    monkeypatch.setattr(sys, "argv", [
        "nfab", "calibrate", "bench.heldout.encoder:user_lm", "--steps", "4", "--phases", "1", "--trial-steps", "1",
        "--routes", "fp32,bq2", "--out", str(out), "data.max_bytes=40000", "batch_size=2", "eval_samples=4",
        "ef_steps=1", "d_model=32", "n_layer=1"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code in (0, None, VALIDATION_FAILED)  # 4 steps: a verdict either way
    profile = Profile.load(out / "profile.json")
    assert profile.provenance["calibrated"]["model"] == "bench.heldout.encoder:user_lm"
    assert profile.provenance["calibrated"]["optimizer"]["name"] == "adamw"
    assert (out / "calibration.parquet").is_file()


def test_the_third_model_ties_its_head_and_calibrates_under_plain_adam(tmp_path: Path, monkeypatch) -> None:
    """Its head is the embedding (one parameter, region `embedding`); calibrated under Adam's beta2 0.999
    with the noise-corrected moment modelled, and the profile says so."""
    regions = {b.name: b.region for b in classify(user_swiglu()).values()}
    assert regions["embed.weight"] == "embedding" and "head.weight" not in regions
    assert regions["blocks.0.attn_norm.weight"] == "norm" and regions["blocks.0.gate.weight"] == "linear"
    out = tmp_path / "cal"
    monkeypatch.setattr(sys, "argv", [
        "nfab", "calibrate", "bench.heldout.swiglu:user_swiglu", "--steps", "4", "--phases", "1", "--trial-steps", "2",
        "--routes", "fp32,bq2", "--out", str(out), "data.max_bytes=40000", "batch_size=2", "eval_samples=4",
        "ef_steps=1", "d_model=32", "n_layer=1", "optim.name=adamw", "optim.weight_decay=0", "optim.betas=[0.9,0.999]"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code in (0, None, VALIDATION_FAILED)  # 4 steps: a verdict either way
    profile = Profile.load(out / "profile.json")
    assert profile.provenance["calibrated"]["optimizer"]["betas"] == [0.9, 0.999]
    assert profile.noise_moment
