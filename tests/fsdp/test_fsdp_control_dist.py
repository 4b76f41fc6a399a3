"""FSDP2 front end's control on real gloo ranks: resume (with probes), a non-finite step, the
meta-device habit, bf16 reduce, and what attach refuses (several param groups and HSDP at W=4)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import fsdpmodels  # noqa: E402

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402
from nfab.errors import NfabError  # noqa: E402
from nfab.wire.cost import CostModel, LinkCost  # noqa: E402


def _run(rank: int, world_size: int, route, steps: int, kwargs: dict) -> dict:
    return fsdpmodels.train(rank, steps, route, **kwargs)


def _rows(stats) -> list:
    return [(s.step, s.route_mix, s.skipped, s.loss, s.grad_norm, s.wire_bytes, s.fallback_reason, s.events,
             s.probe_wire_bytes, s.region_cosine) for s in stats]


@pytest.mark.world_size(2)
def test_resume_equals_uninterrupted_and_meta_default_device_gives_the_same_bits():
    """Saved at step 3 (model shards, AdamW, nfab's state) and continued by a fresh copy: the same
    shards as the uninterrupted run, bit for bit; so are the comms run with meta as default device.
    Every codec family at once: block (bq3), exact qsum (q8, each rank's own noise) and sign; a probe
    every step, so step 2's probe sums cross the save (they ride step 3's first word)."""
    route = {"small": "bq3", "bias": "q8", "norm": "sign"}
    probes = {"health": {"probe_every": 1, "probe_budget": 0.0}}
    whole = run_ranks(_run, 2, route, 6, probes)
    resumed = run_ranks(_run, 2, route, 6, {"resume_at": 3, **probes})
    meta = run_ranks(_run, 2, route, 6, {"meta": True, **probes})
    assert set(whole[0]["stats"][-1].route_mix) == {"bq3", "q8", "sign"}, whole[0]["stats"][-1].route_mix
    for r in range(2):
        assert torch.equal(whole[r]["params"], resumed[r]["params"])
        assert torch.equal(whole[r]["params"], meta[r]["params"])
        assert whole[r]["losses"] == resumed[r]["losses"]
    assert _rows(whole[0]["stats"][3:]) == _rows(resumed[0]["stats"][3:])
    assert whole[0]["stats"][3].region_cosine and whole[0]["stats"][3].probe_wire_bytes > 0


@pytest.mark.world_size(2)
def test_nonfinite_step_is_skipped_and_checked_by_a_shadow_on_every_rank():
    """Rank 0's loss is infinite at step 2: every rank's shards of that step are NaN, as plain FSDP2's
    would be non-finite (the loop checks that exactly the skipped step is, and skips it as a loss scaler
    does), every rank reports it skipped and opens the same shadow window (agreed words), which keeps
    the routes."""
    out = run_ranks(_run, 2, "bq3", 5, {"inf_step": 2})
    rows = [_rows(o["stats"]) for o in out]
    assert rows[0] == rows[1]
    st = out[0]["stats"]
    assert [s.skipped for s in st] == [False, False, True, False, False]
    assert "alarm:nonfinite" in " ".join(st[2].events) and st[3].route_mix == st[1].route_mix != {"fp32": 1.0}
    assert all(torch.isfinite(o["params"]).all() for o in out)


def _scaled(rank: int, world_size: int, route: object, overflow: int, steps: int) -> dict:
    """A user's loop under `torch.amp.GradScaler`: rank 0's loss overflows at `overflow`."""
    torch.manual_seed(0)
    model = fsdpmodels.shard(fsdpmodels.Tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = nfab.attach(model, route=route, optimizer=opt, cost_model=None) if route is not None else None
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    out: dict = {"scale": [], "skipped": []}
    for step in range(steps):
        x, y = fsdpmodels.batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss * float("inf") if step == overflow and rank == 0 else loss).backward()
        out["skipped"].append(rt.step_stats().skipped if rt is not None else None)
        scaler.step(opt)
        scaler.update()
        out["scale"].append(scaler.get_scale())
    out["params"] = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    return out


@pytest.mark.world_size(2)
def test_a_loss_scaler_skips_an_overflow_as_with_plain_fsdp2():
    """A non-finite step's shards are NaN on every rank, as plain FSDP2's would be non-finite: the scaler
    skips it and halves its scale. Zeroed, they looked finite: it stepped and kept the scale."""
    plain = run_ranks(_scaled, 2, None, 3, 6)[0]
    res = run_ranks(_scaled, 2, {"linear": "bq3", "norm": "sign"}, 3, 6)
    assert plain["scale"] == [1024.0] * 3 + [512.0] * 3
    for r in res:
        assert r["scale"] == plain["scale"] and r["skipped"] == [s == 3 for s in range(6)]
        assert torch.isfinite(r["params"]).all()


def _moment(rank: int, world_size: int, scale: float) -> dict:
    """bq3 under AdamW with the noise moment; the loss scaled by `scale` (0: no scaler), told to attach."""
    torch.manual_seed(0)
    model = fsdpmodels.shard(fsdpmodels.Tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale > 0)
    rt = nfab.attach(model, route="bq3", optimizer=opt, cost_model=None, loss_scaler=scaler)
    for step in range(4):
        x, y = fsdpmodels.batch(rank, step)
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        rt.step_stats()
        scaler.step(opt)
        scaler.update()
    v = torch.cat([opt.state[p]["exp_avg_sq"].to_local().reshape(-1) for p in model.parameters()])
    return {"v": v, "moment": rt.moment.applied_steps,
            "params": torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])}


@pytest.mark.world_size(2)
def test_the_noise_moment_under_a_loss_scaler_is_the_unscaled_one():
    """The rounding variance is recorded in the scaled gradient's units (S^2 too large for v: the floor
    cancelled the correction); told the scaler, the run is the unscaled one bit for bit."""
    plain = run_ranks(_moment, 2, 0.0)
    scaled = run_ranks(_moment, 2, 65536.0)
    for a, b in zip(plain, scaled, strict=True):
        assert a["moment"] == b["moment"] == 3
        assert torch.equal(a["v"], b["v"]) and torch.equal(a["params"], b["params"])


@pytest.mark.world_size(2)
def test_bf16_reduce_dtype():
    """MixedPrecisionPolicy(reduce_dtype=bf16): route fp32 is FSDP2's own bf16 reduce-scatter (the same
    shards), its baseline counts 2 bytes per element, and every codec family (bq3, q8, sign) reduces
    the bf16 input (read as it is) and trains."""
    kw = {"reduce_dtype": torch.bfloat16}
    plain = run_ranks(_run, 2, None, 3, kw)
    fp32 = run_ranks(_run, 2, "fp32", 3, kw)
    bq3 = run_ranks(_run, 2, {"small": "bq3", "bias": "q8", "norm": "sign"}, 3, kw)
    assert torch.equal(plain[0]["params"], fp32[0]["params"])
    st = fp32[0]["stats"][-1]
    assert st.baseline_wire_bytes == st.wire_bytes - 3 * 8  # the three modules' control words aside
    layout_elements = sum(c for c in bq3[0]["stats"][-1].route_elements.values())
    assert st.baseline_wire_bytes < 4 * layout_elements  # 2 bytes each (+ FSDP2's padding), not 4
    assert set(bq3[0]["stats"][-1].route_mix) == {"bq3", "q8", "sign"} and bq3[0]["losses"][-1] < bq3[0]["losses"][0]


@pytest.mark.world_size(2)
def test_cost_gate_is_named_every_step_and_is_no_fallback():
    """A link where the extra rounds cost more than the bytes save (1 ms latency, 1 Tbit/s): the gate
    keeps every region FP32, and every step says so (`cost_gated`, reason `cost(...)`) without
    raising `fallback`, which flags safety events, as on DDP."""
    link = LinkCost(1e-3, 1e12)
    gate = CostModel("gloo", 2, link, link, reducescatter=link)
    out = run_ranks(_run, 2, {"small": "bq3", "bias": "q8", "norm": "sign"}, 2, {"health": {}, "cost_model": gate})
    for s in out[0]["stats"]:
        assert s.route_mix == {"fp32": 1.0} and s.cost_gated and not s.fallback, s
        assert s.fallback_reason.startswith("cost("), s.fallback_reason


def _refused(msgs: list[str], fn) -> None:  # noqa: ANN001
    """`fn`'s NfabError line, or "accepted", appended to `msgs`."""
    try:
        fn()
    except NfabError as e:
        msgs.append(str(e))
    else:
        msgs.append("accepted")


