"""A loop that never calls `step_stats()` still records every step's loss.

The first hook call of step t closes step t-1; the loss observed for step t before its
backward must survive that boundary (it once did not: `StepStats.loss` was None from
step 1 on, and the loss-spike check went silently idle in such loops).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.distributed import run_ranks

STEPS = 4


def _run(rank: int, world_size: int) -> list[float | None]:
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    rt = nfab.attach(ddp, route="sign", cost_model=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=gen)
        loss = ddp(x).pow(2).mean()
        rt.observe_loss(loss)
        loss.backward()  # no step_stats() here, as in a loop that reads stats only at the end
        opt.step()
        opt.zero_grad()
    rt.step_stats()
    return [s.loss for s in rt.history]


@pytest.mark.world_size(2)
def test_loss_survives_the_step_boundary_without_step_stats() -> None:
    per_rank = run_ranks(_run, 2)
    assert per_rank[0] == per_rank[1]
    assert len(per_rank[0]) == STEPS
    assert all(loss is not None and loss > 0 for loss in per_rank[0]), per_rank[0]
