"""The hook on CUDA with NCCL (`make test-gpu`; skipped without CUDA).

One rank per GPU, W = min(2, GPUs): with one GPU the paths still run on the device
(allocations, generators, masks instead of host reads) at W=1. Checked against plain DDP
and independent computations, as on gloo.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import twins  # noqa: E402

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402
from nfab.runtime.bindings import classify  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL): run `make test-gpu` on a GPU machine"),
]
MIXED = {"conv": "sign", "linear": "q8", "embedding": "sign", "head": "sign", "norm": "bf16", "bias": "q4"}


def _world() -> int:
    return min(2, torch.cuda.device_count())


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def _replicas_equal(model: torch.nn.Module, world_size: int) -> bool:
    flat = _flat(model).cuda()
    every = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], t) for t in every[1:])


def _fp32_twin(rank: int, world_size: int, dtype: torch.dtype) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    plain = twins.Awkward().to(dev, dtype)
    ours = copy.deepcopy(plain)
    d_plain = DDP(plain, device_ids=[dev], find_unused_parameters=True, bucket_cap_mb=0.05)
    d_ours = DDP(ours, device_ids=[dev], find_unused_parameters=True, bucket_cap_mb=0.05)
    rt = nfab.attach(d_ours, route="fp32", cost_model="measure")
    mismatches = []
    for step in range(4):
        x, y = (t.to(dev) for t in twins.batch(rank, step))
        for m in (d_plain, d_ours):
            m.zero_grad()
            twins.loss_fn(m, x, y).float().backward()
        for (n, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
            if p.grad is not None and not torch.equal(p.grad, q.grad):
                mismatches.append(f"{step}:{n}")
    st = rt.step_stats()
    per_el = 2 if dtype != torch.float32 else 4
    numel = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    expect = 2 * (world_size - 1) / world_size * per_el * numel
    return {"mismatches": mismatches, "baseline": st.baseline_wire_bytes, "expect": expect}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_route_is_plain_ddp_on_cuda(dtype):
    res = run_ranks(_fp32_twin, _world(), dtype, backend="nccl", timeout_s=300)
    for r in res:
        assert r["mismatches"] == []
        assert r["baseline"] == pytest.approx(r["expect"], rel=1e-6)  # plain DDP's bytes in the bucket dtype


def _mixed(rank: int, world_size: int, dtype: torch.dtype, nan_step: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = twins.Awkward().to(dev, dtype)
    regions = {n: b.region for n, b in classify(model).items()}
    ddp = DDP(model, device_ids=[dev], find_unused_parameters=True, bucket_cap_mb=0.05)
    rt = nfab.attach(ddp, route=MIXED, cost_model=None, error_feedback=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    out = {"bad": [], "replicas": [], "skipped": [], "zero_at_nan": None}
    for step in range(nan_step + 2):
        x, y = (t.to(dev) for t in twins.batch(rank, step))
        twin = copy.deepcopy(model)
        twins.loss_fn(twin, x, y).float().backward()
        local = {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}
        opt.zero_grad()
        loss = twins.loss_fn(ddp, x, y).float()
        if step == nan_step and rank == world_size - 1:
            loss = loss * float("nan")
        rt.observe_loss(loss)
        loss.backward()
        st = rt.step_stats()
        out["skipped"].append(st.skipped)
        if step == nan_step:
            out["zero_at_nan"] = all(bool((p.grad == 0).all()) for p in model.parameters() if p.grad is not None)
        else:
            for name, p in model.named_parameters():
                if name in local and MIXED.get(regions[name]) == "sign":
                    votes = (local[name] >= 0).to(torch.int64)
                    dist.all_reduce(votes)
                    if not torch.equal(torch.sign(p.grad.float()), torch.sign(2.0 * votes - world_size)):
                        out["bad"].append(f"{step}:{name}")
        opt.step()
        out["replicas"].append(_replicas_equal(model, world_size))
    out["finite"] = bool(torch.isfinite(_flat(model)).all())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_routes_and_nan_skip_on_cuda(dtype):
    nan_step = 2
    res = run_ranks(_mixed, _world(), dtype, nan_step, backend="nccl", timeout_s=300)
    for r in res:
        assert r["bad"] == [] and all(r["replicas"]) and r["finite"] and r["zero_at_nan"]
        assert r["skipped"] == [i == nan_step for i in range(nan_step + 2)]
