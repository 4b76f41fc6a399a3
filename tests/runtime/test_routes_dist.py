"""Mixed buckets, non-finite gradients, capacity fallback and state round trips on real gloo ranks."""

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
from nfab.wire.cost import CostModel, LinkCost  # noqa: E402

ROUTE = {"conv": "q4", "linear": "sign", "head": "q8", "norm": "fp32"}
MIXED = {"norm": "fp32", "bias": "fp32", "small": "fp32", "conv": "sign", "linear": "sign",
         "embedding": "sign", "head": "sign", "other": "sign"}


def _mixed(rank: int, world_size: int, steps: int, error_feedback: bool, coalesce: bool) -> dict:
    torch.manual_seed(0)
    model = twins.Awkward()
    regions = {n: b.region for n, b in classify(model).items()}
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.05)
    # a slow-latency link model: coalescing pays at W=3 too (without one it never adds bytes)
    slow = CostModel("gloo", world_size, LinkCost(1e-2, 1e9), LinkCost(1e-2, 1e9), source="test")
    rt = nfab.attach(ddp, route=MIXED, error_feedback=error_feedback, cost_model=slow if world_size > 2 else None,
                     coalesce=coalesce)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    report = {"fp32_mismatch": [], "sign_mismatch": [], "replica_mismatch": [], "regions": regions, "stats": [],
              "norm_error": []}
    for step in range(steps):
        x, y = twins.batch(rank, step)
        local = twins.local_grads(model, [(x, y)])
        opt.zero_grad()
        twins.loss_fn(ddp, x, y).backward()
        report["stats"].append(rt.step_stats())
        # the reported norm, independently: sqrt(mean over ranks of each rank's |g|^2), whether
        # the bucket's norm pass took a slice or the sign encoder did on its read
        sq = torch.stack([g.double().square().sum() for g in local.values()]).sum()
        dist.all_reduce(sq)
        expected = float((sq / world_size).sqrt())
        report["norm_error"].append(abs(report["stats"][-1].grad_norm - expected) / expected)
        for name, p in model.named_parameters():
            if name not in local:
                continue
            g = local[name]
            if MIXED[regions[name]] == "fp32":
                ref = g * (1.0 / world_size)
                dist.all_reduce(ref)
                if world_size == 2 and not torch.equal(p.grad, ref):
                    report["fp32_mismatch"].append(f"{step}:{name}")
                elif not torch.allclose(p.grad, ref, rtol=1e-5, atol=1e-7):
                    report["fp32_mismatch"].append(f"{step}:{name}")
            elif not error_feedback or step == 0:
                if not twins.sign_agrees(p.grad, g, world_size):
                    report["sign_mismatch"].append(f"{step}:{name}")
        opt.step()
        if not twins.replicas_equal(model, world_size):
            report["replica_mismatch"].append(step)
    return report


@pytest.mark.world_size(3)
@pytest.mark.parametrize("world_size,error_feedback,coalesce", [(2, True, True), (3, False, True), (2, False, False),
                                                                (3, True, False)])
def test_mixed_bucket_keeps_fp32_semantics_and_majority_signs(world_size, error_feedback, coalesce):
    res = run_ranks(_mixed, world_size, 6, error_feedback, coalesce, timeout_s=180)
    for r in res:
        assert r["fp32_mismatch"] == []
        assert r["sign_mismatch"] == []
        assert r["replica_mismatch"] == []
        assert max(r["norm_error"]) < 1e-5
    stats = res[0]["stats"]
    assert len(stats) == 6 and [s.step for s in stats] == list(range(6))
    mix = stats[-1].route_mix
    assert mix.get("fp32", 0) > 0 and mix.get("signgather", 0) + mix.get("signcount", 0) > 0.5
    assert 0 < stats[-1].wire_bytes < stats[-1].baseline_wire_bytes / 4
    # coalesced: one all-gather per bucket; else a collective per group plus control words
    per_bucket = stats[-1].collectives / stats[-1].buckets
    assert per_bucket == 1.0 if coalesce else per_bucket > 2.0
    # step 0 is a probe step: one bucket's lossy slices were also sampled in FP32; its
    # cosine travels in step 1's first control word (agreed by every rank), and step 1 reports it
    assert stats[1].fidelity_cosine is not None and 0.2 < stats[1].fidelity_cosine <= 1.0
    assert all(s.fidelity_cosine is None for i, s in enumerate(stats) if i != 1)


