"""A calibrated user project trains: through `nfab train --profile P` (the profile carries the user's data
and loss), and in the user's own DDP loop on gloo with `nfab.attach`, replicas bit-identical every step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from bench.projects import denoiser, files, nanogpt
from nfab.attach_checks import check_model
from nfab.distributed import run_ranks
from nfab.errors import ProfileError
from nfab.profile.schema import Profile
from tests.inprocess import nfab_main


@pytest.fixture(scope="module")
def denoiser_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("denoiser") / "cal"
    ran = nfab_main("calibrate", "bench.projects.denoiser:build", "--data", "bench.projects.denoiser:data", "--loss",
                    "bench.projects.denoiser:loss", "-w", "2", "--steps", "12", "--quick", "--no-validate",
                    "--out", str(out), "batch_size=16")
    assert ran.code == 0, ran.stderr
    return out / "profile.json"


def test_nfab_train_with_the_profile_trains_the_users_data_and_loss(denoiser_profile: Path, tmp_path: Path) -> None:
    ran = nfab_main("train", "--profile", str(denoiser_profile), "--nproc", "2", "--steps", "4", "--quiet",
                    "--run-dir", str(tmp_path / "run"), "comm.cost_model=link:100mbit")  # loopback: gated
    assert ran.code == 0, ran.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["loss"] == "bench.projects.denoiser:loss" and config["data"]["name"] == "bench.projects.denoiser:data"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["replicas_identical"] and summary["compression_ratio"] > 4
    assert "accuracy" not in summary["final_eval"] and summary["final_eval"]["loss"] > 0


def _users_loop(rank: int, world: int, profile: str, steps: int) -> dict:
    """The denoiser's own loop, as its user writes it: DDP, AdamW, the loss drawing noise each step."""
    torch.manual_seed(0)
    model = DDP(denoiser.build())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    runtime = nfab.attach(model, profile, optimizer=opt, total_steps=steps, cost_model=None)
    data = denoiser.data("train")
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    identical, wire, plain, losses = [], 0, 0, []
    batches = iter(loader)
    for _ in range(steps):
        loss = denoiser.loss(model, next(batches))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = runtime.step_stats()
        wire, plain = wire + stats.wire_bytes, plain + stats.baseline_wire_bytes
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        identical.append(all(torch.equal(g, gathered[0]) for g in gathered))
        losses.append(float(loss))
    return {"identical": identical, "ratio": plain / max(wire, 1), "losses": losses}


def test_the_profile_trains_in_the_users_own_ddp_loop(denoiser_profile: Path) -> None:
    results = run_ranks(_users_loop, 2, str(denoiser_profile), 8)
    assert all(all(r["identical"]) for r in results)  # replicas bit-identical after every step
    assert results[0]["ratio"] > 4 and all(torch.isfinite(torch.tensor(r["losses"])).all() for r in results)


def test_a_profile_for_another_layout_names_the_parameters_that_differ(tmp_path: Path) -> None:
    tokens = files.nanogpt_dir(tmp_path / "chars", chars=8000)
    out = tmp_path / "cal"
    ran = nfab_main("calibrate", "bench.projects.nanogpt:build", "--data", f"tokens:{tokens}", "-w", "2", "--steps",
                    "6", "--quick", "--no-validate", "--out", str(out), "block_size=32", "optimizer=adamw")
    assert ran.code == 0, ran.stderr
    other = nanogpt.build(vocab_size=256, block_size=32)  # the byte-level sibling: the (tied) embedding differs
    with pytest.raises(ProfileError, match=r"wte.weight \(256x32\), profile \(\d+x32\)") as info:
        check_model(Profile.load(out / "profile.json"), other, None)  # what nfab.attach checks first
    assert "\n" not in str(info.value)


def test_nfab_train_takes_data_and_loss_flags_and_a_scalar_parameter(tmp_path: Path) -> None:
    """The contrastive model's temperature is a 0-d parameter (the replica check hashed it as bytes and
    failed on 0-d tensors); its samples are dicts, its loss InfoNCE."""
    ran = nfab_main("train", "--model", "bench.projects.contrastive:build", "--data", "bench.projects.contrastive:data",
                    "--loss", "bench.projects.contrastive:info_nce", "--route", "bq2", "--nproc", "2", "--steps", "3",
                    "--quiet", "--run-dir", str(tmp_path / "run"))
    assert ran.code == 0, ran.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["replicas_identical"] and math.isfinite(summary["final_eval"]["loss"])
