"""The cost gate decides alike on every rank, whatever each rank measured alone (2 real gloo ranks).

Each rank's codecs are timed on its own (here rank 1's made 10^4 times slower, as a rank whose core a
neighbour took); `measure` all-reduces every figure once (MAX), so both ranks price with the slowest
rank's figures and take the same routes, where their own figures would have disagreed.
"""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.distributed import run_ranks
from nfab.profile.schema import Profile
from nfab.wire import cost

NUMEL = 512 * 512


def _attach(rank: int, world_size: int) -> dict:
    real = cost.measure_codecs

    def local(w: int, **kw: object) -> dict[str, float]:  # rank 1: a slow core
        return {k: v * (1e4 if rank == 1 else 0.0) for k, v in real(w, reps=1, **kw).items()}

    cost.measure_codecs = local
    torch.manual_seed(0)
    ddp = DDP(nn.Linear(512, 512, bias=False))
    runtime = nfab.attach(ddp, Profile.static("sign"))  # a profile: the gate applies
    cm = runtime.controller.cost_model
    own = cost.CostModel(cm.backend, cm.world_size, cm.allreduce, cm.allgather, local(world_size),
                         reducescatter=cm.reducescatter, implausible=cm.implausible)
    regions, numels = {"weight": "linear"}, {"weight": NUMEL}
    return {"model": cm.to_json(), "gated": runtime.controller.gated_everywhere(regions, numels),
            "own_saving": cost.predicted_saving(own, "signgather", NUMEL, world_size),
            "agreed_saving": cost.predicted_saving(cm, "signgather", NUMEL, world_size)}


def test_ranks_that_measured_differently_take_the_same_gate_decision() -> None:
    r0, r1 = run_ranks(_attach, 2, timeout_s=180)
    assert r0["model"] == r1["model"]  # one all-reduce: identical figures, bit for bit
    assert r0["gated"] is r1["gated"] is True  # the slow rank's codecs price the route out on both
    assert r0["agreed_saving"] == r1["agreed_saving"] < 0
    assert r1["own_saving"] < 0  # alone, rank 1 would gate ...
    if not json.loads(r0["model"])["implausible"]:  # ... and rank 0, with free codecs, would compress
        assert r0["own_saving"] >= cost.GATE_MARGIN