def _refusals(rank: int, world_size: int) -> list[str]:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    msgs: list[str] = []

    def refused(fn) -> None:  # noqa: ANN001
        _refused(msgs, fn)

    model = fsdpmodels.shard(fsdpmodels.Tiny())
    refused(lambda: nfab.attach(model, route="bf16", cost_model=None))
    refused(lambda: nfab.attach(model, route="bq3", error_feedback=True, cost_model=None))
    refused(lambda: nfab.attach(model, route="bq3", hierarchy=2, cost_model=None))
    refused(lambda: nfab.attach(model, route="q8", qsum_scale="delayed", cost_model=None))
    refused(lambda: nfab.attach(model, cost_model=None))
    refused(lambda: nfab.attach(nn.Linear(3, 3), route="bq3", cost_model=None))

    class Custom(DefaultReduceScatter):
        pass

    model.blocks[0].set_custom_reduce_scatter(Custom())
    refused(lambda: nfab.attach(model, route="bq3", cost_model=None))
    from torch.distributed.fsdp import FullyShardedDataParallel

    refused(lambda: nfab.attach(FullyShardedDataParallel(nn.Linear(4, 4), device_id=torch.device("cpu")),
                                route="bq3", cost_model=None))
    return msgs


@pytest.mark.world_size(2)
def test_attach_refuses_what_fsdp2_cannot_do_with_one_line():
    msgs = run_ranks(_refusals, 2)[0]
    assert "route bf16 is not offered on FSDP2" in msgs[0]
    assert "error_feedback=True is not offered on FSDP2" in msgs[1]
    assert "hierarchy= is not offered on FSDP2" in msgs[2]
    assert "qsum_scale='delayed' is not offered on FSDP2" in msgs[3]  # it was ignored: exact scales, in silence
    assert msgs[4] == "give exactly one of profile= or route="
    assert "DistributedDataParallel model or an FSDP2 model" in msgs[5]
    assert "already has a custom reduce-scatter (Custom" in msgs[6]
    assert "supports FSDP2 (torch.distributed.fsdp.fully_shard), not FSDP1" in msgs[7]
    assert all("\n" not in m for m in msgs)


