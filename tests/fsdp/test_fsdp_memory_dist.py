"""FSDP2 front end's extra memory per rank at reduce time, measured with allocation trackers.

How: each comm call runs under `torch.profiler` with `profile_memory=True` (every torch CPU
allocation and free, time-stamped: the running sum's peak is the call's peak extra torch memory)
and `tracemalloc` (numpy's buffers, which the compiled codecs allocate, and Python's objects: its
peak). Their sum bounds the call's peak extra memory from above; the target is at most one param
group's flat gradient (the reduce-scatter input) per call.
"""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import fsdpmodels  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter  # noqa: E402, I001

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402
from nfab.runtime.frontends.fsdp import NfabReduceScatter  # noqa: E402


class Tracker:
    """Each reduce-scatter call's peak memory, recorded with its input's bytes."""

    peaks: list[tuple[str, int, int]] = []
    python_side = False
    """False: torch's allocations (profiler); True: numpy's and Python's (tracemalloc, no profiler)."""

    @classmethod
    def call(cls, comm_call, output_tensor, input_tensor, group, op):  # noqa: ANN001, ANN206
        size = input_tensor.numel() * input_tensor.element_size()
        if cls.python_side:
            tracemalloc.start()
            out = comm_call(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op)
            cls.peaks.append(("numpy+python", tracemalloc.get_traced_memory()[1], size))
            tracemalloc.stop()
            return out
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = comm_call(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op)
        records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]")
        running, peak = 0, 0
        for _, n in records:
            running += n
            peak = max(peak, running)
        cls.peaks.append(("torch", peak, size))
        return out


class Tracked(NfabReduceScatter):
    """nfab's comm, tracked."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN204
        return Tracker.call(super().__call__, output_tensor, input_tensor, group, op)


class TrackedPlain(DefaultReduceScatter):
    """Plain FSDP2's comm, tracked: gloo's reduce-scatter allocates too (the base nfab adds to)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN204
        return Tracker.call(super().__call__, output_tensor, input_tensor, group, op)


def _measure(rank: int, world_size: int, route) -> list[tuple[int, int]]:
    torch.manual_seed(0)
    model = fsdpmodels.shard(fsdpmodels.Tiny(d=128))
    if route is None:
        for module in (model, *model.blocks):
            module.set_custom_reduce_scatter(TrackedPlain())
    else:
        for comm in nfab.attach(model, route=route, cost_model=None).comms:
            comm.__class__ = Tracked
    for step in range(3):  # the first step fills nfab's caches; then torch's side, then numpy's
        Tracker.python_side = step == 2
        x, y = fsdpmodels.batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return Tracker.peaks


@pytest.mark.world_size(2)
def test_extra_memory_per_call_is_at_most_one_flat_gradient():
    """bq3, sign and q8 on every region, W=2: each block's reduce-scatter's peak memory (torch's
    peak, measured in one step, plus numpy's and Python's, in the next: an upper bound) exceeds plain
    FSDP2's (gloo's reduce-scatter allocates a copy of the input) by at most its input's bytes. The
    root's group (a few KiB) is left out: Python's own objects (~10 KiB) dominate there."""
    def peaks(route) -> list[tuple[int, int]]:  # noqa: ANN001
        got = run_ranks(_measure, 2, route)[0][3:]  # steps 1 and 2: three modules each
        torch_side, python_side = got[:3], got[3:]
        return [(t + p, size) for (_, t, size), (_, p, _) in zip(torch_side, python_side, strict=True)
                if size >= 64 << 10]

    plain = peaks(None)
    assert len(plain) == 2
    for route in ("bq3", "sign", "q8"):
        extra = [(total - base) / size for (total, size), (base, _) in zip(peaks(route), plain, strict=True)]
        print(route, "extra peak / input per block:", [round(e, 3) for e in extra])
        assert len(extra) == 2 and max(extra) <= 1.0, (route, extra)
