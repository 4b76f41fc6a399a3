"""`nfab.attach(model, "auto")` on real gloo ranks: in-run calibration's windows, fit, agreement and resume.

Checked against independent computations: the samples a window keeps are every rank's own gradient
at the sampled positions (each rank's gradient computed again outside DDP and all-gathered by a plain
collective), the profile the run adopts is what `fit_profile` makes of the table it wrote, every rank
adopts the same routes, replicas stay bit-identical after every step, and a run killed mid-window and
resumed from its state ends bit-equal to the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.calibrate.fit import fit_profile
from nfab.calibrate.inrun import CANDIDATES
from nfab.calibrate.table import read_table
from nfab.distributed import run_ranks
from nfab.errors import NfabError
from nfab.profile.schema import Profile
from nfab.runtime.control.window import (
    CHUNK,
    SAMPLE,
    Schedule,
    profile_codes,
    region_sample,
    sample_layout,
    schedule,
)

STEPS = 24
WINDOW = 3
VOCAB, DIM = 64, 32


class TinyLM(nn.Module):
    """Embedding, norm + linear blocks, a head: the region classes of a language model."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                   nn.Linear(4 * dim, dim)) for _ in range(2)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (8, 16), generator=g)
    return x, (x * 7 + 3) % VOCAB  # a learnable map


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def setup(out: str | None, *, meta: bool = False, fsdp: bool = False, **kw):
    """Model, optimizer and the "auto" runtime (attached under the meta default device when `meta`; to an
    FSDP2 model, every block and the root sharded, when `fsdp`)."""
    torch.manual_seed(0)
    model = fully_sharded(TinyLM()) if fsdp else DDP(TinyLM(), bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.device("meta") if meta else contextlib.nullcontext():
        rt = nfab.attach(model, "auto", optimizer=opt, total_steps=STEPS, calibration_window=WINDOW,
                         calibration_out=out, cost_model=None, **kw)
    return model, opt, rt


def fully_sharded(model: TinyLM) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b)
    return fully_shard(model)


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole (an FSDP2 DTensor gathered), in the model's order."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def unwrapped(model: nn.Module) -> nn.Module:
    """A plain copy of the model with its whole weights: what computes a rank's own gradient again."""
    twin = TinyLM()
    with torch.no_grad():
        for t, p in zip(twin.parameters(), full_params(model), strict=True):
            t.copy_(p)
    return twin


def train(model, opt, rt, rank: int, steps: range, *, reference: list | None = None) -> list[bool]:
    """Train `steps`; with `reference`, also keep every rank's own gradient (computed again outside DDP,
    gathered by a plain all_gather) at each window step. Returns per step whether replicas are equal."""
    equal = []
    for step in steps:
        x, y = batch(rank, step)
        if reference is not None and rt.window.measuring(step):
            twin = unwrapped(model)
            grads = torch.autograd.grad(loss_of(twin, x, y), list(twin.parameters()))
            flat = torch.cat([g.reshape(-1) for g in grads])
            out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
            dist.all_gather(out, flat)
            reference.append(torch.stack(out))
        loss = loss_of(model, x, y)
        rt.observe_loss(loss)
        loss.backward()
        rt.step_stats()
        opt.step()
        opt.zero_grad()
        flat = torch.cat([p.reshape(-1) for p in full_params(model)])
        lo, hi = flat.clone(), flat.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        equal.append(bool(torch.equal(lo, hi)))
    return equal


def _run(rank: int, world_size: int, out: str, fsdp: bool = False) -> dict:
    model, opt, rt = setup(out, fsdp=fsdp)
    reference: list[torch.Tensor] = []
    equal = train(model, opt, rt, rank, range(STEPS), reference=reference)
    # the samples each window kept, against every rank's own gradient at the sampled positions
    offsets, at = {}, 0
    for n, p in TinyLM().named_parameters():
        offsets[n] = at
        at += p.numel()
    cols = torch.cat([s.positions + offsets[s.name] for s in rt.window.layout])
    kept = [s for w in rt.window.windows for s in w.steps]
    samples_match = len(kept) == len(reference) and all(
        torch.equal(k, ref.index_select(1, cols)) for k, ref in zip(kept, reference, strict=True))
    return {"equal": equal, "samples_match": samples_match, "windows": [w.start for w in rt.window.windows],
            "codes": profile_codes(rt.profile), "routes": {p.name: p.routes for p in rt.profile.phases},
            "calibrating": [s.calibrating for s in rt.history],
            "window_bytes": [s.calibration_wire_bytes for s in rt.history],
            "mix": [s.route_mix for s in rt.history]}


