"""nfab.integrations.transformers on 2 real gloo ranks (CPU) with a tiny GPT-2 built from a config."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import gpuhost  # noqa: E402

from nfab.distributed import run_ranks  # noqa: E402
from nfab.errors import NfabError  # noqa: E402
from nfab.integrations import transformers as nfab_transformers  # noqa: E402
from nfab.integrations.metrics import step_metrics  # noqa: E402
from nfab.profile.schema import Profile  # noqa: E402

STEPS = 5
PROBE_EVERY = Profile.static("sign").health.probe_every


class _Tokens(torch.utils.data.Dataset):
    """Generated token sequences (a repeating pattern plus noise): no hub, no files."""

    def __init__(self, n: int = 64, length: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        base = torch.arange(length) % 8
        self.ids = (base + torch.randint(0, 3, (n, length), generator=g)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=1, n_head=2))


def _args(out: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )


def _baseline(stats) -> int:
    """Plain DDP's bytes for the step, read through the metrics the adapters log."""
    return int(step_metrics(stats)["nfab/baseline_wire_bytes"])


def _train(rank: int, world_size: int, out: str) -> dict:
    trainer = Trainer(model=_tiny_gpt2(), args=_args(out), train_dataset=_Tokens())
    handle = nfab_transformers.attach(trainer, route="sign", cost_model=None)
    assert handle.runtime is None  # the Trainer builds its DDP model inside train()
    trainer.train()
    rt = handle.runtime
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]),
        "total_steps": rt.controller.total_steps,
        "error_feedback": rt.error_feedback,
        "history": [(s.step, s.wire_bytes, _baseline(s), s.route_mix) for s in rt.history],
        "observed": [s.loss for s in rt.history],
        "logged": [row for row in trainer.state.log_history if "nfab/compression" in row],
        "losses": [row["step"] for row in trainer.state.log_history if "loss" in row],
    }


@pytest.mark.world_size(2)
def test_trainer_runs_nfab_and_logs_its_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = run_ranks(_train, 2, str(tmp_path), timeout_s=180)
    for r in res:
        assert r["error_feedback"] is False  # error_feedback="auto" saw the Trainer's AdamW
        assert r["total_steps"] == STEPS  # from the Trainer's max_steps
        assert [h[0] for h in r["history"]] == list(range(STEPS))  # the hook ran every step
        assert all(loss is not None and loss > 0 for loss in r["observed"])  # compute_loss reported each loss
        for step, wire, baseline, mix in r["history"]:
            if step % PROBE_EVERY:  # a fidelity-probe step also sends a sample in FP32
                assert baseline / wire > 1.0
            assert set(mix) <= {"signcount", "signgather"}
        assert [row["step"] for row in r["logged"]] == list(range(1, STEPS + 1))  # logging_steps=1
        assert r["losses"] == list(range(1, STEPS + 1))  # the Trainer's own log stays beside nfab's
        for row, (_, wire, baseline, _) in zip(r["logged"], r["history"], strict=True):
            assert row["nfab/compression"] == pytest.approx(baseline / wire)
            assert sum(v for k, v in row.items() if k.startswith("nfab/route/")) == pytest.approx(1.0)
            assert row["nfab/fallback"] == 0.0
    assert res[0]["history"] == res[1]["history"]
    assert torch.equal(res[0]["params"], res[1]["params"])


def test_single_process_trains_without_nfab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert "WORLD_SIZE" not in os.environ
    args = _args(str(tmp_path))
    args.max_steps = 1
    trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Tokens())
    handle = nfab_transformers.attach(trainer, route="sign")
    trainer.train()
    assert handle.runtime is None
    assert not any("nfab/compression" in row for row in trainer.state.log_history)


def test_needs_one_of_profile_or_route(tmp_path: Path):
    trainer = Trainer(model=_tiny_gpt2(), args=_args(str(tmp_path)), train_dataset=_Tokens())
    with pytest.raises(NfabError, match="exactly one"):
        nfab_transformers.attach(trainer)
    with pytest.raises(NfabError, match="cannot read profile /nonexistent.json"):  # at attach, not in train()
        nfab_transformers.attach(trainer, "/nonexistent.json")


