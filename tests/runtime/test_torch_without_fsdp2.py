"""A torch without FSDP2's custom reduce-scatter still trains DDP under nfab, and refuses FSDP2 with one line.

nfab declares torch >= 2.4; its FSDP2 front end needs 2.9 (`FSDPModule.set_custom_reduce_scatter`).
Until this was found, `nfab.attach` imported the FSDP2 front end at import, so on torch 2.4 every
DDP attach failed with `No module named 'torch.distributed.fsdp._fully_shard'` (seen in a venv of
torch 2.4.1). Each rank here hides what torch 2.4/2.5 lack (the public `FSDPModule` and
`fully_shard`, the `_fully_shard` package, and `_composable.fsdp`, where 2.4 kept FSDP2), forgets
every nfab module and imports nfab again, then trains with real gloo collectives.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from inprocess import nfab_main

from nfab.distributed import run_ranks

HIDDEN_MODULES = ("torch.distributed.fsdp._fully_shard", "torch.distributed.fsdp._fully_shard._fsdp_api",
                  "torch.distributed.fsdp._fully_shard._fsdp_collectives", "torch.distributed._composable.fsdp")
HIDDEN_NAMES = ("FSDPModule", "fully_shard", "MixedPrecisionPolicy")


def _as_old_torch() -> None:
    """This process's torch as 2.4 and 2.5 are to nfab: no FSDP2 that nfab can reach."""
    import torch.distributed.fsdp as fsdp

    for name in HIDDEN_NAMES:
        if hasattr(fsdp, name):
            delattr(fsdp, name)
    for name in HIDDEN_MODULES:
        sys.modules[name] = None  # type: ignore[assignment]  # `import` of it now raises ImportError
    for name in [m for m in sys.modules if m == "nfab" or m.startswith("nfab.")]:
        del sys.modules[name]


def _rank(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _as_old_torch()
    nfab = importlib.import_module("nfab")
    from nfab.config.run import TrainConfig
    from nfab.runtime.frontends import fsdp2

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    ddp = DDP(model)
    rt = nfab.attach(ddp, route={"linear": "q8", "bias": "sign", "head": "fp32"}, head_modules=("2",),
                     cost_model=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(3):
        opt.zero_grad()
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    refusals = []
    for call in (fsdp2.require, lambda: TrainConfig(parallel="fsdp")):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the fresh nfab's NfabError is not this module's class
            refusals.append(f"{type(exc).__name__}: {exc}")
    stats = rt.step_stats()
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "routes": stats.route_elements, "refusals": refusals, "supported": fsdp2.supported(),
            "fsdp2_types": len(fsdp2.module_types())}


@pytest.mark.world_size(2)
def test_ddp_trains_and_fsdp2_is_refused_in_one_line_without_fsdp2():
    runs = run_ranks(_rank, 2, timeout_s=240)
    for r in runs:
        assert not r["supported"] and r["fsdp2_types"] == 0
        assert torch.isfinite(r["params"]).all()
        assert r["routes"].get("q8", 0) > 0  # the lossy routes ran, not an FP32 fallback
        assert len(r["refusals"]) == 2
        for line in r["refusals"]:
            assert line.startswith("NfabError: ") and "needs torch >= 2.9" in line and "\n" not in line
    assert torch.equal(runs[0]["params"], runs[1]["params"])  # replicas bit-identical


def test_cli_refuses_parallel_fsdp_on_a_torch_without_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from nfab.runtime.frontends import fsdp2

    monkeypatch.setattr(fsdp2, "supported", lambda: False)
    run_dir = tmp_path / "run"
    ran = nfab_main("train", "--model", "mlp", "--dataset", "digits", "--parallel", "fsdp", "--steps", "2",
                    "--run-dir", str(run_dir))
    assert ran.code == 2, ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel fsdp needs torch >= 2.9" in lines[0]
    assert not run_dir.exists()
