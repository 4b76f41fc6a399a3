"""nfab.integrations.transformers.calibrate: calibrate from a Trainer as the user built it, then train with the
profile through the same adapter on 2 gloo ranks. A tiny GPT-2 from a config on byte windows of a stdlib
source (no hub, no downloads); short settings: these check the hand-over, not the profile's quality."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from bench.projects.hf_gpt2 import ByteWindows as _ByteWindows  # noqa: E402  (a user project's data)
from nfab.distributed import run_ranks  # noqa: E402
from nfab.errors import UserCodeError  # noqa: E402
from nfab.integrations import transformers as nfab_transformers  # noqa: E402
from nfab.profile.schema import Profile  # noqa: E402

TRAIN_STEPS = 3


def _tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def _args(out: str, max_steps: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=max_steps,
        learning_rate=2e-3, weight_decay=0.01, adam_beta2=0.98, max_grad_norm=0.5, lr_scheduler_type="cosine",
        warmup_steps=0.2, seed=3, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, logging_steps=1,
    )


class _CountingTrainer(Trainer):
    """A user's Trainer subclass whose `compute_loss` is the objective (here the default, counted)."""

    calls = 0

    def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, **kwargs: Any) -> Any:
        type(self).calls += 1
        return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)


class _BrokenTrainer(Trainer):
    def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, **kwargs: Any) -> Any:
        return model(**inputs).loss * inputs["weights"]  # a key the batches do not have


def _train(rank: int, world_size: int, out: str, profile: str) -> dict:
    trainer = Trainer(model=_tiny_gpt2(), args=_args(out, TRAIN_STEPS), train_dataset=_ByteWindows("train"))
    handle = nfab_transformers.attach(trainer, profile, cost_model=None)
    trainer.train()
    rt = handle.runtime
    return {"routes": [p.routes for p in rt.controller.profile.phases], "steps": [s.step for s in rt.history],
            "params": torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])}


@pytest.mark.world_size(2)
def test_calibrate_from_the_trainer_then_attach_trains_with_its_profile(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = _CountingTrainer(model=_tiny_gpt2(), args=_args(str(tmp_path / "run"), 10),
                               train_dataset=_ByteWindows("train"), eval_dataset=_ByteWindows("val"))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = nfab_transformers.calibrate(trainer, out=tmp_path / "cal", world_size=2, quick=True, validate=False)

    meta = result.meta
    assert "_CountingTrainer.compute_loss" in meta["loss"] and _CountingTrainer.calls > 0  # the Trainer's loss
    assert meta["optimizer"] == {"name": "adamw", "lr": 2e-3, "momentum": 0.9, "weight_decay": 0.01,
                                 "betas": [0.9, 0.98], "grad_clip": 0.5}
    assert meta["schedule"] == {"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.0}  # 0.2 of 10 steps
    assert (meta["batch_size"], meta["accum_steps"], meta["steps"], meta["seed"]) == (8, 2, 10, 3)
    assert meta["world_size"] == 2 and meta["eval_data"] is not None and "RemoveColumnsCollator" in meta["collate"]
    assert len(result.table) > 0 and result.table["cosine"].notna().any()
    assert result.profile_path == tmp_path / "cal" / "profile.json" and result.profile_path.is_file()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))  # a copy ran

    res = run_ranks(_train, 2, str(tmp_path / "train"), str(result.profile_path), timeout_s=180)
    calibrated = [p.routes for p in Profile.load(result.profile_path).phases]
    for r in res:
        assert r["routes"] == calibrated and r["steps"] == list(range(TRAIN_STEPS))
    assert torch.equal(res[0]["params"], res[1]["params"])


def test_model_init_is_the_factory_and_a_failing_compute_loss_is_one_line(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = _BrokenTrainer(model_init=_tiny_gpt2, args=_args(str(tmp_path / "run"), 4),
                             train_dataset=_ByteWindows("train"))
    with pytest.raises(UserCodeError, match=r"_BrokenTrainer\.compute_loss.* raised KeyError: 'weights'") as err:
        nfab_transformers.calibrate(trainer, world_size=2, quick=True, validate=False)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.glob("**/profile.json"))
