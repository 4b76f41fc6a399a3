"""No host sync in the hook body or its callbacks: every lossy route on the device paths.

Under `dispatch.host_paths(False)` CPU tensors take the paths CUDA (or any device) takes:
torch ops, no compiled kernels, no numpy, no host read of a flag. `hostguard.HostReads`
records every read of a tensor value on the host (and every blocking host-to-device copy)
made inside a hook body or a callback; it must record none. The step-boundary fold (one
copy per step, outside the hook here because the loop calls `step_stats()`) is not guarded.

The device paths' results are checked against independent references on real gloo ranks:
sign votes against an all-reduce of the votes, q8/q4/bf16/fp16 against the true mean within
their rounding bound, error-feedback residuals against x - decode(own contribution),
replicas bit-identical, the non-finite step skipped everywhere; and the routes and skipped
steps equal the host-path run's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import twins  # noqa: E402
from hostguard import HostReads  # noqa: E402

from nfab.profile.schema import Profile  # noqa: E402
from nfab.runtime.control.optim import Preconditioner  # noqa: E402
from nfab.runtime.frontends.ddp import Runtime, nfab_hook  # noqa: E402
from nfab.wire import dispatch  # noqa: E402
from nfab.wire.cost import CostModel, LinkCost  # noqa: E402

MIXED = {"conv": "sign", "linear": "q8", "embedding": "sign", "head": "sign", "norm": "bf16", "bias": "q4",
         "small": "fp32"}
OTHER = {"conv": "sign", "linear": "q4", "embedding": "sign", "head": "sign", "norm": "fp16", "bias": "q8",
         "small": "fp32"}
BLOCKQ = {"conv": "bq3", "linear": "bq4-128", "embedding": "bq3", "head": "sign", "norm": "bq8", "bias": "bq3",
          "small": "fp32"}
SIGN_KEYS = ("signgather", "signcount", "signscatter")
# (routes, error feedback, qsum scale, bucket MB, the sign reducer to force or None)
CASES = {
    "mixed-ef": (MIXED, True, "exact", 0.02, None),
    "signcount-fp16-delayed": (OTHER, False, "delayed", 0.02, "signcount"),
    "signscatter-ef": (OTHER, True, "exact", 0.02, "signscatter"),
    "coalesced-ef": (MIXED, True, "exact", 100.0, None),  # signgather + gathered qsum in one all-gather
    "blockq-ef": (BLOCKQ, True, "exact", 0.02, None),  # block codes agreed by a uint8 MAX in the hook body
    "blockq-adam": (BLOCKQ, False, "exact", 0.02, None),  # rounding in AdamW's preconditioned space
}
ADAM = {"blockq-adam"}
NAN_STEP = 2
STEPS = 4


class Guarded(Runtime):
    """Hook bodies and callbacks under `HostReads` (the step-boundary fold stays outside)."""

    seen: list[str]

    def hook(self, bucket):  # noqa: ANN001, ANN201 - DDP's signature
        if self._saw_last:
            self._finish_step()
        with HostReads(self.seen):
            return super().hook(bucket)

    def _callback(self, *args):  # noqa: ANN002, ANN202
        with HostReads(self.seen):
            return super()._callback(*args)


def _forcing(key: str | None) -> CostModel | None:
    if key is None:
        return None
    link = LinkCost(latency_s=1e-5, bandwidth_bps=1e9)
    return CostModel("gloo", 2, link, link, {k: 1.0 for k in SIGN_KEYS if k != key})


def _check_step(rank: int, w: int, routes: dict, ef: bool, rt: Runtime, model: torch.nn.Module,
                x_local: dict[str, torch.Tensor], resid_before: dict[str, torch.Tensor], demoted: frozenset[str],
                delayed: dict[str, float], bad: list[str], step: int,
                weights: dict[str, torch.Tensor] | None = None) -> None:
    """The decoded mean of every slice against an independent reference on its route (fp32
    where health demoted its region: after the non-finite step; its residual is flushed)."""
    for name, p in model.named_parameters():
        if name not in x_local:
            continue
        route = "fp32" if rt.regions[name] in demoted else routes[rt.regions[name]]
        x = x_local[name].float()
        if name in resid_before:
            x = x + resid_before[name].view_as(x)
        got = p.grad.float()
        resid = rt.residuals.get(name, torch.full_like(x, float("nan"))).view_as(x)
        mean = x.clone()
        dist.all_reduce(mean)
        mean /= w
        if route == "sign":
            ok = twins.sign_agrees(got, x, w)
            if ef and ok:  # residual = x - (+-mean|x|), this rank's own decoded contribution (a zero: either)
                s = x.abs().mean()
                own = torch.where(x == 0, torch.where(resid < 0, s, -s), torch.where(x > 0, s, -s))
                ok = bool(((resid - (x - own)).abs() <= 1e-5 * s).all())
        elif route in ("q8", "q4"):  # within one level step of the mean of x clipped at the shared scale
            scale = x.abs().max()
            dist.all_reduce(scale, op=dist.ReduceOp.MAX)
            if name in delayed:  # the delayed scale (every rank holds the same history)
                scale = torch.tensor(delayed[name])
            m = ((1 << int(route[1])) - 1) // w
            step_size = 2 * scale / m
            clipped = x.clamp(-scale, scale)
            cmean = clipped.clone()
            dist.all_reduce(cmean)
            ok = bool(((got - cmean / w).abs() <= step_size * (1 + 1e-5)).all())
            if ef and ok:  # this rank's own rounding error: less than one step, plus what was clipped
                ok = bool(((resid - (x - clipped)).abs() <= step_size * (1 + 1e-5)).all())
        elif route.startswith("bq"):  # within one level step of the block scale (<= 2^(1/4) x the block max)
            bits, _, block = route[2:].partition("-")
            w_el = (weights or {}).get(name, torch.ones_like(x)).view_as(x)  # AdamW: blocks of x / scale
            blocks = torch.nn.functional.pad((x / w_el).reshape(-1), (0, -x.numel() % int(block or 64))).abs()
            bmax = blocks.view(-1, int(block or 64)).amax(dim=1)
            dist.all_reduce(bmax, op=dist.ReduceOp.MAX)
            step_size = (2 * 2.0**0.25 * bmax / ((1 << int(bits)) - 1)).repeat_interleave(int(block or 64))
            step_size = step_size[: x.numel()].view_as(x) * w_el
            ok = bool(((got - mean).abs() <= step_size * (1 + 1e-5) + 1e-30).all())
            if ef and ok:  # residual = x - this rank's own decoded levels: less than one step
                ok = bool((resid.abs() <= step_size * (1 + 1e-5) + 1e-30).all())
        elif route in ("bf16", "fp16"):  # x/W rounded on each rank, then the sum: 2 roundings of |x|/W
            size = x.abs()
            dist.all_reduce(size)
            ok = bool(((got - mean).abs() <= 2.0**-7 * size / w + 1e-30).all())
        else:
            ok = torch.allclose(got, mean, rtol=1e-5, atol=1e-8)
        if not ok:
            bad.append(f"{step}:{name}:{route}")


def _run(rank: int, world_size: int, case: str, host: bool) -> dict:
    routes, ef, qsum_scale, bucket_mb, force = CASES[case]
    torch.manual_seed(0)
    model = twins.Awkward()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=bucket_mb)
    rt = Guarded(ddp, Profile.static(routes), explicit=True, error_feedback=ef, cost_model=_forcing(force),
                 qsum_scale=qsum_scale)
    rt.seen = []
    ddp.register_comm_hook(rt, nfab_hook)
    if case in ADAM:
        opt: torch.optim.Optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        rt.preconditioner = Preconditioner(opt, dict(model.named_parameters()))
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    out: dict = {"bad": [], "skipped": [], "mix": [], "spoiled": None}
    with dispatch.host_paths(host):
        for step in range(STEPS):
            x, y = twins.batch(rank, step)
            local = twins.local_grads(model, [(x, y)])
            resid_before = {k: v.clone() for k, v in rt.residuals.items()}
            demoted = rt.health.demoted()
            delayed = {k: max(a for _, a in h) for k, h in rt.scales.history.items()
                       if rt.qsum_scale == "delayed" and h and h[-1][0] == step - 1}
            weights = _adam_scales(opt, model) if case in ADAM else None
            opt.zero_grad()
            loss = twins.loss_fn(ddp, x, y)
            if step == NAN_STEP and rank == 0:
                loss = loss * float("nan")
            rt.observe_loss(loss)
            loss.backward()
            st = rt.step_stats()
            out["skipped"].append(st.skipped)
            out["mix"].append(st.route_mix)
            if step == NAN_STEP:
                out["spoiled"] = all(bool(p.grad.isnan().all()) for p in model.parameters() if p.grad is not None)
            elif not host:
                _check_step(rank, world_size, routes, ef, rt, model, local, resid_before, demoted, delayed,
                            out["bad"], step, weights)
                if weights:
                    out["weighted"] = out.get("weighted", 0) + 1
            if not st.skipped:  # its buckets are NaN, as plain DDP's would be non-finite
                opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["replicas"] = twins.replicas_equal(model, world_size)
    out["seen"] = sorted(set(rt.seen))
    out["keys"] = sorted({g.key for plan in rt.plans.values()
                          for g in rt.controller.routes(plan, rt.controller.phase(0), frozenset()).groups})
    out["params"] = flat
    return out


def _adam_scales(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Per parameter, AdamW's sqrt(v) + eps floored at 1% of its mean, stated independently."""
    out = {}
    for name, p in model.named_parameters():
        v = opt.state.get(p, {}).get("exp_avg_sq")
        if v is not None:
            rms = v.sqrt() + 1e-8
            out[name] = torch.maximum(rms, rms.mean() * 0.01)
    return out


