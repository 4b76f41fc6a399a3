"""nfab.integrations.accelerate on 2 real gloo ranks (CPU), and on one process."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import gpuhost  # noqa: E402

from nfab.distributed import run_ranks  # noqa: E402
from nfab.errors import NfabError  # noqa: E402
from nfab.integrations import accelerate as nfab_accelerate  # noqa: E402
from nfab.integrations.metrics import step_metrics  # noqa: E402
from nfab.profile.schema import Profile  # noqa: E402

STEPS = 6
PROBE_EVERY = Profile.static("sign").health.probe_every


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    y = x[:, :4] * 2 + 0.1 * torch.randn(256, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _baseline(stats) -> int:
    """Plain DDP's bytes for the step, read through the metrics the adapters log."""
    return int(step_metrics(stats)["nfab/baseline_wire_bytes"])


def _train(rank: int, world_size: int) -> dict:
    accelerator = Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt, loader = accelerator.prepare(model, opt, _loader())
    # the prepared optimizer, as docs/integrations.md says: nfab corrects the torch AdamW inside it
    runtime = nfab_accelerate.attach(accelerator, model, route="sign", cost_model=None, total_steps=STEPS,
                                     optimizer=opt)
    assert runtime is not None and runtime.moment is not None
    batches = iter(loader)
    for _ in range(STEPS):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        runtime.observe_loss(loss)
        accelerator.backward(loss)
        runtime.step_stats()  # the README loop: each step's stats right after its backward
        opt.step()
        opt.zero_grad()
    return {
        "distributed_type": str(accelerator.distributed_type),
        "params": torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()]),
        "history": [(s.step, s.wire_bytes, _baseline(s), s.route_mix, s.loss) for s in runtime.history],
    }


@pytest.mark.world_size(2)
def test_attach_on_prepared_model_compresses_and_keeps_replicas_identical():
    res = run_ranks(_train, 2, timeout_s=180)
    for r in res:
        assert r["distributed_type"].endswith("MULTI_CPU")
        assert [h[0] for h in r["history"]] == list(range(STEPS))  # the hook ran every step
        for step, wire, baseline, mix, loss in r["history"]:
            if step % PROBE_EVERY:  # a fidelity-probe step also sends a sample in FP32
                assert baseline / wire > 1.0
            assert set(mix) <= {"signcount", "signgather"}
            assert loss is not None
    assert res[0]["history"] == res[1]["history"]
    assert torch.equal(res[0]["params"], res[1]["params"])


def test_single_process_logs_one_line_and_returns_none(caplog):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_model())
    with caplog.at_level(logging.INFO, logger="nfab.integrations.accelerate"):
        assert nfab_accelerate.attach(accelerator, model, route="sign") is None
    lines = [r.getMessage() for r in caplog.records if r.name == "nfab.integrations.accelerate"]
    assert len(lines) == 1 and "one process" in lines[0]


def test_needs_one_of_profile_or_route():
    accelerator = Accelerator(cpu=True)
    with pytest.raises(NfabError, match="exactly one"):
        nfab_accelerate.attach(accelerator, _model())


def _steps(accelerator: Accelerator, model, opt, runtime, loader, first: int, last: int) -> None:
    batches = list(loader)
    for i in range(first, last):
        x, y = batches[i]
        loss = torch.nn.functional.mse_loss(model(x), y)
        runtime.observe_loss(loss)
        accelerator.backward(loss)
        runtime.step_stats()
        opt.step()
        opt.zero_grad()


def _prepared() -> tuple:
    accelerator = Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt, loader = accelerator.prepare(model, opt, _loader())
    runtime = nfab_accelerate.attach(accelerator, model, route="sign", cost_model=None, total_steps=3,
                                     error_feedback=True)
    return accelerator, model, opt, loader, runtime


def _state(accelerator: Accelerator, model, runtime) -> dict:
    return {"params": torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()]),
            "step": runtime.step, "residuals": {k: v.clone() for k, v in runtime.residuals.items()},
            "health": runtime.health.to_dict()}


