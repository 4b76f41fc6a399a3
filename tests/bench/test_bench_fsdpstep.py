"""`nfab bench step --parallel fsdp`: every FSDP2 variant runs on real gloo ranks (no timing assertions)."""

import pytest
import torch

from nfab.bench import fsdpstep
from nfab.bench import step as step_mod
from nfab.distributed import run_ranks
from nfab.errors import NfabError

TINY = dict(width=8, batch=4, steps=2, warmup=1, parallel="fsdp", cost_model="none")


@pytest.mark.world_size(2)
def test_every_fsdp_variant_runs_on_loopback():
    variants = ("plain", "bf16", "floor", "nfab-sign")  # nfab-fp32 and a profile: tests/fsdp, tests/train
    cfg = step_mod.BenchConfig(variants=variants, **TINY)
    doc = step_mod.report(cfg, step_mod.run(cfg), command="test")
    assert doc["parallel"] == "fsdp" and {r["variant"] for r in doc["rows"]} == set(variants)
    assert all(len(doc["times_s"][v]) == 2 for v in variants)
    assert doc["rows"][0]["description"] == "FSDP2, FP32 reduce-scatter"
    rs = doc["reduce_scatter_bytes"]
    assert rs["bf16"] == rs["fp32"] / 2
    assert doc["loss"]["bf16"] != doc["loss"]["plain"]  # the bf16 variant reduced in bf16: its weights moved otherwise
    sign = doc["nfab"]["nfab-sign"]
    assert sign["route_mix"] == {"sign": 1.0}
    assert sign["wire_bytes_per_step"] < rs["bf16"] / 4  # 2-bit counts at W=2 against 16-bit floats
    assert sign["baseline_wire_bytes_per_step"] == pytest.approx(rs["fp32"], rel=0.01)  # padding aside


def _floor(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The floor's reduce-scatter against this rank's own gradient row (FSDP2 pads dim 0 to W rows)."""
    comm = fsdpstep.LocalChunk()
    inp = torch.arange(8.0) + 10 * rank
    out = comm.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
    comm(out, inp, None, None)
    return out, inp.view(world_size, -1)[rank]


@pytest.mark.world_size(2)
def test_floor_keeps_each_ranks_own_row_and_sends_nothing():
    """A reduce-scatter would have summed both ranks' rows (rank 0's row 0 is 0..3, rank 1's 10..13)."""
    for out, own in run_ranks(_floor, 2):
        assert torch.equal(out, own)


def test_fsdp_config_errors_are_one_line():
    assert step_mod.BenchConfig(parallel="fsdp").variants == ("plain", "bf16", "floor", "nfab-profile")
    with pytest.raises(NfabError, match="parallel must be one of ddp, fsdp"):
        step_mod.BenchConfig(parallel="zero")
    with pytest.raises(NfabError, match="unknown variant"):
        step_mod.BenchConfig(parallel="fsdp", variants=("plain", "powersgd"))
    with pytest.raises(NfabError, match="one emulated node"):
        step_mod.BenchConfig(parallel="fsdp", nodes=2, link="100mbit")