def _nonfinite(rank: int, world_size: int, bad_step: int) -> dict:
    torch.manual_seed(0)
    model = twins.Awkward()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.05)
    rt = nfab.attach(ddp, route="sign", cost_model=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    out = {"stats": [], "replicas_equal": True, "grads_nan_at_bad": None}
    for step in range(bad_step + 4):
        x, y = twins.batch(rank, step)
        opt.zero_grad()
        loss = twins.loss_fn(ddp, x, y)
        if step == bad_step and rank == world_size - 1:
            loss = loss * float("nan")
        rt.observe_loss(loss)
        loss.backward()
        out["stats"].append(st := rt.step_stats())
        if step == bad_step:  # every bucket NaN, as plain DDP's would be non-finite: a loop must not step on it
            out["grads_nan_at_bad"] = all(bool(p.grad.isnan().all()) for p in model.parameters() if p.grad is not None)
        if not st.skipped:
            opt.step()
        out["replicas_equal"] &= twins.replicas_equal(model, world_size)
        out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    out["events"] = [str(e) for e in rt.events]
    return out


@pytest.mark.world_size(3)
def test_nonfinite_on_one_rank_is_skipped_identically_everywhere():
    res = run_ranks(_nonfinite, 3, 3, timeout_s=120)
    for r in res:
        assert r["replicas_equal"] and r["finite"] and r["grads_nan_at_bad"]
        bad = r["stats"][3]
        assert bad.skipped and bad.fallback and "nonfinite" in bad.fallback_reason
        assert not any(s.skipped for i, s in enumerate(r["stats"]) if i != 3)
        assert r["events"] == res[0]["events"] and any("nonfinite" in e for e in r["events"])


def _nan_in_a_sign_slice(rank: int, world_size: int, bad_step: int) -> dict:
    """A NaN in one sign-routed parameter only, on one rank, in buckets beside FP32 slices: the
    sign encoder takes that slice's |x|^2 on its read (not the bucket's norm pass), and the
    control word must still carry the non-finite norm to every rank."""
    torch.manual_seed(0)
    model = twins.Awkward()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.05)
    rt = nfab.attach(ddp, route=MIXED, error_feedback=False, cost_model=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    poison = [False]
    model.conv.weight.register_hook(lambda g: g * float("nan") if poison[0] else g)
    out = {"stats": [], "replicas_equal": True}
    for step in range(bad_step + 3):
        x, y = twins.batch(rank, step)
        opt.zero_grad()
        poison[0] = step == bad_step and rank == world_size - 1
        twins.loss_fn(ddp, x, y).backward()
        out["stats"].append(st := rt.step_stats())
        if not st.skipped:
            opt.step()
        out["replicas_equal"] &= twins.replicas_equal(model, world_size)
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    out["mix"] = out["stats"][bad_step].route_mix  # after it the monitor falls back to FP32 for a while
    return out


@pytest.mark.world_size(2)
def test_nan_in_a_sign_slice_is_skipped_on_every_rank():
    res = run_ranks(_nan_in_a_sign_slice, 2, 2, timeout_s=120)
    for r in res:
        assert r["replicas_equal"] and r["finite"] and r["mix"].get("signgather", 0) > 0
        assert [s.skipped for s in r["stats"]] == [False, False, True, False, False]


def _train(rank: int, world_size: int, steps: int, start_state: dict | None, stop_at: int | None,
           route: object = ROUTE) -> dict:
    torch.manual_seed(0)
    model = twins.Awkward()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    # SGD: error_feedback="auto" turns error feedback on
    rt = nfab.attach(ddp, route=route, cost_model=None, optimizer=opt) if route is not None else None
    first = 0
    if start_state is not None:
        model.load_state_dict(start_state["model"])
        opt.load_state_dict(start_state["opt"])
        if rt:
            rt.load_state_dict(start_state["hook"][rank])
        first = start_state["step"]
    for step in range(first, steps):
        if stop_at is not None and step == stop_at:
            states = [None] * world_size
            dist.all_gather_object(states, rt.state_dict() if rt else None)
            return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                    "hook": states, "step": step}
        x, y = twins.batch(rank, step)
        opt.zero_grad()
        twins.loss_fn(ddp, x, y).backward()
        opt.step()
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "residuals": sorted(rt.residuals) if rt else []}


@pytest.mark.world_size(2)
def test_state_dict_round_trip_continues_exactly():
    straight = run_ranks(_train, 2, 8, None, None)
    saved = run_ranks(_train, 2, 8, None, 4)[0]
    resumed = run_ranks(_train, 2, 8, saved, None)
    assert straight[0]["residuals"]  # error feedback was live
    for r in range(2):
        assert torch.equal(straight[r]["params"], resumed[r]["params"])


def _state_devices(rank: int, world_size: int) -> dict:
    """A checkpoint's residuals: host copies out (rank 0 gathers every rank's state), back onto each
    parameter's device in (`Runtime.devices`; a GPU's here stood for by meta)."""
    torch.manual_seed(0)
    model = twins.Awkward()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    rt = nfab.attach(ddp, route=ROUTE, cost_model=None, optimizer=opt)  # SGD: error feedback on
    for step in range(2):
        x, y = twins.batch(rank, step)
        opt.zero_grad()
        twins.loss_fn(ddp, x, y).backward()
        opt.step()
    state = rt.state_dict()
    out = {"residuals": len(state["residuals"]),
           "devices": rt.devices == {n: p.device for n, p in model.named_parameters()},
           "host_copies": all(v.device.type == "cpu" and v.data_ptr() != rt.residuals[k].data_ptr()
                              for k, v in state["residuals"].items())}
    rt.devices = dict.fromkeys(rt.devices, torch.device("meta"))
    rt.load_state_dict(state)
    out["loaded_onto_devices"] = all(v.device.type == "meta" for v in rt.residuals.values())
    return out


@pytest.mark.world_size(2)
def test_residuals_leave_on_the_host_and_load_onto_their_parameters_device():
    for r in run_ranks(_state_devices, 2):
        assert r["residuals"] and r["devices"] and r["host_copies"] and r["loaded_onto_devices"]


def _capacity(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = twins.Awkward()
    ddp = DDP(model, find_unused_parameters=True)
    rt = nfab.attach(ddp, route="q2", cost_model=None)
    x, y = twins.batch(rank, 0)
    twins.loss_fn(ddp, x, y).backward()
    st = rt.step_stats()
    return {"mix": st.route_mix, "fallback": st.fallback, "reason": st.fallback_reason}


@pytest.mark.world_size(4)
def test_route_over_capacity_falls_back_to_fp32_with_reason():
    res = run_ranks(_capacity, 4, timeout_s=120)  # q2 lanes hold < 2 levels per rank at W=4
    for r in res:
        assert r["mix"] == {"fp32": 1.0}
        assert r["fallback"] and r["reason"].startswith("capacity(")
