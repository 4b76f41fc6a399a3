"""The DDP hook runs blockqscatter (all-to-all + all-gather launched from the hook body) on real gloo ranks.

Without a cost model the controller picks a block route's reducer by fewest wire bytes:
blockqscatter. The same training, with a cost model that prices blockqscatter's codec out
(so the controller picks blockq), must give the same gradients bit for bit at every step,
with identical replicas and fewer bytes on the wire.
"""

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
from nfab.wire.blockq.scatter import BlockQScatter  # noqa: E402
from nfab.wire.cost import CostModel, LinkCost  # noqa: E402

ROUTE = {"norm": "fp32", "bias": "fp32", "small": "bq2", "conv": "bq2", "linear": "bq2",
         "embedding": "bq3", "head": "bq2", "other": "bq2"}
LEVELS = {**ROUTE, "linear": "bl5", "conv": "bl6"}
"""5 and 6 levels (no power of two: own levels in base-5/base-6 digits) beside bq2 and bq3."""
ROUTES = {"bq": ROUTE, "levels": LEVELS}


def _train(rank: int, world_size: int, priced_out: bool, steps: int, routes: str = "bq") -> dict:
    """Train the twin model `steps` steps; each step's gradients, bytes and scatter launches."""
    torch.manual_seed(0)
    model = twins.Awkward()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.05)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    cm = None
    if priced_out:  # blockqscatter's codec priced out: the controller picks blockq
        link = LinkCost(1e-4, 1e9)
        priced = {f"blockqscatter-{r}": 1.0 for r in ("bq2", "bq3", "bl5", "bl6")}
        cm = CostModel("gloo", world_size, link, link, priced, source="test")
    rt = nfab.attach(ddp, route=ROUTES[routes], cost_model=cm, optimizer=opt)
    launches = [0]  # over all steps
    launch = BlockQScatter.launch

    def counted(self, *args, **kwargs):  # instrumentation only: the real collectives run
        launches[0] += 1
        return launch(self, *args, **kwargs)

    BlockQScatter.launch = counted  # type: ignore[method-assign]
    out: dict = {"grads": [], "bytes": [], "replicas": [], "mix": [], "collectives": []}
    try:
        for step in range(steps):
            x, y = twins.batch(rank, step)
            opt.zero_grad()
            twins.loss_fn(ddp, x, y).backward()
            st = rt.step_stats()
            out["bytes"].append(st.wire_bytes)
            out["collectives"].append(st.collectives)
            out["mix"].append(st.route_elements)
            out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            out["replicas"].append(twins.replicas_equal(model, world_size))
    finally:
        BlockQScatter.launch = launch  # type: ignore[method-assign]
    out["launches"] = launches[0]
    return out


def _both(rank: int, world_size: int, steps: int, routes: str = "bq") -> tuple[dict, dict]:
    return _train(rank, world_size, False, steps, routes), _train(rank, world_size, True, steps, routes)


@pytest.mark.world_size(3)
@pytest.mark.parametrize("world_size,routes", [(2, "bq"), (3, "bq"), (2, "levels")])
def test_hook_picks_blockqscatter_and_matches_blockq_bit_for_bit(world_size, routes):
    steps = 4
    for scatter, plain in run_ranks(_both, world_size, steps, routes, timeout_s=240):
        assert scatter["launches"] > 0 and plain["launches"] == 0
        assert all(scatter["replicas"]) and all(plain["replicas"])
        for a, b in zip(scatter["grads"], plain["grads"], strict=True):
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name
        assert all(s < p for s, p in zip(scatter["bytes"], plain["bytes"], strict=True))
        # both reducers carry the same routes: bq2 (linear, conv), or bl5 and bl6 there
        want = {"bq2"} if routes == "bq" else {"bl5", "bl6"}
        assert scatter["mix"] == plain["mix"] and want <= set(scatter["mix"][0])
        # each blockqscatter launch is two collectives (all-to-all, all-gather) where blockq's is one
        assert sum(scatter["collectives"]) == sum(plain["collectives"]) + scatter["launches"]
