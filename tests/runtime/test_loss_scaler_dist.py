"""A loss scaler sees nfab's non-finite steps as it sees plain DDP's (real DDP on gloo, W=2).

fp16 training with `torch.amp.GradScaler` overflows by design: at the start, while the scale comes
down, and whenever it grows again. The scaler then skips `optimizer.step()` and halves its scale,
because the reduced gradient is non-finite. nfab zeroed a non-finite bucket, so the scaler saw a
finite, zero gradient: it stepped (AdamW moved the weights by its momentum) and kept the scale that
overflowed. A non-finite bucket is now NaN on every rank (`decode._spoil_if`), and the overflow is an
alarm a shadow window checks, not a demotion of every lossy region for the cooldown. Here an overflow is
one rank's infinite element at step 3, in a lossy bucket, in a bucket that mixes FP32 and lossy
slices, and in FP32-only buckets. FSDP2: `tests/fsdp/test_fsdp_control_dist.py`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.distributed import run_ranks

OVERFLOW, STEPS = 3, 6
ROUTES = {"plain": None, "bq2": "bq2", "sign": "sign", "q8": "q8", "mixed": {"linear": "bq2", "bias": "fp32"},
          "fp32": "fp32"}


def _scaled(rank: int, world_size: int, route: object) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    rt = nfab.attach(ddp, route=route, cost_model=None, optimizer=opt) if route is not None else None
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    at = [0]

    def overflow(g: torch.Tensor) -> torch.Tensor:  # what an fp16 overflow leaves in one rank's gradient
        if at[0] == OVERFLOW and rank == 0:
            g = g.clone()
            g[0, 0] = float("inf")
        return g

    model[0].weight.register_hook(overflow)
    gen = torch.Generator().manual_seed(rank)
    out: dict = {"scale": [], "moved": [], "skipped": [], "mix": []}
    for step in range(STEPS):
        at[0] = step
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()
        st = rt.step_stats() if rt is not None else None
        out["skipped"].append(st.skipped if st is not None else None)
        out["mix"].append(dict(st.route_mix) if st is not None else None)
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        scaler.step(opt)
        scaler.update()
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out["scale"].append(scaler.get_scale())
        out["moved"].append(bool((after != before).any()))
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return out


@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", [n for n in ROUTES if n != "plain"])
def test_the_scaler_skips_an_overflow_and_lowers_its_scale_as_with_plain_ddp(name):
    plain = run_ranks(_scaled, 2, None, timeout_s=120)[0]
    res = run_ranks(_scaled, 2, ROUTES[name], timeout_s=120)
    assert plain["scale"] == [1024.0] * OVERFLOW + [512.0] * (STEPS - OVERFLOW)
    assert plain["moved"] == [step != OVERFLOW for step in range(STEPS)]
    for r in res:
        assert r["scale"] == plain["scale"], (name, r["scale"])  # halved at the overflow, as plain DDP's
        assert r["moved"] == plain["moved"], (name, r["moved"])  # no step on it: the weights did not move
        assert r["skipped"] == [step == OVERFLOW for step in range(STEPS)]
        assert torch.isfinite(r["params"]).all()
        # the overflow opened a shadow window and kept the routes: it used to send the cooldown in FP32
        assert r["mix"][OVERFLOW + 1] == r["mix"][OVERFLOW - 1], (name, r["mix"])
    assert torch.equal(res[0]["params"], res[1]["params"])
    if name == "fp32":  # the FP32 route is plain DDP, overflow included, bit for bit
        assert torch.equal(res[0]["params"], plain["params"])



def _adam_bq2(rank: int, world_size: int, scale: float, tell: bool) -> dict:
    """bq2 under AdamW (rounded in Adam's preconditioned space, noise moment on), the loss scaled by
    `scale` (0: no scaler); `tell`: the scaler is given to attach."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale > 0)
    rt = nfab.attach(ddp, route="bq2", cost_model=None, optimizer=opt, loss_scaler=scaler if tell else None)
    gen = torch.Generator().manual_seed(rank)
    grads = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()
        rt.step_stats()
        grads.append(model[0].weight.grad / (scale or 1.0))  # exact: a power of two
        scaler.step(opt)
        scaler.update()
    return {"grads": grads, "v": opt.state[model[0].weight]["exp_avg_sq"].clone(), "moment": rt.moment.applied_steps}


@pytest.mark.world_size(2)
def test_block_routes_under_adam_round_as_unscaled_when_told_the_scaler():
    """At S = 65536 the preconditioned values passed the top of the block scale codes (2^23.75) and were
    clipped, and the rounding variance taken out of v was S^2 too large (the floor then cancelled it).
    Told the scaler, nfab divides by S (on the device): the same gradients and v as with no scaler."""
    plain = run_ranks(_adam_bq2, 2, 0.0, False, timeout_s=120)[0]
    told = run_ranks(_adam_bq2, 2, 65536.0, True, timeout_s=120)[0]
    untold = run_ranks(_adam_bq2, 2, 65536.0, False, timeout_s=120)[0]
    assert all(torch.equal(a, b) for a, b in zip(plain["grads"], told["grads"], strict=True))
    assert torch.equal(plain["v"], told["v"]) and plain["moment"] == told["moment"] == STEPS - 1
    assert not torch.equal(plain["grads"][2], untold["grads"][2])  # what the scaler's S did without it


CHANGE, RUN = 3, 7


def _scale_change(rank: int, world_size: int, route: str, qsum_scale: str, change: float | None, tell: bool) -> dict:
    """SGD with error feedback on `route`, the loss scaled by 2^10; `change`: the scaler's scale is set to
    it after step CHANGE (as an overflow's halving or a growth interval's doubling sets it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    rt = nfab.attach(ddp, route=route, cost_model=None, optimizer=opt, error_feedback=True, qsum_scale=qsum_scale,
                     loss_scaler=scaler if tell else None)
    gen = torch.Generator().manual_seed(rank)
    saturated = 0
    for step in range(RUN):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()
        saturated += rt.step_stats().saturated_slices
        scaler.step(opt)
        scaler.update(change if change is not None and step == CHANGE else None)
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "saturated": saturated,
            "owed": sum(float(r.abs().sum()) for r in rt.residuals.values())}


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("route", "qsum_scale", "change"), [("bq3", "exact", 64.0), ("q8", "delayed", 2.0**14)])
def test_a_scale_change_leaves_error_feedback_and_delayed_scales_as_with_a_constant_scale(route, qsum_scale, change):
    """The residuals error feedback owes and qsum's delayed amax history are kept in the optimizer's
    units: a power-of-two scale change then changes no bit of training (every step of the codec is exact
    under a power-of-two scale). Kept in the gradients' units, as before, the owed error went out at the
    old scale once (here 16x too small or large) and the delayed scale was 16x too small for a step."""
    constant = run_ranks(_scale_change, 2, route, qsum_scale, None, True, timeout_s=120)
    changed = run_ranks(_scale_change, 2, route, qsum_scale, change, True, timeout_s=120)
    untold = run_ranks(_scale_change, 2, route, qsum_scale, change, False, timeout_s=120)[0]
    assert constant[0]["owed"] > 0  # error feedback was owing something when the scale changed
    for a, b in zip(constant, changed, strict=True):
        assert torch.equal(a["params"], b["params"]), route
        assert a["saturated"] == b["saturated"]
    assert torch.equal(changed[0]["params"], changed[1]["params"])
    assert not torch.equal(untold["params"], constant[0]["params"])  # what the change did unaccounted


def test_loss_scaler_must_be_a_grad_scaler():
    with pytest.raises(nfab.NfabError, match="loss_scaler must be a torch.amp.GradScaler"):
        nfab.attach(object(), route="bq2", loss_scaler=1024.0)  # refused before the model is looked at


def _framework(rank: int, world_size: int) -> dict:
    """What the adapters (Lightning's strategy, the Trainer's callback, Accelerate's attach) pass: their
    fp16 scaler as `loss_scaler`, unless the user gave one."""
    from nfab.config.attach import AttachConfig
    from nfab.integrations.defaults import attach_with_defaults

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    framework, own = torch.amp.GradScaler("cpu", init_scale=8.0), torch.amp.GradScaler("cpu", init_scale=2.0)
    out = {}
    for name, kwargs in (("framework", {}), ("own", {"loss_scaler": own})):
        rt = attach_with_defaults(DDP(model), None, AttachConfig(route="bq2", cost_model=None, **kwargs),
                                  total_steps=4, loss_scaler=framework)
        for s in (framework, own):
            s.scale(torch.ones(()))  # makes its scale tensor, as the first scaled loss does
        out[name] = float(rt.loss_scale())
    return out


@pytest.mark.world_size(2)
def test_a_frameworks_scaler_reaches_attach_and_the_users_wins():
    assert run_ranks(_framework, 2, timeout_s=60)[0] == {"framework": 8.0, "own": 2.0}


def test_the_scale_is_the_scalers_own_tensor_or_else_its_value():
    """The scale is read as the scaler's own device tensor (no host sync); a scaler that keeps it under
    another name gives its value rather than nothing (which would read as unscaled, in silence)."""
    from nfab.runtime.control.optim import loss_scale_of

    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    read = loss_scale_of(scaler)
    assert read() is None  # before the first scale(): no gradient carries a scale yet
    scaler.scale(torch.ones(()))
    assert read() is scaler._scale and float(read()) == 8.0

    class Elsewhere:
        def is_enabled(self) -> bool:
            return True

        def scale(self, t: torch.Tensor) -> torch.Tensor:
            return t * 4.0

        def get_scale(self) -> float:
            return 4.0

    assert float(loss_scale_of(Elsewhere())()) == 4.0
    assert loss_scale_of(torch.amp.GradScaler("cpu", enabled=False))() is None
