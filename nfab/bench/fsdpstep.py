"""`nfab bench step --parallel fsdp`: the step benchmark's variants under PyTorch's FSDP2.

The same side-by-side protocol as `nfab.bench.step` (interleaved steps, barrier-started, the
slowest rank's time, paired per-step ratios), with every variant a copy of one seeded model
under `fully_shard` (one unit per ResNet stage or Transformer block, then the root):

- `plain`: FSDP2 as shipped, FP32 reduce-scatter (the ratio base);
- `bf16`: FSDP2 with `MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`, half the bytes;
- `floor`: FSDP2 with a reduce-scatter that sends nothing (each rank keeps its own chunk): the
  parameter all-gathers and the compute remain, so it is what no gradient codec can beat;
- `nfab-fp32`, `nfab-sign`, `nfab-profile`, `nfab:ROUTE`: `nfab.attach` on the FSDP2 root.

Gradient bytes are the reduce-scatter's only: FSDP2's parameter all-gathers carry weights,
which nfab leaves alone, and they are the same in every variant.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import nfab
from nfab.bench import linkbytes
from nfab.bench.step import (
    ROUTE_VARIANT,
    BenchConfig,
    Run,
    _timeout,
    batches,
    nfab_info,
    slowest_rank_times,
    test_profile,
    time_runs,
)
from nfab.distributed import run_ranks
from nfab.models import build_model
from nfab.profile.schema import Profile


class LocalChunk:
    """A reduce-scatter that sends nothing: this rank's own chunk becomes its shard (the floor).

    FSDP2 calls a custom reduce-scatter (`FSDPModule.set_custom_reduce_scatter`) with the
    group's flat gradient viewed as (world_size, -1) rows; the output is this rank's row.
    """

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        rows = input_tensor.view(dist.get_world_size(group), -1)
        output_tensor.copy_(rows[dist.get_rank(group)].view_as(output_tensor))


def shard(module: nn.Module, units: tuple[str, ...], reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """`fully_shard` each unit, then the root (a bf16 `reduce_dtype` halves the reduce-scatter's bytes)."""
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    named = dict(module.named_modules())
    for name in units:
        fully_shard(named[name], mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    return module


def build_run(name: str, module: nn.Module, units: tuple[str, ...], cfg: BenchConfig) -> Run:
    """A sharded copy of `module` with variant `name`'s reduce-scatter (`Run.ddp` holds the FSDP2 root)."""
    model = shard(copy.deepcopy(module), units, torch.bfloat16 if name == "bf16" else None)
    run = Run(name, model, torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9))  # type: ignore[arg-type]
    total = cfg.warmup + cfg.steps
    cm = "measure" if cfg.cost_model == "measure" else None
    if name == "floor":
        for m in model.modules():
            if hasattr(m, "set_custom_reduce_scatter"):
                m.set_custom_reduce_scatter(LocalChunk())
    elif name in ("nfab-fp32", "nfab-sign") or name.startswith(ROUTE_VARIANT):
        route = name.removeprefix(ROUTE_VARIANT).removeprefix("nfab-")
        run.runtime = nfab.attach(model, route=route, total_steps=total, seed=cfg.seed, cost_model=cm)
    elif name == "nfab-profile":
        prof = Profile.from_dict(cfg.profile) if cfg.profile is not None else test_profile()
        run.runtime = nfab.attach(model, prof, total_steps=total, seed=cfg.seed, cost_model=cm)
    return run


def plain_reduce_scatter_bytes(module: nn.Module, world_size: int, element_size: int) -> float:
    """Bytes one rank sends per step in a ring reduce-scatter of every gradient at `element_size` bytes."""
    return (world_size - 1) / world_size * sum(p.numel() for p in module.parameters()) * element_size


def rank_main(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of `nfab bench step --parallel fsdp` (run under `run_ranks`)."""
    cfg = BenchConfig.from_dict(cfg_dict)
    spec = build_model(cfg.model, seed=cfg.seed, num_classes=10, width=cfg.width, small_input=True,
                       image_size=cfg.image_size)
    runs = [build_run(name, spec.module, spec.shard_units, cfg) for name in cfg.variants]
    data = batches(cfg, rank)
    counter = linkbytes.TxCounter("lo") if cfg.link is not None else None
    if counter is not None and linkbytes.local_rank() != 0:
        counter = linkbytes.TxCounter(None)  # one reader per node: its first rank
    time_runs(runs, data, cfg, counter)
    out: dict[str, Any] = {
        "parallel": "fsdp",
        "parameters": sum(p.numel() for p in spec.module.parameters()),
        "times_s": slowest_rank_times(runs),
        "loss": {r.name: r.loss for r in runs},
        "nfab": {r.name: info for r in runs if (info := nfab_info(r, cfg.warmup)) is not None},
        "reduce_scatter_bytes": {"fp32": plain_reduce_scatter_bytes(spec.module, world_size, 4),
                                 "bf16": plain_reduce_scatter_bytes(spec.module, world_size, 2)},
    }
    if counter is not None:
        sent = torch.tensor([float(r.link_bytes) for r in runs], dtype=torch.float64)
        dist.all_reduce(sent)
        out["wire_bytes"] = {r.name: {"measured_wire_bytes_per_step": float(sent[i]) / cfg.steps}
                             for i, r in enumerate(runs)}
    return out


def run_local(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Run the ranks on this network namespace's loopback; rank 0's result."""
    cfg = BenchConfig.from_dict(cfg_dict)
    out = run_ranks(rank_main, cfg.world_size, cfg.to_dict(), timeout_s=_timeout(cfg), pg_timeout_s=600)[0]
    out["link"] = None
    return out


def _run_local_target(payload: dict[str, Any]) -> dict[str, Any]:
    return run_local(payload)