def _refusals_at_four(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    from torch.distributed.tensor import Shard

    msgs: list[str] = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = fully_shard(fsdpmodels.Tiny(), mesh=mesh)  # HSDP: replicated on dim 0, sharded on dim 1
    models = [hsdp]
    placement = getattr(_fsdp_common, "ShardPlacementResult", None)  # per-parameter meshes: torch 2.13 on
    if placement is not None:
        pairs = _fsdp_common.FSDPMeshInfo(mesh, shard_mesh_dim=1)  # the head sharded on pairs of ranks
        model = fsdpmodels.Tiny()
        head = set(model.head.parameters())
        models.append(fully_shard(model, shard_placement_fn=lambda p: placement(Shard(0), pairs) if p in head
                                  else None))
    for m in models:
        _refused(msgs, lambda m=m: nfab.attach(m, route="bq3", cost_model=None))
    return msgs


@pytest.mark.world_size(4)
def test_attach_refuses_several_param_groups_and_hsdp_with_one_line():
    """HSDP on every torch; several param groups where torch can make them (2.13's per-parameter meshes)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    msgs = run_ranks(_refusals_at_four, 4)[0]
    assert len(msgs) == 1 + hasattr(_fsdp_common, "ShardPlacementResult")
    assert "HSDP's replicate all-reduce cannot be customised" in msgs[0]
    if len(msgs) > 1:
        assert "an FSDP2 module with several param groups" in msgs[1]
    assert all("\n" not in m for m in msgs)


def _ef_profile_warnings(rank: int, world_size: int) -> list[str]:
    import logging

    from nfab.profile.schema import Profile

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("nfab").addHandler(Keep())
    profile = Profile.static("bq3")  # as a profile (not route=): its phase carries error feedback
    for opt in (torch.optim.SGD, torch.optim.AdamW):
        model = fsdpmodels.shard(fsdpmodels.Tiny())
        nfab.attach(model, profile, cost_model=None, optimizer=opt(model.parameters(), lr=0.01))
        seen.append(f"-- after {opt.__name__}")
    return seen


@pytest.mark.world_size(2)
def test_a_profile_with_error_feedback_says_fsdp2_runs_it_without():
    """Under SGD a profile phase's error feedback runs on DDP; FSDP2 does not offer it, which went unsaid."""
    first, second = run_ranks(_ef_profile_warnings, 2)
    said = [m for m in first if "FSDP2 does not offer" in m]
    assert len(said) == 1 and first.index(said[0]) < first.index("-- after SGD")  # SGD only: AdamW has none
    assert not any("FSDP2 does not offer" in m for m in second)  # rank 0 says it
