"""Accelerate's FSDP2 path on CPU for the adapters' tests (importable by forked ranks).

Accelerate (1.16) never picks FSDP on CPU: `AcceleratorState` sets `DistributedType.FSDP` only in
its branch for accelerator devices (accelerate/state.py:947-977: MULTI_GPU, MLU, SDAA, MUSA, NPU,
XPU, HPU, NEURON), and `PartialState._prepare_backend` makes a process without an accelerator
MULTI_CPU (state.py:761-769), so an `fsdp_plugin` (or `ACCELERATE_USE_FSDP`, or the Trainer's
`fsdp=`) is ignored there and `prepare` builds DDP. `as_on_a_gpu_host` sets what that branch sets
on a GPU host, so that `prepare` runs Accelerate's own FSDP2 preparation (`_prepare_fsdp2` ->
`fsdp2_prepare_model`: the plugin's wrap policy, `fully_shard`, the optimizer remapped) on gloo.
"""

from __future__ import annotations

from typing import Any


def as_on_a_gpu_host(accelerator: Any, plugin: Any) -> str:
    """Make `accelerator` prepare FSDP with `plugin` as on a GPU host; returns the type it had chosen."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    chosen = str(accelerator.distributed_type)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as state.py:998 mirrors it
    return chosen
