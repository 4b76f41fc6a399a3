"""What the hook learns from the user's optimizer: its family, and Adam's preconditioner.

Two uses, both from `attach(..., optimizer=opt)`:

- `error_feedback="auto"` (the default) turns error feedback on only for non-adaptive
  optimizers. Under Adam-style optimizers the residuals it re-injects are divided by each
  coordinate's own RMS, so small coordinates receive amplified stale mass: on the held-out
  GPT, sign + error feedback under AdamW ended at +56% validation loss, without it +7.8%.
- Block-scaled qsum quantizes where the optimizer acts: each gradient coordinate is divided
  by sqrt(v_i) + eps before it is rounded against its block's scale, and the decoded mean is
  multiplied back (`Preconditioner.quantization_scale`). A block's coordinates differ in RMS
  by orders of magnitude; in the preconditioned space they are all O(1), so the block scale
  fits every coordinate and the rounding noise lands on each in proportion to Adam's own
  step denominator. On the held-out GPT (simulation, W=4) it took 4-level bq from +1.7%
  to within FP32's run-to-run spread, at the same bytes.
- The health monitor measures fidelity where the optimizer acts: Adam moves coordinate i
  by about g_i / (sqrt(v_i) + eps), so a probe's low-bit and FP32 results are compared
  after that division (`Preconditioner.inverse_rms`). A sign route whose error sits on the
  small-RMS coordinates looks fine in plain cosine and poor here.

Every rank holds the same optimizer state bit for bit (DDP replicas step on identical
reduced gradients), so a decision computed from it is rank-consistent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

ERROR_FEEDBACK_CHOICES = ("auto", True, False)
PRECONDITION_FLOOR = 0.01
"""`Preconditioner.quantization_scale` never goes below this fraction of the parameter's mean."""

_ADAPTIVE_TYPES: tuple[type, ...] = tuple(
    t for t in (getattr(torch.optim, n, None) for n in (
        "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam", "Adafactor"))
    if isinstance(t, type)
)
_ADAPTIVE_NAME_HINTS = ("adam", "lamb", "lion", "adafactor", "adagrad", "rmsprop", "sophia", "shampoo", "soap")
_SECOND_MOMENT_KEYS = ("exp_avg_sq", "square_avg", "sum")
"""Optimizer-state keys holding a per-coordinate second moment (Adam*, RMSprop, Adagrad)."""


