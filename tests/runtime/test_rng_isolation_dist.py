"""nfab never draws from the user's random streams: torch's global CPU (and CUDA) generator,
numpy's global RandomState and Python's `random` are the same before and after `nfab.attach`
(the default cost_model="measure" included) and before and after every training step, on
real gloo ranks (DDP and FSDP2), through the Accelerate adapter, and on CUDA with NCCL.

The loops draw nothing themselves between the two reads (no dropout, batches from their own
generator, a torch optimizer), so any change is nfab's. Each step runs the lossy routes'
stochastic rounding, the fidelity probes (every step) and, with thresholds set to trip, the
FP32 shadow windows.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import nfab
from nfab.distributed import run_ranks
from nfab.profile.schema import Profile

STEPS = 4
TRIPWIRE = {"probe_every": 1, "warmup_steps": 1, "loss_spike_ratio": 1.0001, "grad_norm_jump": 1.0001,
            "shadow_steps": 1, "cooldown_steps": 0}
"""Health settings that probe every step and open a shadow window at almost any change of loss or norm."""


class Net(nn.Module):
    """Two norm + linear blocks and a head: linear, norm, bias and head regions."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def streams(device: torch.device) -> tuple[Any, ...]:
    """Every global random stream a user's loop draws from, as comparable values."""
    np_state = np.random.get_state()
    out: tuple[Any, ...] = (torch.get_rng_state(), np_state[0], np_state[1].copy(), *np_state[2:], random.getstate())
    if device.type == "cuda":
        out += (torch.cuda.get_rng_state(device),)
    return out


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else bool(np.array_equal(x, y)) if isinstance(x, np.ndarray)
        else x == y for x, y in zip(a, b, strict=True))


def seed_everything(rank: int) -> None:
    """Different, known states per rank, as a user's script would leave them."""
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)


def batches(rank: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(STEPS):
        x = torch.randn(16, 12, generator=g) * (1 + 3 * torch.rand(1, generator=g))  # the norm moves: alarms
        out.append((x.to(device), torch.randint(0, 5, (16,), generator=g).to(device)))
    return out


def wrap(model: nn.Module, frontend: str, device: torch.device) -> nn.Module:
    if frontend == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.002)


def attach_args(case: str) -> tuple[Profile | None, dict[str, Any]]:
    """(profile, keywords) for `nfab.attach`. A route keeps the default cost_model="measure" (and is
    honoured as asked); a profile is priced by bytes, so that its routes stay lossy on loopback,
    where the measured gate may keep FP32 everywhere."""
    if case.startswith("profile:"):
        prof = Profile.static(case.split(":", 1)[1])
        return prof.model_copy(update={"health": prof.health.model_copy(update=TRIPWIRE)}), {"cost_model": None}
    return None, {"route": case}


def _isolated(rank: int, world_size: int, frontend: str, case: str, device_type: str) -> dict:
    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else None)
    torch.manual_seed(0)
    model = wrap(Net().to(device), frontend, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(rank, device)
    profile, kwargs = attach_args(case)
    seed_everything(rank)
    before = streams(device)
    rt = nfab.attach(model, profile, optimizer=opt, total_steps=STEPS, **kwargs)
    moved = [] if same(before, streams(device)) else ["attach"]
    for step, (x, y) in enumerate(data):
        before = streams(device)
        loss = nn.functional.cross_entropy(model(x), y)
        rt.observe_loss(loss)
        loss.backward()
        st = rt.step_stats()
        opt.step()
        opt.zero_grad()
        if not same(before, streams(device)):
            moved.append(f"step {step}")
    hist, cost = rt.history, rt.controller.cost_model
    cost = getattr(cost, "base", cost)  # FSDP2's gate wraps the measured model
    probed, shadows = sum(s.probe_wire_bytes + s.shadow_wire_bytes > 0 for s in hist), sum(s.shadow for s in hist)
    return {"moved": moved, "mix": [s.route_mix for s in hist], "probed": probed, "shadows": shadows,
            "cost": cost.source if cost else None, "last": st.step}


CASES = [("ddp", "sign"), ("ddp", "q8"), ("ddp", "bq3"), ("ddp", "profile:q4"),
         pytest.param("fsdp2", "bq3", marks=pytest.mark.fsdp2), pytest.param("fsdp2", "q8", marks=pytest.mark.fsdp2),
         pytest.param("fsdp2", "profile:bq2", marks=pytest.mark.fsdp2)]


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("frontend", "case"), CASES)
def test_attach_and_training_steps_leave_the_global_random_streams_alone(frontend, case):
    res = run_ranks(_isolated, 2, frontend, case, "cpu", timeout_s=240)
    for r in res:
        assert r["moved"] == [], r["moved"]
        assert r["last"] == STEPS - 1 and all(set(m) != {"fp32"} for m in r["mix"]), r  # the rounding ran
        if case.startswith("profile:"):  # probes ran; the tripwire thresholds opened a shadow window
            assert r["probed"] >= 2 and r["shadows"] >= 1, r
        else:
            assert r["cost"] == "measured"


def _accelerate(rank: int, world_size: int) -> dict:
    from accelerate import Accelerator

    from nfab.integrations import accelerate as nfab_accelerate

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    seed_everything(rank)
    device = torch.device("cpu")
    before = streams(device)
    rt = nfab_accelerate.attach(accelerator, model, route="q8", optimizer=opt, total_steps=STEPS)
    moved = [] if same(before, streams(device)) else ["attach"]
    for step, (x, y) in enumerate(batches(rank, device)):
        before = streams(device)
        loss = nn.functional.cross_entropy(model(x), y)
        rt.observe_loss(loss)
        accelerator.backward(loss)
        rt.step_stats()
        opt.step()
        opt.zero_grad()
        if not same(before, streams(device)):
            moved.append(f"step {step}")
    return {"moved": moved, "mix": [s.route_mix for s in rt.history]}


@pytest.mark.world_size(2)
def test_the_accelerate_adapter_leaves_the_global_random_streams_alone():
    pytest.importorskip("accelerate")
    res = run_ranks(_accelerate, 2, timeout_s=240)
    for r in res:
        assert r["moved"] == [] and len(r["mix"]) == STEPS, r


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL): run `make test-gpu` on a GPU machine")
@pytest.mark.parametrize("case", ["q8", "bq3", "profile:sign"])
def test_on_cuda_the_cuda_generator_is_left_alone_too(case):
    """One rank per GPU (W=1 with one GPU: the rounding, probes and measurement still run on the device)."""
    world = min(2, torch.cuda.device_count())
    res = run_ranks(_isolated, world, "ddp", case, "cuda", backend="nccl", timeout_s=300)
    for r in res:
        assert r["moved"] == [], r["moved"]