@pytest.mark.world_size(2)
def test_auto_calibrates_inside_the_run_and_every_rank_adopts_the_same_profile(tmp_path: Path):
    res = run_ranks(_run, 2, str(tmp_path), timeout_s=300)
    sched = schedule(STEPS, WINDOW)
    for r in res:
        assert all(r["equal"]), r["equal"]  # replicas bit-identical after every step
        assert r["samples_match"]  # the windows kept each rank's own gradient, as a plain all_gather has it
        assert r["windows"] == list(sched.starts) and len(r["windows"]) == 3
        assert r["calibrating"] == [sched.index(s) is not None for s in range(STEPS)]
        assert all((b > 0) == c for b, c in zip(r["window_bytes"], r["calibrating"], strict=True))
        assert set(r["mix"][0]) <= {"bf16", "fp32"}  # the first window sends the safe route
    assert res[0]["codes"] == res[1]["codes"]  # one decision
    assert len(res[0]["routes"]) == 3  # a phase per window
    assert any(route not in ("fp32", "bf16") for routes in res[0]["routes"].values() for route in routes.values())
    assert any(set(m) - {"fp32", "bf16"} for m in res[0]["mix"][WINDOW:]), "the fitted profile never compressed"
    # what the run wrote: a calibration table that refits to the profile the run ended on
    frame, meta = read_table(tmp_path / "calibration.parquet")
    assert set(frame["route"]) == set(CANDIDATES) and set(frame["phase"]) == set(res[0]["routes"])
    written = Profile.load(tmp_path / "profile.json")
    refit = fit_profile(frame, meta=meta)
    assert [p.routes for p in refit.phases] == [p.routes for p in written.phases]
    assert {p.name: p.routes for p in written.phases} == res[0]["routes"]
    assert meta["world_size"] == 2 and meta["in_run"]["windows"] == list(sched.starts)
    assert json.loads((tmp_path / "profile.json").read_text())["evidence"]["validation"]["passed"] is None


@pytest.mark.fsdp2
@pytest.mark.world_size(2)
def test_auto_on_fsdp2_gathers_each_modules_samples_and_adopts_one_profile(tmp_path: Path):
    res = run_ranks(_run, 2, str(tmp_path), True, timeout_s=300)
    for r in res:
        assert all(r["equal"]) and r["samples_match"], r
        assert set(r["mix"][0]) == {"fp32"}  # FSDP2's first window sends FP32 (its reduce-scatter has no bf16)
        assert all((b > 0) == c for b, c in zip(r["window_bytes"], r["calibrating"], strict=True))
    assert res[0]["codes"] == res[1]["codes"]
    assert any(set(m) - {"fp32"} for m in res[0]["mix"][WINDOW:]), "the fitted profile never compressed"
    assert Profile.load(tmp_path / "profile.json").phases


def _meta(rank: int, world_size: int, meta: bool) -> dict:
    """The run of `_run`, with attach, every hook body and every callback (the window's sampling, gather,
    fit and agreement among them) under the meta default device when `meta`."""
    sys.path.insert(0, str(Path(__file__).parent))
    import twins

    model, opt, rt = setup(None, meta=meta)
    if meta:
        rt.__class__ = twins.DefaultDeviceMeta
    train(model, opt, rt, rank, range(STEPS))
    return {"params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "mix": [s.route_mix for s in rt.history], "codes": profile_codes(rt.profile)}


@pytest.mark.world_size(2)
def test_auto_under_the_meta_default_device_gives_the_same_bits():
    normal = run_ranks(_meta, 2, False, timeout_s=300)
    meta = run_ranks(_meta, 2, True, timeout_s=300)
    for a, b in zip(normal, meta, strict=True):
        assert torch.equal(a["params"], b["params"]) and a["mix"] == b["mix"] and a["codes"] == b["codes"]


def _resume(rank: int, world_size: int, cut: int, fsdp: bool = False) -> dict:
    model, opt, rt = setup(None, fsdp=fsdp)
    train(model, opt, rt, rank, range(STEPS))
    whole = torch.cat([p.reshape(-1) for p in full_params(model)])
    # the same run killed after step `cut` (mid-window) and resumed from its state in fresh objects
    model, opt, rt = setup(None, fsdp=fsdp)
    train(model, opt, rt, rank, range(cut))
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "nfab": rt.state_dict()})
    del model, opt, rt
    model, opt, rt = setup(None, fsdp=fsdp)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    rt.load_state_dict(state["nfab"])
    train(model, opt, rt, rank, range(cut, STEPS))
    resumed = torch.cat([p.reshape(-1) for p in full_params(model)])
    return {"equal": bool(torch.equal(whole, resumed)), "codes": profile_codes(rt.profile)}


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("cut", "fsdp"), [(1, False), (WINDOW, False), (9, False),
                                           pytest.param(9, True, marks=pytest.mark.fsdp2)])
