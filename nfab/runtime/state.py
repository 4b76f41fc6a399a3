"""What every front end's runtime shares: the profile's controller, the health monitor, the step.

nfab has two front ends over one reduction core: DDP's GradBucket hook (`frontends/ddp.py`) and
FSDP2's reduce-scatter (`frontends/fsdp.py`). Both give the user the same object: report a loss
(`observe_loss`), read the last step's agreed statistics (`step_stats`), save and resume
(`state_dict` / `load_state_dict`). This base holds that surface and the state behind it; a front
end adds how its collectives are launched and folds each step through `fold`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from nfab.profile.schema import Profile
from nfab.runtime.control import health as health_mod
from nfab.runtime.control.controller import Controller
from nfab.runtime.stats import StepStats
from nfab.wire.cost import CostModel

STATE_VERSION = 1
HISTORY_STEPS = 4096
"""Steps of statistics kept (bounded: a run of days must not grow)."""


class RuntimeState:
    """Routes, health and statistics of one model on one rank, whatever wraps the model."""

    def __init__(self, profile: Profile, world_size: int, rank: int, *, explicit: bool,
                 cost_model: CostModel | None, total_steps: int | None, seed: int,
                 route_world_size: int | None = None) -> None:
        """`route_world_size`: the W routes are decided at (DDP's two-level path: the nodes), else W."""
        self.profile = profile
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.controller = Controller(profile, route_world_size or world_size, cost_model, explicit=explicit,
                                     total_steps=total_steps)
        self.health = health_mod.HealthState()
        self.horizon = total_steps
        """The run's length when the user gave it: what early dense probes may borrow against (probes.py)."""
        self.step = 0
        self.history: deque[StepStats] = deque(maxlen=HISTORY_STEPS)
        self.events: list[health_mod.HealthEvent] = []
        self._loss_local: torch.Tensor | float | None = None

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Report this rank's loss; it rides with the next control word (stays on its device)."""
        self._loss_local = loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else float(loss)

    def take_loss(self) -> torch.Tensor | float | None:
        """This rank's observed loss, consumed by the step's first control word."""
        loss, self._loss_local = self._loss_local, None
        return loss

    def observe_health(self, st: StepStats, lossy: frozenset[str]) -> list[health_mod.HealthEvent]:
        """Fold a finished step's agreed statistics into the health monitor (no probes: a shadow window
        could not answer, so a spike or jump demotes every lossy region, as `shadow_steps: 0` says)."""
        cfg = self.profile.health
        cfg = cfg.model_copy(update={"shadow_steps": 0}) if cfg.shadow_steps else cfg
        events = health_mod.observe(self.health, cfg, st, {}, frozenset(), lossy, frozenset())
        self.events.extend(events)
        return events

    def base_state(self) -> dict[str, Any]:
        """The shared part of `state_dict`: version, step and health."""
        return {"version": STATE_VERSION, "step": self.step, "health": self.health.to_dict()}

    def load_base_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported runtime state version {state.get('version')!r}")
        self.step = int(state["step"])
        self.health = health_mod.HealthState.from_dict(state["health"])
