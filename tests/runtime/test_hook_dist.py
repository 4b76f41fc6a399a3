"""The nfab hook on real gloo ranks against plain DDP and independent references."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import twins  # noqa: E402

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _twin_fp32(rank: int, world_size: int, steps: int, bucket_cap_mb: float, as_view: bool, accum: int) -> dict:
    torch.manual_seed(0)
    plain, ours = twins.Awkward(), twins.Awkward()
    ours.load_state_dict(plain.state_dict())
    kw = dict(find_unused_parameters=True, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    d_plain, d_ours = DDP(plain, **kw), DDP(ours, **kw)
    nfab.attach(d_ours, route="fp32", cost_model=None)
    opt_p = torch.optim.SGD(d_plain.parameters(), lr=0.1, momentum=0.9)
    opt_o = torch.optim.SGD(d_ours.parameters(), lr=0.1, momentum=0.9)
    mismatches = []
    for step in range(steps):
        for model, opt in ((d_plain, opt_p), (d_ours, opt_o)):
            opt.zero_grad()
            for micro in range(accum):  # gradient accumulation: no_sync on all but the last
                x, y = twins.batch(rank, step * accum + micro)
                if micro < accum - 1:
                    with model.no_sync():
                        twins.loss_fn(model, x, y).backward()
                else:
                    twins.loss_fn(model, x, y).backward()
        gp, go = _grads(plain), _grads(ours)
        mismatches += [f"{step}:{n}:{(gp[n] - go[n]).abs().max():.3g}" for n in gp if not torch.equal(gp[n], go[n])]
        opt_p.step()
        opt_o.step()
    return {"mismatches": mismatches, "params": _params(ours)}


@pytest.mark.world_size(3)
@pytest.mark.parametrize("world_size,bucket_cap_mb,as_view,accum", [(2, 25.0, False, 1), (3, 0.01, True, 1),
                                                                    (3, 25.0, False, 2)])
def test_fp32_route_is_bit_identical_to_plain_ddp(world_size, bucket_cap_mb, as_view, accum):
    res = run_ranks(_twin_fp32, world_size, 12, bucket_cap_mb, as_view, accum, timeout_s=180)
    for r in res:
        assert r["mismatches"] == [], "\n".join(r["mismatches"][:3])
    for r in res[1:]:
        assert torch.equal(r["params"], res[0]["params"])