def test_a_run_killed_mid_window_or_after_it_resumes_bit_equal(cut: int, fsdp: bool):
    """`cut` steps done: inside the first window, at its end (the fitted profile not yet agreed), inside
    the second (whose start is 8)."""
    assert schedule(STEPS, WINDOW).index(cut - 1) is not None or cut == WINDOW
    res = run_ranks(_resume, 2, cut, fsdp, timeout_s=300)
    assert all(r["equal"] for r in res), res
    assert res[0]["codes"] == res[1]["codes"]


def test_the_schedule_keeps_windows_apart_and_inside_the_run():
    assert schedule(300) == Schedule((0, 100, 200), 6)
    assert schedule(None) == Schedule((0,), 8)
    assert schedule(10, 4) == Schedule((0,), 4)  # the later windows would overlap: one window
    assert sum(schedule(300).length for _ in schedule(300).starts) / 300 <= 0.1  # the window budget


def test_the_sample_is_whole_chunks_at_the_same_positions_for_every_seed_draw():
    params = [("a", "linear", 100_000), ("b", "linear", 30_000), ("n", "norm", 64)]
    one, two = sample_layout(params, 0), sample_layout(params, 0)
    assert all(torch.equal(x.positions, y.positions) for x, y in zip(one, two, strict=True))
    assert not torch.equal(one[0].positions, sample_layout(params, 1)[0].positions)
    a = one[0].positions
    assert a.numel() % CHUNK == 0 and bool((a.view(-1, CHUNK)[:, 0] % CHUNK == 0).all())
    assert one[2].positions.tolist() == list(range(64))  # a small region is sampled whole
    assert 6_000 <= sum(s.positions.numel() for s in one[:2]) <= 10_000  # 1/16 of 130k elements
    big = sample_layout([("w", "linear", 10_000_000)], 0)
    assert big[0].positions.numel() == SAMPLE  # a big region's sample is SAMPLE, whatever its size
    assert region_sample(3000) == 2048 and region_sample(1000) == 1000 and region_sample(100_000) == 6250


def _refused(rank: int, world_size: int) -> list[str]:
    model = DDP(TinyLM())
    lines = []
    for kw in ({"route": "bq2"}, {"hierarchy": 2}):
        try:
            nfab.attach(model, "auto", **kw)
        except NfabError as exc:
            lines.append(str(exc))
    return lines


@pytest.mark.world_size(2)
def test_auto_refuses_what_it_cannot_calibrate_in_one_line():
    lines = run_ranks(_refused, 2, timeout_s=120)[0]
    assert len(lines) == 2 and "not both" in lines[0] and "hierarchy" in lines[1]


def _sibling(rank: int, world_size: int, profile_path: str) -> dict:
    """A profile calibrated inside a run of the small model, attached to a wider sibling."""
    out: dict = {}
    for sibling in (False, True):
        torch.manual_seed(0)
        model = DDP(TinyLM(dim=2 * DIM))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        try:
            rt = nfab.attach(model, profile_path, optimizer=opt, total_steps=STEPS, cost_model=None, sibling=sibling)
        except NfabError as exc:
            out[sibling] = str(exc)
            continue
        x, y = batch(rank, 0)
        loss_of(model, x, y).backward()
        out[sibling] = rt.step_stats().route_mix
    return out


@pytest.mark.world_size(2)
def test_a_small_siblings_profile_attaches_to_the_big_model_only_when_asked(tmp_path: Path):
    run_ranks(_run, 2, str(tmp_path), timeout_s=300)  # the small model calibrates inside its run
    res = run_ranks(_sibling, 2, str(tmp_path / "profile.json"), timeout_s=300)[0]
    assert "another parameter layout" in res[False] and "blocks.0.0.weight (64), profile (32)" in res[False]
    assert isinstance(res[True], dict) and set(res[True]) - {"fp32"}, res[True]  # opted in: the routes carry over
