"""The noise-corrected second moment (`runtime/moment.py`): its variance model against the real
rounding, and inside the hook on real gloo ranks against an independent computation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import twins  # noqa: E402
from test_blockq_hook_dist import _block_scale  # noqa: E402

import nfab  # noqa: E402
from nfab.runtime.bindings import classify  # noqa: E402
from nfab.runtime.control.moment import FLOOR, NoiseMoment, rounding_variance  # noqa: E402
from nfab.wire import noise  # noqa: E402
from nfab.wire.blockq.reducer import scale_codes  # noqa: E402
from nfab.wire.registry import candidates  # noqa: E402


@pytest.mark.parametrize("route", ["bq2", "bl5", "bq3"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_the_variance_model_matches_stratified_rounding_of_w_ranks(route: str, world_size: int) -> None:
    """W ranks' own gradients (correlated, spread over several levels) through the route's real
    encode with stratified noise: the W-rank mean's error variance is what `rounding_variance` says."""
    red = candidates(route)[0]
    n, lengths = 64 * 512, [64 * 512]
    g = torch.Generator().manual_seed(7)
    common = torch.randn(n, generator=g)
    xs = [common + 0.7 * torch.randn(n, generator=g) for _ in range(world_size)]
    codes = scale_codes(torch.stack([red.local_scale(x, lengths) for x in xs]).amax(0))
    errs = []
    for trial in range(6):
        key = torch.Generator().manual_seed(100 + trial)
        keys = noise.draw_keys(key, len(lengths), torch.device("cpu"))
        mean = sum(red.encode(x, lengths, world_size, codes, noise.Stratum(keys, r, world_size)).local
                   for r, x in enumerate(xs)) / world_size
        errs.append(mean - sum(xs) / world_size)
    measured = float(torch.stack(errs).square().mean())
    modelled = float(rounding_variance(red, codes, lengths, world_size, None).mean())
    assert measured == pytest.approx(modelled, rel=0.12)


def _moment_in_hook(rank: int, world_size: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = twins.Awkward()
    regions = {n: b.region for n, b in classify(model).items()}
    routes = {"linear": "bq2", "embedding": "bl5"}
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=100)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, betas=(0.9, 0.95))
    rt = nfab.attach(ddp, route=routes, cost_model=None, optimizer=opt, noise_moment=True)
    out: dict = {"bad": [], "checked": 0, "replicas": [], "applied": 0}
    for step in range(steps):
        x, y = twins.batch(rank, step)
        local = twins.local_grads(model, [(x, y)])
        opt.zero_grad()
        twins.loss_fn(ddp, x, y).backward()
        rt.step_stats()
        expected = {}
        for name, p in model.named_parameters():
            route = routes.get(regions.get(name, ""), "fp32")
            state = opt.state.get(p)
            if name not in local or route == "fp32" or not state:
                continue
            red = candidates(route)[0]
            every = [torch.empty_like(local[name]) for _ in range(world_size)]
            dist.all_gather(every, local[name])
            v = state["exp_avg_sq"]  # the hook rounded g / w (w from this v), so its scales are stated here
            w = (v.sqrt() + 1e-8).clamp_min(float((v.sqrt() + 1e-8).mean()) * 0.01)
            scale = _block_scale([g / w for g in every], red.block) * w
            var = (scale * (2.0 / red.steps)).square() * (world_size + 1) / (12 * world_size**2)
            floor = var * FLOOR * (1 - 0.95 ** float(state["step"]))  # where Adam reads v: bias-corrected
            corrected = torch.maximum(v - var * (0.05 / 0.95), torch.minimum(v, floor))
            expected[name] = corrected * 0.95 + 0.05 * p.grad * p.grad
        opt.step()
        out["applied"] = rt.moment.applied_steps
        for name, p in model.named_parameters():
            if name in expected:
                got = opt.state[p]["exp_avg_sq"]
                if not torch.allclose(got, expected[name], rtol=1e-4, atol=1e-12):
                    out["bad"].append(f"{step}:{name}: {float((got - expected[name]).abs().max()):.3g}")
                out["checked"] += 1
        out["replicas"].append(twins.replicas_equal(model, world_size))
    return out


@pytest.mark.world_size(3)
def test_the_hook_takes_the_rounding_variance_out_of_adams_second_moment() -> None:
    """Every step after the first (AdamW has no v before it), each block-scaled parameter's v is
    beta2 max(v - (1 - beta2)/beta2 var, min(v, FLOOR var (1 - beta2^n))) + (1 - beta2) g^2, with var from every
    rank's gradients;
    the replicas stay bit-identical."""
    from nfab.distributed import run_ranks

    for r in run_ranks(_moment_in_hook, 3, 4, timeout_s=300):
        assert r["bad"] == [] and r["checked"] > 0 and all(r["replicas"])
        assert r["applied"] == 3  # steps 1..3 (step 0: no second moment yet)


def test_a_step_with_a_closure_is_corrected_after_its_backward() -> None:
    """Lightning runs forward and backward inside `optimizer.step(closure)`: the step pre-hook fires
    before the step's variance is recorded. The correction must follow the closure and equal what a
    plain step (backward, then `step()`) gives, bit for bit, on every step."""
    def run(with_closure: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 4, bias=False)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
        moment = NoiseMoment(opt, {"w": layer.weight})
        x = torch.randn(16, 8)
        seen = []

        def backward() -> torch.Tensor:
            opt.zero_grad()
            loss = layer(x).square().mean()
            loss.backward()
            moment.record(["w"], [layer.weight.numel()], layer.weight.grad.reshape(-1).square() * 0.1)
            return loss

        for _ in range(4):
            if with_closure:
                opt.step(backward)
            else:
                backward()
                opt.step()
            seen.append(opt.state[layer.weight]["exp_avg_sq"].clone())
        assert moment.applied_steps == 3 and not moment._pending  # step 1 has no v yet; nothing left over
        return seen

    for plain, closed in zip(run(False), run(True), strict=True):
        assert torch.equal(plain, closed)
