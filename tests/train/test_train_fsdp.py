"""`nfab train --parallel fsdp`: 2 gloo ranks under torchrun, GPT sharded per block; a crash and
`--resume` end where the uninterrupted run ends (model, optimizer, losses)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from trainrun import GPT, metrics, nfab_train

from nfab.errors import NfabError
from nfab.inspect_fsdp import inspect_fsdp
from nfab.models import build_model
from nfab.profile.schema import Profile
from nfab.train.config import TrainConfig
from nfab.train.loop import _check_parallel
from nfab.train.parallel import plain_wire_bytes

pytestmark = [pytest.mark.slow, pytest.mark.world_size(2)]

STEPS = 4
ARGS = [*GPT, "--steps", str(STEPS), "checkpoint_every=2", "eval_every=2", "accum_steps=2", "optim.grad_clip=1.0",
        "--parallel", "fsdp", "--nproc", "2", "--route", "sign"]


def _state(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return torch.load(run_dir / "checkpoints" / latest / "state.pt", weights_only=True)


def test_fsdp_run_and_its_resume(tmp_path: Path) -> None:
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(nfab_train, *ARGS, "--run-dir", str(full), timeout=240),
                pool.submit(nfab_train, *ARGS, "--run-dir", str(crashed), timeout=240,
                            env={"NFAB_FAULT": "crash@step=3,rank=1"})]
        first, crash = (r.result() for r in runs)
    assert first.code == 0, first.stderr
    assert crash.code != 0 and len(metrics(crashed)) == 2  # it crashed after the step-2 checkpoint
    resumed = nfab_train("--resume", "--run-dir", str(crashed), "--quiet", timeout=240)
    assert resumed.code == 0, resumed.stderr

    s = json.loads((full / "summary.json").read_text())
    assert s["parallel"] == "fsdp" and s["complete"] and s["replicas_identical"] is None  # sharded: no replicas
    m = metrics(full)
    spec = build_model("gpt", size="nano", device="meta", block_size=64)  # the config's data.block_size
    plain = plain_wire_bytes(spec.module, 2, "fsdp")
    assert (m["baseline_wire_bytes"] == plain).all()  # FSDP2's reduce-scatter: (W-1)/W of the FP32 gradients
    assert m["loss"].iloc[-1] < m["loss"].iloc[0]
    assert (m["route_mix"] == '{"sign": 1.0}').all()
    paper = inspect_fsdp("gpt", spec.module, Profile.static("sign"), 2, explicit=True, shard_units=spec.shard_units,
                         head_modules=spec.head_modules)
    payload = m["wire_bytes"] - m["probe_wire_bytes"]  # the probes aside (step 0 probes; its sums ride step 1)
    assert (payload / paper.wire_bytes).between(0.99, 1.01).all() and m["probe_wire_bytes"].iloc[0] > 0  # inspect
    a, b = _state(full), _state(crashed)
    assert a["step"] == b["step"] == STEPS
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert metrics(crashed)["loss"].tolist() == m["loss"].tolist()
    opt_a, opt_b = a["optimizer"]["state"], b["optimizer"]["state"]  # keyed by parameter name under FSDP
    assert "blocks.0.attn.qkv.weight" in opt_a
    assert all(torch.equal(opt_a[k]["exp_avg_sq"], opt_b[k]["exp_avg_sq"]) for k in opt_a)


def test_a_checkpoint_resumes_under_its_own_wrapper() -> None:
    ddp_state = {"config": TrainConfig().to_json()}
    _check_parallel(TrainConfig(), ddp_state)
    with pytest.raises(NfabError, match="parallel=ddp; resume it with --parallel ddp"):
        _check_parallel(TrainConfig(parallel="fsdp"), ddp_state)
