"""FSDP2 front end: nfab's reduce-scatter against independent computations from all ranks' inputs.

Each module's comm is called on real gloo ranks with random inputs laid out as FSDP2 lays out a
param group (padding zero); the reference gathers every rank's input and computes the mean of each
rank's row another way: block routes by `BlockQSum`'s replay (the all-reduce arithmetic, the same
stratified keys), exact qsum by `QSum`'s own all-reduce of each row on the process group (each rank
its own copy of the row and its own keys), sign by a majority count in torch, FP32 slices by plain
`reduce_scatter_tensor` of the same input (bit for bit).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import fsdpmodels  # noqa: E402

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402
from nfab.profile.schema import Profile  # noqa: E402
from nfab.runtime.control.moment import replay_variance  # noqa: E402
from nfab.runtime.core import rowscatter  # noqa: E402
from nfab.runtime.frontends.fsdp_layout import codec_for, fsdp_modules, plan_layouts, step_wire_bytes  # noqa: E402
from nfab.wire import noise  # noqa: E402
from nfab.wire.blockq.scatter import BlockQScatter  # noqa: E402
from nfab.wire.contract import reduce_scatter_flat  # noqa: E402
from nfab.wire.qsum.reducer import QSum  # noqa: E402
from nfab.wire.registry import REDUCERS  # noqa: E402
from nfab.wire.sign.scatter import SignScatter  # noqa: E402

MIXED = {"blocks.0.fc.*": "bq3", "head.*": "sign", "bias": "bq2", "inp.weight": "q8",
         "blocks.1.fc.weight": "q4"}  # the rest (norms) fp32


def _reference(rt, comm, group_slices, key: str, xs: list[torch.Tensor], rank: int, step: int) -> torch.Tensor:
    """This rank's row of the group's mean, from all ranks' inputs, computed without the comm's path."""
    w, lay = rt.world_size, comm.layout
    codec = codec_for(REDUCERS[key].route)
    numel = sum(s.numel for s in group_slices)
    padded = rowscatter.padded_row(codec, numel, w) if isinstance(codec, SignScatter) else numel
    rows = []
    for x in xs:
        r = torch.zeros(w, padded)
        r[:, :numel] = torch.cat([x.view(w, lay.chunk)[:, s.offset : s.offset + s.numel] for s in group_slices], 1)
        rows.append(r)
    names = tuple(s.name for s in group_slices)
    segments = comm.segments(names, padded)
    lengths = [n for seg in segments for n in seg]
    if isinstance(codec, QSum):  # every row through QSum's all-reduce: mine is the row this rank owns
        seeds = rt._seeds(comm, names, padded, rank)  # this rank's keys for every row, as the comm draws them
        means, first = [], 0
        for r in range(w):
            means.append(codec.reduce(rows[rank][r], segments[r], dist.group.WORLD,
                                      noise.Seeds(seeds[first : first + len(segments[r])])))
            first += len(segments[r])
        return means[rank]
    if isinstance(codec, BlockQScatter):
        keys = noise.seeded_keys(rt._seeds(comm, names, padded))
        plain = REDUCERS[f"blockq-{codec.route}"]  # the all-reduce reducer's replay
        mean = plain.replay_mean([r.reshape(-1) for r in rows], lengths, noise.stratified(keys, w))
        return mean.view(w, padded)[rank, :numel]
    stacked = torch.stack([r[rank] for r in rows])  # (W ranks, padded): every rank's copy of my row
    # a vote: x > 0; an exact zero (FSDP2's padding too) positive on rank r when r + step is even
    positive = sum(((row > 0) | ((row == 0) & ((r + step) % 2 == 0))).to(torch.int64) for r, row in enumerate(stacked))
    unit = torch.where(positive * 2 > w, 1.0, torch.where(positive * 2 < w, -1.0, 0.0))
    seg = segments[rank]
    scale = torch.zeros(len(seg))
    for r in rows:
        scale += torch.stack([p.abs().mean() for p in r[rank].split(seg)])
    scale /= w
    return (unit * torch.repeat_interleave(scale, torch.tensor(seg)))[:numel]


def _exact(rank: int, world_size: int, route, op_name: str) -> list[str]:
    torch.manual_seed(0)
    model = fsdpmodels.shard(fsdpmodels.Tiny())
    moment = route == "bq3"  # and the rounding variance each rank records for its shard of Adam's v
    opt = torch.optim.AdamW(model.parameters()) if moment else None
    rt = nfab.attach(model, route=route, cost_model=None, optimizer=opt, noise_moment=moment)
    assert (rt.moment is not None) == moment
    op = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM,
          "premul": dist._make_nccl_premul_sum(0.25)}.get(op_name)  # set_gradient_divide_factor(4)
    if op_name == "premul":  # as FSDP2 does: the op comes from the divide factor (torch 2.11's op hides it)
        for m in fsdp_modules(model):
            m.set_gradient_divide_factor(4.0)
    factor = {"avg": 1.0, "sum": float(world_size), "premul": world_size * 0.25}[op_name]
    checked = []
    for step in range(2):
        for comm in rt.comms:
            lay = comm.layout
            x = fsdpmodels.grad_input(lay, rank, step)
            xs = [torch.empty_like(x) for _ in range(world_size)]
            dist.all_gather(xs, x)
            out = torch.empty(lay.chunk)
            routes = rt.controller.routes(comm.plan, rt.controller.phase(rt.step), rt.health.demoted())
            rt.reduce_scatter(comm, out, x.clone(), dist.group.WORLD, op)
            plain = torch.empty(lay.chunk)
            if op_name == "premul":  # PREMUL_SUM(f) is x * f summed (gloo has no PREMUL_SUM)
                reduce_scatter_flat(plain, x * 0.25, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
            else:
                reduce_scatter_flat(plain, x.clone(), op=op, group=dist.group.WORLD)
            for g in routes.groups:
                got = torch.cat([out[s.offset : s.offset + s.numel] for s in g.slices])
                if g.key == "allreduce-fp32":
                    want = torch.cat([plain[s.offset : s.offset + s.numel] for s in g.slices])
                else:
                    want = _reference(rt, comm, g.slices, g.key, xs, rank, step) * factor
                if g.key.startswith("sign"):  # the votes exactly; the scale's float sum in another order
                    assert torch.equal(torch.sign(got), torch.sign(want)), g.key
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
                else:
                    assert torch.equal(got, want), (g.key, (got - want).abs().max())
                checked.append(g.key)
                for s in g.slices if moment else ():  # from all ranks' inputs: their codes' variance
                    real = lay.by_name()[s.name].real(rank)
                    mine = [x.view(world_size, lay.chunk)[rank, s.offset : s.offset + real] for x in xs]
                    want_var = replay_variance(REDUCERS[g.key], mine, [real], None)
                    assert torch.equal(rt.moment._pending[s.name], want_var), s.name
        st = rt.step_stats()
        # what inspect counts without a process group is what the runtime sent (probes aside: step 0's
        # probe sums ride this step's first word)
        counted = step_wire_bytes([c.layout for c in rt.comms], Profile.static(route))
        assert st.probe_wire_bytes > 0 and int(counted.nfab) == st.wire_bytes - st.probe_wire_bytes, (counted, st)
        assert counted.route_elements == st.route_elements
    bare = fsdpmodels.Tiny()
    planned = plan_layouts(bare, list(bare.blocks), world_size)
    assert sorted(planned, key=str) == sorted((c.layout for c in rt.comms), key=str)
    return checked


@pytest.mark.world_size(2)
@pytest.mark.parametrize(("route", "op"), [("bq3", "avg"), ("sign", "sum"), ("q2", "sum"), (MIXED, "premul")])
def test_reduce_scatter_matches_independent_reference(route, op):
    """q2 on every region: the root's row (171 elements at W=2) is no whole number of 4-lane bytes,
    so each row is packed on its own; the blocks' rows (324) are packed as one input."""
    checked = run_ranks(_exact, 2, route, op)
    assert checked[0] == checked[1] and checked[0]
    keys = set(checked[0])
    if isinstance(route, dict):
        assert {"allreduce-fp32", "qsum-q8", "qsum-q4"} < keys and any(k.startswith("blockq") for k in keys), keys
        assert any(k.startswith("sign") for k in keys), keys
    if route == "q2":
        assert keys == {"qsum-q2"}, keys


@pytest.mark.world_size(4)
def test_reduce_scatter_exact_at_four_ranks():
    checked = run_ranks(_exact, 4, MIXED, "avg")
    assert all(c == checked[0] for c in checked)