def _all(rank: int, world_size: int) -> dict:
    return {(case, host): _run(rank, world_size, case, host) for case in CASES for host in (False, True)}


@pytest.mark.world_size(2)
def test_device_paths_read_nothing_on_the_host_and_match_references():
    from nfab.distributed import run_ranks

    res = run_ranks(_all, 2, timeout_s=300)
    for case, (_, _, _, _, force) in CASES.items():
        for r in res:
            dev, host = r[(case, False)], r[(case, True)]
            assert dev["seen"] == [], (case, dev["seen"])
            assert dev["bad"] == [], (case, dev["bad"])
            assert dev["replicas"] and host["replicas"], case
            assert dev["spoiled"] and dev["skipped"] == [i == NAN_STEP for i in range(STEPS)], case
            assert dev["skipped"] == host["skipped"] and dev["mix"] == host["mix"], case
            assert torch.allclose(dev["params"], host["params"], rtol=1e-3, atol=1e-4), case
            if force is not None:
                assert force in dev["keys"], (case, dev["keys"])
            if case in ADAM:
                assert dev.get("weighted", 0) >= 1, case  # checked with AdamW's scales after its first step
            summed = "blockq" if case.startswith("blockq") else "qsum"  # a summed route with shared scales
            assert any(k.startswith(summed) for k in dev["keys"]), (case, dev["keys"])
