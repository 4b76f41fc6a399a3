"""The data-parallel wrapper a run trains under (`parallel: ddp | fsdp`), behind one small interface.

The loop needs six things from its wrapper, and DDP and FSDP2 answer each differently:

| need | DDP | FSDP2 (`fully_shard` per block, then the root) |
| --- | --- | --- |
| accumulate without communicating | `ddp.no_sync()` | `set_requires_gradient_sync(False)` |
| the process group (cost model) | `ddp.process_group` | the default group |
| checkpoint the model / optimizer | `state_dict()` | full state dicts gathered to rank 0 (DCP's `get_*_state_dict`) |
| resume the optimizer | `load_state_dict` | `set_optimizer_state_dict(full_state_dict=True)` |
| the FP32 step's gradient norm | local gradients (replicated) | local shards' squares summed across ranks |
| plain communication bytes | ring all-reduce, 2(W-1)/W of the gradients | ring reduce-scatter, (W-1)/W |

Checkpoints under FSDP hold the same full, unsharded model state as under DDP (rank 0
writes it; torch.distributed.checkpoint's full state dict, offloaded to the CPU), so one
`state.pt` reads the same way, is resumed by loading it into the unsharded model before
`fully_shard`, and needs no shared disk. The optimizer's full state is keyed by parameter
name (DDP's by index), so a run resumes under the wrapper it was written under.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nfab.models.spec import ModelSpec
from nfab.runtime.frontends import fsdp2

Parallel = Literal["ddp", "fsdp"]


def _dcp_state_dict() -> Any:
    """torch.distributed.checkpoint's state_dict helpers, imported by the FSDP paths only: the import
    pulls in DTensor's op tables and sympy, about 1 s of CPU per process (measured on the 2-core box,
    2026-12-08) that DDP ranks and `nfab train`'s parent, which imports this module, never use."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _full() -> Any:
    """Full state dicts, offloaded to the CPU (rank 0 gathers them)."""
    return _dcp_state_dict().StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass(slots=True)
class Wrapped:
    """A model wrapped for data-parallel training: `model` is what the loop calls and nfab attaches to."""

    parallel: Parallel
    model: nn.Module
    """The DDP model, or the FSDP2 root (the built module itself, sharded in place)."""
    module: nn.Module
    """The user's module (under FSDP the same object as `model`)."""

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group gradients are reduced over (None: the default group)."""
        return self.model.process_group if isinstance(self.model, DistributedDataParallel) else None

    @contextlib.contextmanager
    def sync(self, last: bool) -> Iterator[None]:
        """Communicate gradients on the last micro-batch only (accumulate locally before it)."""
        if isinstance(self.model, DistributedDataParallel):
            with contextlib.nullcontext() if last else self.model.no_sync():
                yield
            return
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
        yield

    def model_state(self) -> dict[str, Any]:
        """The full model state (a collective under FSDP; rank 0 gets it, the others an empty dict)."""
        if self.parallel == "ddp":
            return self.module.state_dict()
        return _dcp_state_dict().get_model_state_dict(self.module, options=_full())

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state (a collective under FSDP; rank 0 gets it, keyed by parameter name)."""
        if self.parallel == "ddp":
            return optimizer.state_dict()
        return _dcp_state_dict().get_optimizer_state_dict(self.module, optimizer, options=_full())

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what `optimizer_state` wrote (every rank holds the full state; each keeps its shard)."""
        if self.parallel == "ddp":
            optimizer.load_state_dict(state)
            return
        dcp = _dcp_state_dict()
        dcp.set_optimizer_state_dict(self.module, optimizer, state, options=dcp.StateDictOptions(full_state_dict=True))

    def grad_norm(self, device: torch.device) -> float:
        """The reduced gradient's global L2 norm, the same float on every rank."""
        squares = [_local(p.grad).detach().double().norm() ** 2 for p in self.module.parameters()
                   if p.grad is not None]
        total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
        if self.parallel == "fsdp":  # each rank holds one shard of every gradient
            total = total.to(device)
            dist.all_reduce(total)
        return float(total.sqrt())

    def baseline_wire_bytes(self, world_size: int) -> int:
        """Bytes one rank sends per step in the plain wrapper's gradient collective (see `plain_wire_bytes`)."""
        return plain_wire_bytes(self.module, world_size, self.parallel)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's gradients), any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def plain_wire_bytes(module: nn.Module, world_size: int, parallel: Parallel) -> int:
    """Bytes one rank sends per step in the plain collective over all trainable gradients, each in
    its own dtype: DDP's ring all-reduce moves 2(W-1)/W of them, FSDP2's ring reduce-scatter (W-1)/W
    (its parameter all-gathers carry weights, not gradients, and nfab leaves them alone)."""
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    passes = 2 if parallel == "ddp" else 1
    return int(round(passes * (world_size - 1) / world_size * nbytes))


def shard_per_block(spec: ModelSpec) -> nn.Module:
    """`fully_shard` each of the spec's shard units (a Transformer's blocks), then the root; returns the root.

    One unit per block lets FSDP2 gather one block's parameters at a time and reduce-scatter a
    block's gradients while the backward runs on; the root takes what is left (embeddings,
    final norm, head). A model without units (a CNN, a user's factory) is sharded as one unit.
    """
    fully_shard = fsdp2.fully_shard()
    units = dict(spec.module.named_modules())
    for name in spec.shard_units:
        fully_shard(units[name])
    fully_shard(spec.module)
    return spec.module


def wrap(spec: ModelSpec, parallel: Parallel, device: torch.device, bucket_cap_mb: float) -> Wrapped:
    """Wrap `spec.module` (already on `device`, with any resumed weights loaded) for training."""
    if parallel == "fsdp":
        return Wrapped("fsdp", shard_per_block(spec), spec.module)
    ddp = DistributedDataParallel(spec.module, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=bucket_cap_mb)
    return Wrapped("ddp", ddp, spec.module)
