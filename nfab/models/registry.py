"""The model registry, `build_model`, user models (`module.path:factory`) and signatures."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from nfab.errors import ConfigError
from nfab.heads import default_heads
from nfab.models.gpt import gpt
from nfab.models.options import check_options
from nfab.models.resnet import resnet18
from nfab.models.spec import OPTIMIZER_FAMILIES, TASKS, ModelSpec
from nfab.models.vit import vit

MODELS: dict[str, Callable[..., ModelSpec]] = {
    "resnet18": resnet18,
    "vit": vit,
    "gpt": gpt,
}
"""Registered model families; each builder takes keyword-only options and returns a spec."""

_SPEC_INTS = ("num_classes", "image_size", "in_channels", "vocab_size", "block_size")


@contextlib.contextmanager
def _build_context(device: torch.device | str | None, seed: int | None) -> Iterator[None]:
    """Construct on `device` (`meta`: shapes only, no memory) under an optional local seed.

    The seed is applied inside `fork_rng`, so building a model never disturbs the
    caller's global RNG stream: the CPU generator's, and where the model is built on a GPU, that
    GPU's (`torch.manual_seed` would reseed every GPU's, and queue it where CUDA is not started).
    """
    with contextlib.ExitStack() as stack:
        if seed is not None:
            where = torch.device(device) if device is not None else torch.get_default_device()
            gpu = None
            if where.type == "cuda":
                gpu = where.index if where.index is not None else torch.cuda.current_device()
            stack.enter_context(torch.random.fork_rng(devices=[] if gpu is None else [gpu]))
            torch.random.default_generator.manual_seed(seed)
            if gpu is not None:
                with torch.cuda.device(gpu):
                    torch.cuda.manual_seed(seed)
        if device is not None:
            if torch.device(device).type == "meta":
                stack.enter_context(_NoRandomFillOnMeta())
            stack.enter_context(torch.device(device))
        yield


class _NoRandomFillOnMeta(TorchFunctionMode):
    """Random fills of meta tensors (`nn.init.normal_`, `Tensor.normal_`, ...) return the tensor as it is.

    A meta tensor holds no values to fill, but torch runs `normal_` on meta through its Python
    reference, whose first call imports torch._dynamo: 1.4 s of CPU in every `nfab train` parent
    that checks a model with an embedding on the meta device, against 0.01 s for the whole gpt
    build without it (2-core box, 2026-12-08). Only the random fills, which depend on no shape, are
    skipped: every other init (kaiming's fan checks among them) runs and fails as on a real device."""

    FILLS = frozenset({"normal_", "uniform_", "trunc_normal_"})

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        if getattr(func, "__name__", "") in self.FILLS and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


def build_model(
    name: str,
    *,
    device: torch.device | str | None = None,
    seed: int | None = None,
    **options: Any,
) -> ModelSpec:
    """Build a registered model (`resnet18`, `vit`, `gpt`) or a user `module.path:factory`.

    `device="meta"` builds any size in seconds with no memory. `seed` makes the
    initialisation reproducible without touching the global RNG; with `seed=None` the
    global torch RNG is used as is. Bad names, options and user factories are
    `ConfigError`s with one line.
    """
    if ":" in name:
        return _build_user_model(name, device=device, seed=seed, options=options)
    builder = MODELS.get(name)
    if builder is None:
        raise ConfigError(f"unknown model {name!r}; choose one of {sorted(MODELS)} or give module.path:factory")
    check_options(f"model {name}", builder, options)
    with _build_context(device, seed):
        return builder(**options)


def _importable_from_cwd() -> None:
    """Let `module.path:factory` name a module under the working directory, as `python -m` would:
    the `nfab` console script (and torchrun's workers) do not put it on sys.path. Appended, so an
    installed package of the same name still wins."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


LIVE: dict[str, Any] = {}
"""Python objects handed to `nfab.calibrate` that no `module.path:name` imports (a lambda, a closure, a
Dataset instance), under the `module:name` they are recorded as; `load_factory` looks here first."""


def name_for(obj: Any, kind: str) -> str:
    """The `module.path:name` that imports `obj` (so the CLI and the Python API record the same setting),
    else a name under which `LIVE` keeps it for this process."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        with contextlib.suppress(Exception):
            found: Any = importlib.import_module(module)
            for part in qualname.split("."):
                found = getattr(found, part)
            if found is obj:
                return f"{module}:{qualname}"
    label = qualname if isinstance(qualname, str) else type(obj).__name__
    name = f"{module if isinstance(module, str) else 'python'}:{label}#{kind}{len(LIVE)}"
    LIVE[name] = obj
    return name


def load_factory(target: str, what: str = "model") -> Callable[..., Any]:
    """Import `module.path:factory` (or find it in `LIVE`) and return the callable it names."""
    if target in LIVE:
        return LIVE[target]
    if "#" in target:
        raise ConfigError(f"{what} {target!r} was a Python object given to nfab.calibrate, which only that process "
                          f"holds: give a module.path:{'fn' if what == 'loss' else 'factory'} instead")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"user {what} {target!r} must look like module.path:{'fn' if what == 'loss' else 'factory'}")
    _importable_from_cwd()
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's to fix: report it in one line
        raise ConfigError(f"cannot import {module_name!r} for {what} {target!r}: {exc}") from exc
    factory: Any = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r} (the {what} {target!r})")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ConfigError(f"user {what} {target!r} is not callable")
    return factory


