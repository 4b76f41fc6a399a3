"""The loss a step minimises: `loss(model, batch) -> scalar tensor`, the user's or the default.

Calibration, `nfab train` and validation all read the loss through one function of this shape, so
every objective (cross-entropy, MSE, a denoising or contrastive loss) gets the same control. A user
loss is called with the batch exactly as the loader yields it (a tuple, a dict, a Transformers
`BatchEncoding`, a bare tensor). Without one, `default_loss` follows this contract:

- a mapping (dict, `BatchEncoding`): `model(**batch)`; the output's loss, else cross-entropy of its
  logits against `batch["labels"]`;
- `(x, y)`, `forward` naming a second parameter `targets`, `target`, `labels`, `label` or `y`:
  `model(x, y)`; the output's loss (nanoGPT's `(logits, loss)`);
- `(x, y)` otherwise: `model(x)`; the output's loss, else cross-entropy of the output against `y`;
- a tensor: `model(batch)`; the output's loss (there is no target to fall back on).

The output's loss is: a 0-d tensor returned alone; the one 0-d tensor in a tuple or list (`(logits,
loss)` or `(loss, logits)`); `output["loss"]` of a mapping; `output.loss` (a Transformers
`ModelOutput`). Cross-entropy takes logits `(..., C)` against integer targets `(...)`: a classifier's
`(B, C)` against `(B,)` and a language model's `(B, T, V)` against `(B, T)` alike.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nfab.errors import ConfigError, UserCodeError

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""`loss(model, batch) -> scalar tensor`: one micro-batch's mean loss, differentiable in the model."""

TARGET_NAMES = ("targets", "target", "labels", "label", "y")
"""A `forward` whose second parameter has one of these names is given the batch's target."""


def _named(output: Any, name: str) -> torch.Tensor | None:
    """`output.name` (a ModelOutput, also a Mapping whose key may be unset) or `output[name]`, if a tensor."""
    found = getattr(output, name, None)
    if not isinstance(found, torch.Tensor) and isinstance(output, Mapping):
        found = output.get(name)
    return found if isinstance(found, torch.Tensor) else None


def _tensors(output: Any) -> list[torch.Tensor]:
    return [t for t in output if isinstance(t, torch.Tensor)] if isinstance(output, tuple | list) else []


def carried_loss(output: Any) -> torch.Tensor | None:
    """The loss a model's output carries (see the module's table), or None."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    named = _named(output, "loss")
    if named is not None:
        return named
    scalars = [t for t in _tensors(output) if t.dim() == 0]
    return scalars[0] if len(scalars) == 1 else None


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits in a model's output: the tensor itself, `output.logits` / `output["logits"]`, or the
    first tensor of more than zero dimensions in a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    named = _named(output, "logits")
    return named if named is not None else next((t for t in _tensors(output) if t.dim() > 0), None)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits `(..., C)` against integer targets `(...)`."""
    if target.is_floating_point() or logits.shape[:-1] != target.shape:
        raise ConfigError(
            f"the model's output carries no loss, and its output {tuple(logits.shape)} against the target "
            f"{tuple(target.shape)} ({target.dtype}) is not cross-entropy's (logits (..., C) against integer "
            "targets (...)): give the loss (--loss module.path:fn, or loss= in nfab.calibrate)")
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


@functools.lru_cache(maxsize=64)
def _takes_target(forward: Callable[..., Any]) -> bool:
    """Whether an unbound `forward(self, x, target, ...)` names its third positional parameter for the
    target (cached per class's function: a bound method would keep its model alive in the cache)."""
    try:
        params = [p for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 and params[2].name in TARGET_NAMES


def takes_target(model: nn.Module) -> bool:
    """Whether `model.forward` names a second parameter for the target (nanoGPT's `forward(idx, targets)`)."""
    inner = getattr(model, "module", model)  # DDP's forward takes *inputs: its module's says what it wants
    inner = inner if isinstance(inner, nn.Module) else model
    return _takes_target(type(inner).forward) if hasattr(type(inner), "forward") else False


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's own loss where its output carries one, else cross-entropy (the module's table)."""
    if isinstance(batch, Mapping):
        output = model(**batch)
        loss = carried_loss(output)
        if loss is not None:
            return loss
        logits, target = logits_of(output), batch.get("labels")
        if logits is None or not isinstance(target, torch.Tensor):
            raise ConfigError("the model's output carries no loss and the batch has no 'labels' to take "
                              "cross-entropy against: give the loss (--loss module.path:fn)")
        return cross_entropy(logits, target)
    if isinstance(batch, tuple | list) and len(batch) == 2:
        x, y = batch
        output = model(x, y) if takes_target(model) else model(x)
        loss = carried_loss(output)
        if loss is not None:
            return loss
        logits = logits_of(output)
        if logits is None or not isinstance(y, torch.Tensor):
            raise ConfigError(f"the model returned {type(output).__name__}, which carries no loss and no logits: "
                              "give the loss (--loss module.path:fn)")
        return cross_entropy(logits, y)
    output = model(batch)
    loss = carried_loss(output)
    if loss is None:
        raise ConfigError(f"a batch of {type(batch).__name__} carries no target and the model's output no loss: "
                          "give the loss (--loss module.path:fn, or loss= in nfab.calibrate)")
    return loss


def loss_name(fn: LossFn) -> str:
    """How a loss is named in messages and artifacts: `module:qualname`, or `default`."""
    if fn is default_loss:
        return "default"
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


class UserLoss:
    """A loss callable whose exceptions become one `UserCodeError` line naming it; a non-scalar or
    non-tensor result is one line too. The default loss's own `ConfigError`s pass unchanged."""

    def __init__(self, fn: LossFn, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or loss_name(fn)

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        try:
            loss = self.fn(model, batch)
        except ConfigError:
            raise
        except Exception as exc:  # user code: one line naming the function, the traceback logged by the CLI
            who = "the model's forward (under the default loss)" if self.fn is default_loss else f"loss {self.name}"
            raise UserCodeError(f"{who} raised {type(exc).__name__}: {_first_line(exc)}") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigError(f"loss {self.name} must return a scalar tensor, got {shape}")
        return loss.reshape(())


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def resolve_loss(loss: str | LossFn | None) -> UserLoss:
    """A loss given as `module.path:fn`, a callable or None (the default), wrapped as `UserLoss`."""
    if loss is None or loss == "default":
        return UserLoss(default_loss, "default")
    if callable(loss):
        return UserLoss(loss)
    from nfab.models.registry import load_factory

    return UserLoss(load_factory(loss, what="loss"), loss)


def to_device(batch: Any, device: torch.device) -> Any:
    """A batch's tensors moved to `device`, its structure kept (tuples, lists, mappings; a `BatchEncoding`
    or anything else with `.to` moves itself)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping) and not hasattr(batch, "to"):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()}) if isinstance(batch, dict) \
            else {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(v, device) for v in batch)
    if hasattr(batch, "to"):
        return batch.to(device)
    return batch


def batch_size_of(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, tuple | list) else ()
    for v in values:
        n = batch_size_of(v)
        if n:
            return n
    return 0