def _ckpt_run(out: str, resume: str | None) -> dict:
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="steps", save_steps=2, disable_tqdm=True, seed=0,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Tokens())
    handle = nfab_transformers.attach(trainer, route="sign", cost_model=None, error_feedback=True, total_steps=3)
    trainer.train(resume_from_checkpoint=resume)
    rt = handle.runtime
    return {"params": torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]), "step": rt.step,
            "history": [h.step for h in rt.history], "global_step": trainer.state.global_step,
            "residuals": {k: v.clone() for k, v in rt.residuals.items()}, "health": rt.health.to_dict()}


def _health_close(a: dict, b: dict) -> bool:
    """Health states equal, floats to 1e-6: the first resumed step runs on DDP's initial buckets, and
    the step's |g|^2 is summed bucket by bucket, so its last bits may differ from the uninterrupted run's."""
    return a.keys() == b.keys() and all(
        v == pytest.approx(b[k], rel=1e-6) if isinstance(v, float) else v == b[k] for k, v in a.items())


def _full(rank: int, world_size: int, out: str) -> dict:
    return _ckpt_run(out, resume=None)  # saves checkpoint-2 on the way (save_steps=2), and -3 at the end


def _resume(rank: int, world_size: int, out: str) -> dict:
    return _ckpt_run(out, resume=str(Path(out) / "checkpoint-2"))


@pytest.mark.world_size(2)
def test_checkpoint_folder_carries_each_ranks_nfab_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    full = run_ranks(_full, 2, str(tmp_path), timeout_s=180)
    saved = [torch.load(tmp_path / "checkpoint-2" / f"nfab_state_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [s["state"]["step"] for s in saved] == [2, 2] and [s["rank"] for s in saved] == [0, 1]
    resumed = run_ranks(_resume, 2, str(tmp_path), timeout_s=180)  # a fresh process group
    for a, b in zip(full, resumed, strict=True):
        assert b["step"] == a["step"] == 3 and b["history"] == [2] and b["global_step"] == 3
        assert _health_close(b["health"], a["health"])
        assert b["residuals"].keys() == a["residuals"].keys() and a["residuals"]
        assert all(torch.equal(b["residuals"][k], a["residuals"][k]) for k in a["residuals"])
        assert torch.equal(b["params"], a["params"])
    assert torch.equal(resumed[0]["params"], resumed[1]["params"])
    assert not list(tmp_path.glob("checkpoint-2/*.tmp*"))  # temp files renamed into place


def _fsdp2(rank: int, world_size: int, out: str) -> dict:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    args = _args(out)
    args.max_steps = 3
    args.fsdp, args.fsdp_config = "full_shard", {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}
    args.fsdp_plugin_args = args._process_fsdp_args()  # what TrainingArguments' __post_init__ does with them
    trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Tokens())
    chosen = gpuhost.as_on_a_gpu_host(trainer.accelerator, FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
    trainer.is_fsdp_enabled = True  # what the Trainer derives from the state at __init__
    handle = nfab_transformers.attach(trainer, route="sign", cost_model=None)
    trainer.train()
    rt = handle.runtime
    return {"chosen": chosen, "fsdp_modules": sum(isinstance(m, FSDPModule) for m in trainer.model_wrapped.modules()),
            "root": isinstance(trainer.model_wrapped, FSDPModule), "comms": len(rt.comms),
            "history": [(s.step, s.wire_bytes, s.baseline_wire_bytes, s.route_mix) for s in rt.history],
            "logged": [row["nfab/compression"] for row in trainer.state.log_history if "nfab/compression" in row]}


@pytest.mark.world_size(2)
@pytest.mark.fsdp2
def test_trainer_fsdp2_setting_runs_nfab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`fsdp="full_shard"`, `fsdp_config={"fsdp_version": 2}`: the callback attaches to the FSDP2 model the
    Trainer's Accelerate builds (on CPU only with the distributed type a GPU host gets: `gpuhost`), a
    comm on every `fully_shard` unit (the GPT-2 block, and the embedding, norm and head units the
    Trainer's wrap policy adds), and logs its statistics."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = run_ranks(_fsdp2, 2, str(tmp_path), timeout_s=180)
    for r in res:
        assert r["chosen"].endswith("MULTI_CPU")  # what Accelerate itself picks on CPU
        assert r["root"] and r["comms"] == r["fsdp_modules"] > 1
        assert [h[0] for h in r["history"]] == [0, 1, 2]
        for _, wire, baseline, mix in r["history"]:
            assert mix == {"sign": 1.0} and baseline / wire > 8
        assert r["logged"] == [pytest.approx(b / w) for _, w, b, _ in r["history"]]
    assert res[0]["history"] == res[1]["history"]