def torch_optimizer(optimizer: object) -> object:
    """The torch optimizer a framework's wrapper holds as `.optimizer` (Accelerate's
    `AcceleratedOptimizer`, Lightning's `LightningOptimizer`), else `optimizer` itself: the wrapper
    subclasses `Optimizer` but its step hooks and state are not the ones that act."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def is_adaptive(optimizer: torch.optim.Optimizer) -> bool:
    """Does `optimizer` scale each coordinate by its own statistics (Adam-like)?

    torch's adaptive classes by type; others by name (LAMB, Lion, Sophia, ... from other
    libraries) or by Adam-style `betas` in their defaults. SGD (with or without momentum)
    is not adaptive.
    """
    if isinstance(optimizer, _ADAPTIVE_TYPES):
        return True
    name = type(optimizer).__name__.lower()
    if any(h in name for h in _ADAPTIVE_NAME_HINTS):
        return True
    return "betas" in getattr(optimizer, "defaults", {})


def is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    """Does each rank hold only part of the optimizer state (ZeRO)? Then it differs across ranks."""
    return "zero" in type(optimizer).__name__.lower() or "sharded" in type(optimizer).__name__.lower()


def resolve_error_feedback(choice: bool | str, optimizer: torch.optim.Optimizer | None) -> bool:
    """`attach`'s `error_feedback` as a bool: "auto" is on only for a known non-adaptive optimizer.

    Without an optimizer "auto" is off: error feedback helps SGD a little and can collapse
    Adam, so the safe guess for an unknown optimizer is without it.
    """
    if choice is True or choice is False:
        return choice
    if choice != "auto":
        raise ValueError(f"error_feedback must be 'auto', True or False, got {choice!r}")
    if optimizer is None:
        log.info("error_feedback='auto' without optimizer=: off (pass optimizer= to enable it for SGD)")
        return False
    return not is_adaptive(optimizer)


def resolve_noise_moment(choice: bool | str, optimizer: torch.optim.Optimizer | None, *, static_route: bool,
                         calibrated_with: bool) -> bool:
    """`attach`'s `noise_moment` as a bool: whether to take the block routes' rounding noise out of
    `optimizer`'s second moment (`nfab.runtime.control.moment`).

    "auto" is on under an adaptive optimizer for a static route, and for a profile calibrated with the
    correction (`calibrated_with`): a profile calibrated without it runs as it was validated. True and
    False are as asked; without an optimizer there is nothing to correct.
    """
    if optimizer is None:
        return False
    if choice == "auto":
        return is_adaptive(optimizer) and (static_route or calibrated_with)
    return bool(choice)


class Preconditioner:
    """1 / (sqrt(second moment) + eps) per parameter, read from the optimizer's state.

    None for a parameter without a second moment yet (before the first step) or when the
    optimizer keeps none (SGD): then the monitor falls back to the plain cosine.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]) -> None:
        if is_sharded(optimizer):
            raise ValueError(f"{type(optimizer).__name__} shards its state across ranks: its second moment "
                             "is not the same on every rank, so the drift monitor cannot read it")
        self.optimizer = optimizer
        self.adaptive = is_adaptive(torch_optimizer(optimizer))  # type: ignore[arg-type]
        """Whether the optimizer keeps the second moment the drift monitor reads (Adam-like). Only
        then do the first steps' dense probes buy anything: under SGD they cost 10% of a resnet18 run's
        bytes in its first 20 steps and starved the regular probes of their budget for the rest."""
        self.params = dict(params)
        self._eps = {id(p): float(g.get("eps", 1e-8)) for g in optimizer.param_groups for p in g["params"]}
        # values of one training step: the optimizer's state cannot change while its gradients
        # are being reduced (backward), so the hook's encode, decode and probe share them
        self._step: int | None = None
        self._memo: dict[Hashable, torch.Tensor | None] = {}

    def inverse_rms(self, name: str, step: int | None = None) -> torch.Tensor | None:
        """Flat 1 / `quantization_scale` of parameter `name` (Adam's 1 / (sqrt(v) + eps), capped at
        100x its mean's), or None when there is no v. The cap keeps a coordinate whose v is still
        ~0 (a byte seen for the first time) from outweighing the whole probe: uncapped, it
        read a healthy bq2 step at cosine 0.007. `step`: see `quantization_scale`."""
        def make() -> torch.Tensor | None:
            scale = self.quantization_scale(name, step)
            return None if scale is None else scale.reciprocal()
        return self._memoized(step, ("inverse", name), make)

    def quantization_scale(self, name: str, step: int | None = None) -> torch.Tensor | None:
        """Flat per-coordinate scale block-scaled qsum quantizes `name`'s gradient in:
        sqrt(v) + eps, floored at 1% of its mean (a coordinate whose v is still ~0, e.g. an
        embedding row seen for the first time, would otherwise set its block's scale alone).
        None when there is no v. The same on every rank (see the module docstring).

        With `step` (the hook's training step) the value is computed once per step and shared:
        the caller must not modify it. Without, it is computed afresh (calibration's replay
        steps the optimizer between calls)."""
        def make() -> torch.Tensor | None:
            rms = self._rms(name)
            return None if rms is None else rms.clamp_min_(rms.mean() * PRECONDITION_FLOOR)
        return self._memoized(step, ("scale", name), make)

    def flat_scale(self, names: Sequence[str], lengths: Sequence[int],
                   device: torch.device, step: int | None = None) -> torch.Tensor | None:
        """`quantization_scale` of the parameters `names` (of `lengths` elements) concatenated on
        `device`, 1 where a parameter has none; None when none has one (plain block scales).
        The optimizer's state sits with its parameters; an offloaded one is copied without waiting.
        `step`: see `quantization_scale` (with it, each parameter's part also serves as its
        `quantization_scale` for the step)."""
        def make() -> torch.Tensor | None:
            moments = [self._second_moment(n) for n in names]
            if all(m is None for m in moments):
                return None
            if any(m is None for m in moments) or len({m[0].device for m in moments}) > 1:  # type: ignore[index]
                parts = [self.quantization_scale(n, step) for n in names]
                return torch.cat([torch.ones(n, dtype=torch.float32, device=device) if p is None
                                  else p if p.device == device else p.to(device, non_blocking=True)
                                  for p, n in zip(parts, lengths, strict=True)])
            flat = self._flat_floored(moments, lengths)  # type: ignore[arg-type]
            if flat.device != device:
                return flat.to(device, non_blocking=True)
            if step is not None:  # each part is that parameter's scale this step (bit for bit)
                for n, part in zip(names, flat.split(list(lengths)), strict=True):
                    self._memo.setdefault(("scale", n), part)
            return flat
        return self._memoized(step, ("flat", tuple(names), tuple(lengths), device), make)

    def _flat_floored(self, moments: Sequence[tuple[torch.Tensor, float]], lengths: Sequence[int]) -> torch.Tensor:
        """sqrt(v) + eps of every parameter, concatenated, each floored at 1% of its own mean: the
        bits of `quantization_scale` per parameter in a few whole-tensor passes (the per-parameter
        ops cost the hook ~20 us each in Python): sqrt and the adds are elementwise, each mean is
        taken over the parameter's own part, and max with the floor is exact."""
        flat = torch.cat([v.detach().reshape(-1) for v, _ in moments]).to(torch.float32).sqrt_()
        eps = {e for _, e in moments}
        parts = flat.split(list(lengths))
        if len(eps) == 1:
            flat.add_(eps.pop())
        else:
            for part, (_, e) in zip(parts, moments, strict=True):
                part.add_(e)
        floors = torch.stack([part.mean() for part in parts]).mul_(PRECONDITION_FLOOR)
        for part, floor in zip(parts, floors.unbind(), strict=True):
            part.clamp_min_(floor)
        return flat

    def _memoized(self, step: int | None, key: Hashable,
                  make: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """`make()`, computed once per `step` and key (always afresh without a step)."""
        if step is None:
            return make()
        if step != self._step:  # a new step: the optimizer has stepped since
            self._step, self._memo = step, {}
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def _second_moment(self, name: str) -> tuple[torch.Tensor, float] | None:
        """Parameter `name`'s second moment (as the optimizer holds it) and eps, or None when there is no v."""
        p = self.params.get(name)
        if p is None:
            return None
        state = self.optimizer.state.get(p)
        if not state:
            return None
        v = next((state[k] for k in _SECOND_MOMENT_KEYS if isinstance(state.get(k), torch.Tensor)), None)
        if v is None or v.numel() != p.numel():
            return None
        return v, self._eps.get(id(p), 1e-8)

    def _rms(self, name: str) -> torch.Tensor | None:
        """Flat sqrt(v) + eps of parameter `name` (a new fp32 tensor), or None when there is no v."""
        moment = self._second_moment(name)
        if moment is None:
            return None
        v, eps = moment
        return v.detach().reshape(-1).to(torch.float32).sqrt().add_(eps)


LossScale = Callable[[], torch.Tensor | None]
"""The loss scale the gradients in the hook carry now: a 1-element tensor on their device, or None."""


def loss_scale_of(scaler: Any) -> LossScale:
    """A reader of `scaler`'s current scale (`torch.amp.GradScaler` or a subclass: `ShardedGradScaler`)
    that never reads it back to the host: the scale tensor itself, which the scaler creates at its
    first `scale()` and changes in place in `update()`; None while it has none or is disabled.

    Why: the gradients a hook sees under a loss scaler are S times the optimizer's. Block-scaled routes
    round in the optimizer's preconditioned space, g / (sqrt(v) + eps), whose v the scaler never
    scaled: at S = 4096 and above those values passed the top of the scale codes (2^23.75) and were
    clipped (bq2 under AdamW, S = 65536: the first steps' decoded gradient half of the unscaled run's),
    and the rounding variance taken out of v was S^2 too large (the floor then cancelled it)."""
    def current() -> torch.Tensor | None:
        if not scaler.is_enabled():
            return None
        if hasattr(scaler, "_scale"):  # None before its first scale()
            return scaler._scale
        return torch.tensor(float(scaler.get_scale()))  # a scaler that keeps it elsewhere: its value (a host read)
    return current
