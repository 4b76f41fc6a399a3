"""nfab in Accelerate: attach nfab's hook to the DDP model `accelerator.prepare` returned.

Accelerate's `DistributedDataParallelKwargs(comm_hook=...)` accepts only its own built-in
hooks, so nfab registers on the prepared model directly, exactly as `nfab.attach` does in a
plain loop. Call it once, after `prepare` and before the first backward, on every process.

It also registers nfab's state for Accelerate's checkpoints (`register_for_checkpointing`):
`accelerator.save_state(dir)` stores every rank's state (error-feedback residuals are per
rank; `nfab.integrations.state.RankStates`) and `accelerator.load_state(dir)` restores each
rank's own, as every process calls both.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

try:
    from accelerate import Accelerator
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("nfab.integrations.accelerate needs Accelerate: pip install 'nfab[accelerate]'") from e
import torch
from torch.nn.parallel import DistributedDataParallel

from nfab.config.attach import AttachConfig
from nfab.errors import NfabError
from nfab.profile.schema import Profile
from nfab.runtime.frontends import fsdp2
from nfab.runtime.frontends.ddp import Runtime

log = logging.getLogger(__name__)


def attach(
    accelerator: Accelerator,
    prepared_model: torch.nn.Module,
    profile: str | Path | Profile | None = None,
    route: str | dict[str, str] | None = None,
    *,
    config: AttachConfig | None = None,
    **options: Any,
) -> Runtime | None:
    """Register nfab's hook on `prepared_model` and return its Runtime; None on a single process.

    `profile` / `route` and the options (`config=`, an `AttachConfig`, and/or `nfab.attach`'s keyword
    options: `total_steps=`, `cost_model=`, ...; validated here) go to `nfab.attach` untouched. One
    process has no gradients to exchange, so there is nothing to compress: this logs one line and
    returns None, and the same script runs unchanged with
    `accelerate launch --num_processes 1`. With several processes `prepared_model` must be
    the DDP model Accelerate built, or the FSDP2 model its FSDP plugin built
    (`FullyShardedDataParallelPlugin(fsdp_version=2)`; Accelerate builds FSDP only on accelerator
    devices, `accelerate/state.py:947-977`, and DDP on CPU: docs/integrations.md); DeepSpeed owns
    its communication.
    """
    from nfab.integrations.defaults import adapter_config, attach_with_defaults
    from nfab.integrations.state import RankStates

    cfg = adapter_config(config, route, options)
    if (profile is None) == (cfg.route is None):
        raise NfabError("give exactly one of profile= or route=")
    if accelerator.num_processes == 1:
        log.info("nfab: one process, no gradient communication to compress; training without nfab")
        return None
    if not (isinstance(prepared_model, DistributedDataParallel) or fsdp2.is_fsdp2(prepared_model)):
        raise NfabError(
            f"nfab needs the DistributedDataParallel or FSDP2 model from accelerator.prepare, got "
            f"{type(prepared_model).__name__} (distributed type {accelerator.distributed_type})"
        )
    # fp16: the gradients carry the scaler's scale (nfab.attach); the user's own options win
    runtime = attach_with_defaults(prepared_model, profile, cfg, total_steps=None,
                                   loss_scaler=getattr(accelerator, "scaler", None))
    accelerator.register_for_checkpointing(RankStates(runtime))
    return runtime
