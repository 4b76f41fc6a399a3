"""The hook on CUDA with NCCL (`make test-gpu`; skipped without CUDA).

One rank per GPU, W = min(2, GPUs): with one GPU the paths still run on the device
(allocations, generators, masks instead of host reads) at W=1. Checked against plain DDP
and independent computations, as on gloo. With one GPU:
- fp32 route = plain DDP (fp32 and bf16 models), mixed routes with a NaN step;
- every route (sign through each of its three reducers, q8, q4, bf16, fp16, fp32), error
  feedback on and off, exact and delayed qsum scales, the coalesced all-gather: each slice
  against this rank's own gradient through the route, with every hook body and callback
  under `torch.cuda.set_sync_debug_mode("error")` (a host sync raises);
- two gloo ranks sharing the GPU with CUDA tensors (skipped, with gloo's reason, where gloo
  has no CUDA variant of a collective the hook uses).
"""

from __future__ import annotations

import contextlib
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
    out = {"bad": [], "replicas": [], "skipped": [], "nan_at_nan": None}
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
            out["nan_at_nan"] = all(bool(p.grad.isnan().all()) for p in model.parameters() if p.grad is not None)
        else:
            for name, p in model.named_parameters():
                if name in local and MIXED.get(regions[name]) == "sign":
                    if not twins.sign_agrees(p.grad.float(), local[name], world_size):
                        out["bad"].append(f"{step}:{name}")
        if not st.skipped:  # its buckets are NaN, as plain DDP's would be non-finite
            opt.step()
        out["replicas"].append(_replicas_equal(model, world_size))
    out["finite"] = bool(torch.isfinite(_flat(model)).all())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_routes_and_nan_skip_on_cuda(dtype):
    nan_step = 2
    res = run_ranks(_mixed, _world(), dtype, nan_step, backend="nccl", timeout_s=300)
    for r in res:
        assert r["bad"] == [] and all(r["replicas"]) and r["finite"] and r["nan_at_nan"]
        assert r["skipped"] == [i == nan_step for i in range(nan_step + 2)]


# ---- every route on the device at W=1, against independent references; no host sync ----------

SIGN_KEYS = ("signgather", "signcount", "signscatter")
ROUTE_CASES = {  # routes, error feedback, qsum scale, sign reducer to force (None: by bytes)
    "sign-q8-bf16-q4": ({"conv": "sign", "linear": "q8", "embedding": "sign", "head": "sign", "norm": "bf16",
                         "bias": "q4", "small": "fp32"}, True, "exact", None),
    "signcount-q4-fp16": ({"conv": "sign", "linear": "q4", "embedding": "sign", "head": "sign", "norm": "fp16",
                           "bias": "q8", "small": "fp32"}, False, "delayed", "signcount"),
    "signscatter-q8": ({"conv": "sign", "linear": "q8", "embedding": "sign", "head": "sign", "norm": "fp32",
                        "bias": "q4", "small": "fp32"}, True, "exact", "signscatter"),
}


class _SyncChecked:
    """Mixin: the hook body and its callbacks run under `torch.cuda.set_sync_debug_mode("error")`
    (any host sync raises); the step-boundary fold (once per step, here outside the hook because
    the loop calls `step_stats()`) is left out."""

    def hook(self, bucket):  # noqa: ANN001, ANN201
        if self._saw_last:
            self._finish_step()
        with _sync_error():
            return super().hook(bucket)

    def _callback(self, *args):  # noqa: ANN002, ANN202
        with _sync_error():  # NCCL's futures are complete at launch: this often runs inside `hook`
            return super()._callback(*args)


