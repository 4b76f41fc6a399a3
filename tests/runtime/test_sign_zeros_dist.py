"""A sign vote cannot abstain: what an exactly-zero gradient on every rank becomes in the hook.

Embedding rows no token of any rank's batch uses have a zero gradient on every rank. With signSGD's
`x >= 0` they decoded to +scale every step and moved with no gradient (on a user's untied byte-level
GPT under AdamW: 0.51 in 30 steps, W=2). nfab's zeros vote by group rank and step
(`codec.sign_bits`): at even W they tie and decode to exactly 0, flat and on the two-level path; at
odd W the vote left over alternates in sign from step to step. Real DDP on gloo, replicas compared.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.distributed import run_ranks

VOCAB, STEPS = 64, 4
UNUSED = slice(1, None, 2)
"""Odd tokens never occur: their embedding rows' gradient is exactly zero on every rank. Every shard of
the two-level path holds such rows beside used ones (a shard of unused rows alone has scale 0)."""


def _ranks(rank: int, world_size: int, hierarchy: int | None) -> dict[str, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Flatten(), nn.Linear(16 * 6, 8))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    rt = nfab.attach(ddp, route={"embedding": "sign"}, error_feedback=False, cost_model=None, hierarchy=hierarchy)
    before = model[0].weight.detach().clone()
    out: dict[str, list] = {"unused": [], "replicas": [], "used_moved": [], "routes": []}
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = 2 * torch.randint(0, VOCAB // 2, (8, 6), generator=g)
        y = torch.randint(0, 8, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        out["unused"].append(model[0].weight.grad[UNUSED].clone())
        out["routes"].append(dict(rt.step_stats().route_elements))
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(every, flat)
        out["replicas"].append(all(torch.equal(every[0], e) for e in every))
    out["used_moved"].append(bool((model[0].weight.detach()[0::2] != before[0::2]).any()))
    out["unused_moved"] = [float((model[0].weight.detach()[UNUSED] - before[UNUSED]).abs().max())]
    return out


@pytest.mark.world_size(4)
@pytest.mark.parametrize(("world_size", "hierarchy"), [(2, None), (4, 2)])
def test_zeros_on_every_rank_tie_and_leave_the_weights_alone_at_even_w(world_size, hierarchy):
    """Flat at W=2, and on the two-level path (2 nodes of 2 ranks: the cross level votes by node)."""
    results = run_ranks(_ranks, world_size, hierarchy, timeout_s=180)
    for res in results:
        assert all(res["replicas"])
        assert all(any(k.startswith("sign") for k in routes) for routes in res["routes"]), res["routes"]
        assert res["used_moved"] == [True]  # the route ran: the used rows trained
        assert all(not grad.any() for grad in res["unused"]), "a zero on every rank must decode to 0"
        assert res["unused_moved"] == [0.0]


def test_at_odd_w_the_vote_left_over_alternates_from_step_to_step():
    results = run_ranks(_ranks, 3, None, timeout_s=180)
    assert all(all(res["replicas"]) for res in results)
    grads = results[0]["unused"]
    for before, after in zip(grads, grads[1:], strict=False):
        assert before.ne(0).all() and torch.equal(torch.sign(after), -torch.sign(before))