def _build_user_model(
    target: str,
    *,
    device: torch.device | str | None,
    seed: int | None,
    options: dict[str, Any],
) -> ModelSpec:
    """Call a user factory and describe its module from optional attributes.

    The spec's task is the `task` option, else a `task` attribute on the factory or the
    module, else "classification". `head_modules`, `optimizer` and the input facts
    (`num_classes`, `vocab_size`, `block_size`, ...) are read from attributes when present; an
    input fact is otherwise the factory option of that name.
    """
    factory = load_factory(target)
    options = dict(options)
    task_option = options.pop("task", None)
    check_options(f"user model {target}", factory, options)
    try:
        with _build_context(device, seed):
            module = factory(**options)
    except Exception as exc:  # user code: one line naming the factory and the failure
        raise ConfigError(f"user model {target!r} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(module, nn.Module):
        raise ConfigError(f"user model {target!r} returned {type(module).__name__}, not a torch.nn.Module")

    def attribute(key: str) -> Any:
        return getattr(factory, key, getattr(module, key, None))

    declared = task_option if task_option is not None else attribute("task")
    task = declared or "classification"
    if task not in TASKS:
        raise ConfigError(f"user model {target!r}: task must be one of {TASKS}, got {task!r}")
    optimizer = attribute("optimizer") or ("adamw" if task == "lm" else "sgd")
    if optimizer not in OPTIMIZER_FAMILIES:
        raise ConfigError(f"user model {target!r}: optimizer must be one of {OPTIMIZER_FAMILIES}, got {optimizer!r}")
    heads = attribute("head_modules")
    if heads is None:
        heads = default_heads(module)
    # an input fact is an attribute of the factory or module, else the option the factory was built with
    # (`vocab_size=` and `block_size=` that the data set decided, or the user passed)
    facts = {k: v for k in _SPEC_INTS
             if isinstance(v := attribute(k), int) or isinstance(v := options.get(k), int)}
    if task == "lm" and not {"vocab_size", "block_size"} <= facts.keys():
        raise ConfigError(f"user lm model {target!r} must take vocab_size and block_size (as factory options, "
                          "which the data set fills in, or as int attributes of the factory or model)")
    return ModelSpec(
        name=target,
        module=module,
        task=task,
        head_modules=tuple(heads),
        optimizer=optimizer,
        options={**options, "task": task} if declared else dict(options),
        task_declared=bool(declared),
        **facts,
    )


def parameter_layout(module: nn.Module) -> list[str]:
    """The sorted `name:d0,d1,...` lines `model_signature` hashes (a profile keeps them to name what differs)."""
    return sorted(f"{name}:{','.join(str(d) for d in p.shape)}" for name, p in module.named_parameters())


def layout_differences(expected: list[str], module: nn.Module, most: int = 3) -> str:
    """The first parameters whose names or shapes differ between a kept layout and `module`'s, in one phrase."""
    mine = dict(line.rsplit(":", 1) for line in parameter_layout(module))
    theirs = dict(line.rsplit(":", 1) for line in expected)
    diffs = []
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            here = f"({mine[name].replace(',', 'x')})" if name in mine else "absent"
            there = f"({theirs[name].replace(',', 'x')})" if name in theirs else "absent"
            diffs.append(f"{name} {here}, profile {there}")
    more = f" and {len(diffs) - most} more" if len(diffs) > most else ""
    return "; ".join(diffs[:most]) + more


def model_signature(module: nn.Module) -> str:
    """sha256 hex of the sorted `name:d0,d1,...` lines of `named_parameters`.

    A profile stores this to refuse being applied to a model it was not fitted for;
    it depends only on names and shapes, not on values, dtype or device (meta works).
    """
    lines = parameter_layout(module)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