@contextlib.contextmanager
def _sync_error():
    """Host syncs raise inside the block; the mode before it comes back after (not "default": a callback
    run inside the hook body would switch the check off for the rest of that body)."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _runtime_cls():
    from nfab.runtime.frontends.ddp import Runtime

    return type("SyncChecked", (_SyncChecked, Runtime), {})


def _forcing(key, world_size: int):
    from nfab.wire.cost import CostModel, LinkCost

    if key is None:
        return None
    link = LinkCost(latency_s=1e-5, bandwidth_bps=1e9)
    return CostModel("nccl", world_size, link, link, {k: 1.0 for k in SIGN_KEYS if k != key})


def _reference_ok(route: str, g: torch.Tensor, got: torch.Tensor, w: int, scale_hist: float | None) -> bool:
    """W=1: the hook's 'mean' is this rank's own gradient through the route. The twin's
    gradient `g` comes from a second backward, which CUDA kernels with atomics may round
    differently in the last bit: tolerances allow that, and a sign may differ only where
    |g| is within that noise of zero."""
    g, got = g.float().reshape(-1), got.float().reshape(-1)
    big = g.abs().max() + 1e-30
    if route == "sign":  # majority of one vote: +-1 times the slice's mean |g|
        s = g.abs().mean()
        expect = torch.where(g >= 0, 1.0, -1.0) * s
        off = (got - expect).abs() > 1e-4 * s + 1e-30
        return bool((g[off].abs() <= 1e-5 * big).all())
    if route in ("q8", "q4"):
        scale = torch.tensor(scale_hist, device=g.device) if scale_hist is not None else g.abs().max()
        m = ((1 << int(route[1])) - 1) // w
        return bool(((got - g.clamp(-scale, scale)).abs() <= 2 * scale / m * (1 + 1e-4) + 1e-6 * big).all())
    if route in ("bf16", "fp16"):  # one rounding of g to the route's dtype
        ulp = 2.0**-8 if route == "bf16" else 2.0**-11
        return bool(((got - g).abs() <= ulp * g.abs() + 1e-6 * big).all())
    return bool(((got - g).abs() <= 1e-5 * g.abs() + 1e-6 * big).all())


def _routes_run(rank: int, world_size: int, case: str) -> dict:
    from nfab.profile.schema import Profile
    from nfab.runtime.frontends.ddp import nfab_hook

    routes, ef, qsum_scale, force = ROUTE_CASES[case]
    torch.backends.cudnn.deterministic = True  # the twin's conv gradient as DDP's (references above)
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = twins.Awkward().to(dev)
    ddp = DDP(model, device_ids=[dev], find_unused_parameters=True, bucket_cap_mb=0.02)
    rt = _runtime_cls()(ddp, Profile.static(routes), explicit=True, error_feedback=ef,
                        cost_model=_forcing(force, world_size), qsum_scale=qsum_scale)
    ddp.register_comm_hook(rt, nfab_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    out = {"bad": [], "skipped": [], "keys": set(), "nonempty_residuals": False}
    nan_step = 2
    for step in range(4):
        x, y = (t.to(dev) for t in twins.batch(rank, step))
        twin = copy.deepcopy(model)
        twins.loss_fn(twin, x, y).backward()
        local = {n: p.grad.detach().clone() for n, p in twin.named_parameters() if p.grad is not None}
        before = {k: v.clone() for k, v in rt.residuals.items()}
        demoted = rt.health.demoted()
        hist = {k: max(a for _, a in h) for k, h in rt.scales.history.items()
                if qsum_scale == "delayed" and h and h[-1][0] == step - 1}
        opt.zero_grad()
        loss = twins.loss_fn(ddp, x, y)
        if step == nan_step:
            loss = loss * float("nan")
        rt.observe_loss(loss)
        loss.backward()
        st = rt.step_stats()
        out["skipped"].append(st.skipped)
        out["keys"] |= set(st.route_mix)
        if step == nan_step:
            if not all(bool(p.grad.isnan().all()) for p in model.parameters() if p.grad is not None):
                out["bad"].append(f"{step}:not NaN")
        else:
            for name, p in model.named_parameters():
                if name not in local:
                    continue
                route = "fp32" if rt.regions[name] in demoted else routes[rt.regions[name]]
                g = local[name] + (before[name].view_as(local[name]) if name in before else 0)
                if not _reference_ok(route, g, p.grad, world_size, hist.get(name)):
                    out["bad"].append(f"{step}:{name}:{route}")
        out["nonempty_residuals"] |= bool(rt.residuals)
        if not st.skipped:
            opt.step()
    out["finite"] = bool(torch.isfinite(_flat(model)).all())
    out["keys"] = sorted(out["keys"])
    return out


@pytest.mark.parametrize("case", sorted(ROUTE_CASES))
def test_every_route_on_cuda_matches_references_without_host_sync(case):
    """One GPU: NCCL at W=1. Sign (each of the three reducers), q8, q4, bf16, fp16 and fp32 slices
    against this rank's own gradient through the route; error feedback on and off; a NaN step
    NaN in every bucket (and not stepped on); and no host sync in any hook body or callback
    (`set_sync_debug_mode("error")`)."""
    res = run_ranks(_routes_run, 1, case, backend="nccl", timeout_s=300)
    routes, ef, _, force = ROUTE_CASES[case]
    for r in res:
        assert r["bad"] == [] and r["finite"]
        assert r["skipped"] == [False, False, True, False]
        assert r["nonempty_residuals"] == ef
        if force is not None:
            assert force in r["keys"], r["keys"]


def _gloo_cuda(rank: int, world_size: int) -> dict:
    """Two gloo ranks holding CUDA tensors on one GPU: the hook's collectives through gloo's CUDA paths."""
    torch.cuda.set_device(0)
    routes = ROUTE_CASES["sign-q8-bf16-q4"][0]
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = twins.Awkward().to(dev)
    ddp = DDP(model, device_ids=[dev], find_unused_parameters=True, bucket_cap_mb=0.02)
    rt = nfab.attach(ddp, route=routes, cost_model=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    try:
        for step in range(3):
            x, y = (t.to(dev) for t in twins.batch(rank, step))
            opt.zero_grad()
            twins.loss_fn(ddp, x, y).backward()
            rt.step_stats()
            opt.step()
        replicas = _replicas_equal(model, world_size)
    except RuntimeError as e:  # gloo lacks a CUDA variant of a collective the hook uses: a skip
        if not _gloo_unsupported(str(e)):
            raise  # anything else (a tensor on the wrong device, a wrong result) fails the test
        return {"unsupported": str(e).splitlines()[0]}
    return {"unsupported": None, "replicas": replicas, "finite": bool(torch.isfinite(_flat(model)).all())}


def _gloo_unsupported(message: str) -> bool:
    """Whether `message` is gloo refusing a collective on CUDA tensors ("ProcessGroupGloo::allgather:
    unsupported device type cuda", "... not supported ..."), not an error of nfab's."""
    text = message.lower()
    return "gloo" in text and ("unsupported" in text or "not supported" in text or "not implemented" in text)


def test_two_gloo_ranks_with_cuda_tensors():
    res = run_ranks(_gloo_cuda, 2, backend="gloo", timeout_s=300)
    if any(r["unsupported"] for r in res):
        pytest.skip(f"gloo cannot run the hook's collectives on CUDA tensors: {res[0]['unsupported']}")
    assert all(r["replicas"] and r["finite"] for r in res)
