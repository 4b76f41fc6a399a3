"""The fp16 loss scale a calibration step runs under: `torch.amp.GradScaler`'s, as `nfab train` uses it.

Why: under fp16 autocast the backward's fp16 gradients underflow at a loss scale of 1 (values
below 2^-24 become zero, below 2^-14 lose bits), so a calibration step without the scale that
`nfab train` runs under (`GradScaler(enabled=precision == "fp16")`) judges the routes on another,
coarser gradient than the run it is for. The scale follows GradScaler's defaults: it starts at
2^16, halves on an overflow, doubles after 2000 steps without one. A power of two, so dividing
the gradients by it is exact: the gradients are those of a plain loop's `scaler.unscale_`.

One difference, by design: on an overflow `nfab train`'s scaler skips the step and the next batch
comes; a calibration step is a point of the schedule every trial must reach, so it is taken again
at the halved scale (`settle`). The scale then lags the run's by a step's worth of batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
RETRIES = 24
"""Halvings before a step is taken as it is: a gradient non-finite at 2^-8 is the model's own NaN or
inf, not an overflow (`nfab train`'s scaler would skip such steps for ever)."""


@dataclass(slots=True)
class LossScale:
    """GradScaler's dynamic scale, on the host (a calibration step's gradients are read anyway)."""

    scale: float = INIT_SCALE
    good_steps: int = 0

    def settle(self, grads: Sequence[torch.Tensor], tries: int) -> bool:
        """Update the scale after a step's (unscaled) gradients, as `GradScaler.update` does: True when
        they are kept, False when the step must be taken again at the halved scale. After `RETRIES`
        halvings the step is kept as it is, at the scale it started from."""
        if all(bool(torch.isfinite(g).all()) for g in grads):
            self.good_steps += 1
            if self.good_steps == GROWTH_INTERVAL:
                self.scale, self.good_steps = self.scale * 2.0, 0
            return True
        if tries >= RETRIES:
            self.scale *= 2.0**RETRIES
            return True
        self.scale, self.good_steps = self.scale * 0.5, 0
        return False

    def state(self) -> tuple[float, int]:
        return self.scale, self.good_steps

    def load(self, state: tuple[float, int]) -> None:
        self.scale, self.good_steps = state