def _save_half(rank: int, world_size: int, root: str) -> dict:
    accelerator, model, opt, loader, runtime = _prepared()
    _steps(accelerator, model, opt, runtime, loader, 0, 3)
    full = _state(accelerator, model, runtime)
    accelerator, model, opt, loader, runtime = _prepared()
    _steps(accelerator, model, opt, runtime, loader, 0, 2)
    accelerator.save_state(root)  # every process calls it; the main process writes
    return {"full": full, "half": _state(accelerator, model, runtime)}


def _resume(rank: int, world_size: int, root: str) -> dict:
    accelerator, model, opt, loader, runtime = _prepared()
    accelerator.load_state(root)
    _steps(accelerator, model, opt, runtime, loader, 2, 3)
    return _state(accelerator, model, runtime)


@pytest.mark.world_size(2)
def test_save_state_carries_every_ranks_nfab_state(tmp_path: Path):
    first = run_ranks(_save_half, 2, str(tmp_path / "ckpt"), timeout_s=180)
    resumed = run_ranks(_resume, 2, str(tmp_path / "ckpt"), timeout_s=180)  # a fresh process group
    for a, b in zip(first, resumed, strict=True):
        assert a["half"]["step"] == 2 and a["half"]["residuals"]
        full = a["full"]
        assert b["step"] == full["step"] == 3
        # floats to 1e-6: the first resumed step runs on DDP's initial buckets, and the step's |g|^2
        # is summed bucket by bucket, so its last bits may differ from the uninterrupted run's
        assert b["health"].keys() == full["health"].keys()
        for k, v in full["health"].items():
            assert b["health"][k] == (pytest.approx(v, rel=1e-6) if isinstance(v, float) else v)
        assert b["residuals"].keys() == full["residuals"].keys()
        assert all(torch.equal(b["residuals"][k], full["residuals"][k]) for k in full["residuals"])
        assert torch.equal(b["params"], full["params"])
    assert not all(torch.equal(first[0]["half"]["residuals"][k], first[1]["half"]["residuals"][k])
                   for k in first[0]["half"]["residuals"])  # per-rank residuals: each rank got its own back
    assert torch.equal(resumed[0]["params"], resumed[1]["params"])


def _fsdp2(rank: int, world_size: int) -> dict:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    out: dict = {"chosen": gpuhost.as_on_a_gpu_host(accelerator, plugin)}
    for route in (None, "fp32", "sign"):  # plain FSDP2, then the adapter with each route
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = accelerator.prepare(model, opt)
        rt = nfab_accelerate.attach(accelerator, model, route=route, cost_model=None) if route else None
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(16, 32, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :4] * 2)
            accelerator.backward(loss)
            if rt is not None:
                rt.step_stats()
            opt.step()
            opt.zero_grad()
        out[route] = {"fsdp2": isinstance(model, FSDPModule),
                      "params": torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]),
                      "history": [(s.wire_bytes, s.baseline_wire_bytes, s.route_mix) for s in rt.history] if rt else [],
                      "comms": len(rt.comms) if rt else 0}
    return out


@pytest.mark.world_size(2)
@pytest.mark.fsdp2
def test_attach_on_the_fsdp2_model_accelerate_prepares():
    """`FullyShardedDataParallelPlugin(fsdp_version=2)`: the adapter attaches to the FSDP2 model
    Accelerate's own preparation builds (on CPU only with the distributed type a GPU host would get:
    `gpuhost.as_on_a_gpu_host`). Route fp32 gives plain FSDP2's shards bit for bit; sign trains on fewer bytes."""
    res = run_ranks(_fsdp2, 2, timeout_s=180)
    for r in res:
        assert r["chosen"].endswith("MULTI_CPU")  # what Accelerate itself picks here
        assert r[None]["fsdp2"] and r["fp32"]["fsdp2"] and r["sign"]["comms"] == 1
        assert torch.equal(r["fp32"]["params"], r[None]["params"])  # nfab's fp32 reduce-scatter is FSDP2's
        assert len(r["sign"]["history"]) == 3
        for wire, baseline, mix in r["sign"]["history"]:
            assert mix == {"sign": 1.0} and baseline / wire > 8
        assert not torch.equal(r["sign"]["params"], r[None]["params"])
    assert res[0]["sign"]["history"] == res[1]["sign"]["history"]
