"""FSDP2 as the installed torch offers it: the one place that asks which torch this is.

nfab's DDP path runs on torch 2.4 and later. Its FSDP2 front end replaces FSDP2's reduce-scatter
through `FSDPModule.set_custom_reduce_scatter`, which torch added in 2.9 (FSDP2 itself went public
as `torch.distributed.fsdp.fully_shard` in 2.6). Everything that names FSDP2 reaches it through
here, at call time, never at import: an older torch trains DDP as before and refuses FSDP2 with
one line that names the torch it needs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from nfab.errors import NfabError

MIN_TORCH = "2.9"
"""The first torch with `FSDPModule.set_custom_reduce_scatter`, what the front end installs through."""

_HOMES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
"""Where torch keeps `FSDPModule`: public from 2.6, under `_composable` before (2.4, 2.5)."""


def module_types() -> tuple[type, ...]:
    """Every `FSDPModule` class this torch has (empty where it has none)."""
    found: list[type] = []
    for home in _HOMES:
        try:
            cls = getattr(importlib.import_module(home), "FSDPModule", None)
        except ImportError:
            continue
        if cls is not None and cls not in found:
            found.append(cls)
    return tuple(found)


def is_fsdp2(model: object) -> bool:
    """Whether `model` was sharded by FSDP2 (`fully_shard`), on any torch that has it."""
    types = module_types()
    return bool(types) and isinstance(model, types)


def supported() -> bool:
    """Whether this torch lets nfab install its reduce-scatter on an FSDP2 module."""
    return any(hasattr(cls, "set_custom_reduce_scatter") for cls in module_types())


def unsupported(what: str = "nfab's FSDP2 front end") -> str | None:
    """The one line that says why this torch is too old for the front end, or None where it is not
    (what `require` raises, the device check records and the test suite's skips print)."""
    if supported():
        return None
    return (f"{what} needs torch >= {MIN_TORCH} (FSDPModule.set_custom_reduce_scatter); "
            f"this is torch {torch.__version__}: train with DDP, or upgrade torch")


def require(what: str = "nfab's FSDP2 front end") -> None:
    """Refuse with one line where this torch is too old for the front end."""
    why = unsupported(what)
    if why is not None:
        raise NfabError(why)


def fully_shard() -> Callable[..., Any]:
    """`torch.distributed.fsdp.fully_shard`, after `require`."""
    require()
    from torch.distributed.fsdp import fully_shard as shard

    return shard
