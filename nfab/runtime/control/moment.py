"""Adam's second moment without the rounding noise: what stochastic rounding adds to E[g^2], taken back out.

Why: block-scaled qsum is unbiased, E[g_hat] = g, but its square is not: E[g_hat^2] = g^2 + var,
where var is the rounding noise of the W-rank mean. Adam-style optimizers keep
v = EMA(g_hat^2) and step by m / sqrt(v), so the noise inflates v and shrinks every step of a
coordinate whose gradient is small next to its block's scale -- a slower run, which shows as
a loss gap that grows with the run and not as a spike (on the second held-out model, static
bq2 ended +1.4% above FP32; the same route with the learning rate x1.1 ended +0.9%).

The noise's variance is known from what every rank already agreed on: the block's scale s
(its MAX-agreed code), the route's M = levels - 1, the world size W and Adam's own
preconditioner q (the hook rounds g / q and multiplies back). One level is 2s/M; a rank's
stochastic rounding with a uniform fractional part adds 1/6 of a level squared; the W ranks'
stratified noise (`wire/noise.py`) cancels part of it: the mean's variance is (W+1)/(12 W^2)
levels squared (measured over uniform fractional parts: 0.75, 0.625, 0.5625 of the
independent 1/(6W) at W = 2, 4, 8). So

    var_i = (2 s_b / M)^2 * (W + 1) / (12 W^2) * q_i^2

and before the optimizer steps, v_{t-1} -= (1 - beta2) / beta2 * var_i, so that its update
v_t = beta2 v_{t-1} + (1 - beta2) g_hat^2 adds g_hat^2 - var_i, an unbiased estimate of g^2.

Never below FLOOR x var_i (nor above v itself): where the true g^2 is far below the noise, the
corrected EMA is a small difference of two noisy numbers, and Adam divides by its square
root. Subtracted to 0 (or below), those coordinates' steps were m / eps: static bq2 with the
plain correction diverged on the second held-out model within its first steps (loss 3.6e9).
With the floor a coordinate of pure noise steps at most 1/sqrt(FLOOR) times further than
without the correction; one with signal is corrected down to its signal's second moment.
The floor holds where Adam reads v, after its bias correction v / (1 - beta2^n) (n: the updates
v has had): raw v is at least FLOOR x var x (1 - beta2^n). A floor on raw v would hold a young
v back entirely under beta2 = 0.999 (after 100 steps raw v is 10% of its mean, below half the
noise nearly everywhere): on a plain-Adam model the correction then did almost nothing.

Every input is a collective result or optimizer state, identical on every rank, so the
replicas stay bit-identical.

It assumes the optimizer steps on the reduced gradient as decoded: gradient clipping or loss
scaling between backward and `step()` rescales the gradient but not this variance (clipping
by c < 1 leaves the correction c^-2 too large, which the floor bounds). Only the flat path
records: the two-level (hierarchy) reduction rounds across nodes after a node-local sum, whose
variance this model does not describe, so it leaves v as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from nfab.runtime.control.optim import LossScale
from nfab.wire.blockq.reducer import BlockQSum


def rounding_variance(reducer: BlockQSum, codes: torch.Tensor, lengths: Sequence[int], world_size: int,
                      weights: torch.Tensor | None) -> torch.Tensor:
    """Per element of a group: the variance block-scaled qsum's rounding adds to the W-rank mean
    (in the gradient's own space: times q^2 where the group was rounded preconditioned)."""
    level = reducer.element_scales(codes, lengths).mul(2.0 / reducer.steps)
    var = level.square_().mul_((world_size + 1) / (12.0 * world_size * world_size))
    return var if weights is None else var.mul_(weights.square())


def replay_variance(reducer: BlockQSum, xs: Sequence[torch.Tensor], lengths: Sequence[int],
                    weights: torch.Tensor | None) -> torch.Tensor:
    """`rounding_variance` of W virtual ranks' flat inputs `xs`, rounded (as the hook rounds them)
    after dividing by `weights` when given: their codes are what the hook's MAX agreement yields,
    the codes of the ranks' largest block maxima (`agree_input` is monotone). The ranks' max |x| is
    divided once: max_r(|x_r| / w) = max_r(|x_r|) / w bit for bit (w > 0, rounding is monotone)."""
    absmax = torch.stack([x.abs() for x in xs]).amax(0)
    if weights is not None:
        absmax = absmax.div_(weights)
    codes = reducer.agree_input(reducer.local_scale(absmax, lengths))
    return rounding_variance(reducer, codes, lengths, len(xs), weights)


FLOOR = 0.5
"""The corrected second moment of a coordinate (bias-corrected, as Adam reads it) is at least this x
its step's rounding variance."""


def _debias(beta2: float, updates: torch.Tensor | float | None) -> torch.Tensor | float:
    """1 - beta2^n, Adam's bias correction of a v that has had n updates (1 when the optimizer keeps
    no step count); a tensor count (on the device for capturable or fused Adam) stays a tensor."""
    if updates is None:
        return 1.0
    return 1.0 - beta2 ** updates


class NoiseMoment:
    """Collects each step's rounding variance per parameter (from the decode callbacks) and takes
    it out of the optimizer's second moment just before `optimizer.step()` updates it (a step
    pre-hook; after the closure of a `step(closure)`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                 loss_scale: LossScale | None = None) -> None:
        self.optimizer = optimizer
        self.loss_scale = loss_scale
        """Under a loss scaler (`attach(loss_scaler=)`): the variance is recorded in the scaled gradient's
        units, v holds the unscaled one's, so it is divided by S^2 (on the device)."""
        self._names = {id(t): n for n, t in params.items()}  # the optimizer's parameters by name
        self._pending: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # decode callbacks may run on the collectives' threads
        optimizer.register_step_pre_hook(self._before_step)
        self.applied_steps = 0
        """Steps whose second moment was corrected (none before the optimizer's first step: no v yet)."""

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Correct v now, or, for `step(closure)`, right after the closure: Lightning runs the forward and
        backward inside the closure, so this hook fires before the step's own variance is recorded (it
        applied the step before's, one step late, and a resume lost what was pending)."""
        # `args` is what `step` was called with, the optimizer first: (optimizer, closure?)
        closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if closure is None:
            self.apply()
            return None

        def corrected() -> object:
            loss = closure()
            self.apply()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": corrected}
        return (args[0], corrected, *args[2:]), kwargs

    def record(self, names: Sequence[str], lengths: Sequence[int], var: torch.Tensor) -> None:
        """The variance of one decoded group, split into its parameters (flat, in group order)."""
        scale = self.loss_scale() if self.loss_scale is not None else None
        if scale is not None:
            var = var / scale.to(var.device).square()
        parts = var.split(list(lengths))
        with self._lock:
            for name, part in zip(names, parts, strict=True):
                self._pending[name] = part

    def clear(self) -> None:
        """Forget what was recorded and not yet applied."""
        with self._lock:
            self._pending = {}

    def apply(self) -> None:
        """v -= (1 - beta2) / beta2 * var for every parameter recorded this step (then forget them)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        touched = False
        for group in self.optimizer.param_groups:
            betas = group.get("betas")
            if betas is None:
                continue
            k = (1.0 - betas[1]) / betas[1]
            for p in group["params"]:
                var = pending.get(self._names.get(id(p)))
                state = self.optimizer.state.get(p)
                v = state.get("exp_avg_sq") if state else None
                if hasattr(v, "to_local"):  # FSDP2: this rank's shard of v, corrected in place
                    v = v.to_local()
                if var is None or not isinstance(v, torch.Tensor) or v.numel() != var.numel():
                    continue
                # onto v's device: FSDP2 with CPU offload keeps Adam's state on the host (a blocking copy)
                var = var.view_as(v).to(v.device, v.dtype)
                floor = torch.minimum(v, var * (FLOOR * _debias(betas[1], state.get("step"))))  # never raises v
                torch.maximum(v.sub_(var, alpha=k), floor, out=v)
                touched = True
        self.applied_steps += int(touched)
