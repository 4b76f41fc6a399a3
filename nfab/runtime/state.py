"""What every front end's runtime shares: the profile's controller, the health monitor, the step.

nfab has two front ends over one reduction core: DDP's GradBucket hook (`frontends/ddp.py`) and
FSDP2's reduce-scatter (`frontends/fsdp.py`). Both give the user the same object: report a loss
(`observe_loss`), read the last step's agreed statistics (`step_stats`), save and resume
(`state_dict` / `load_state_dict`). This base holds that surface and the state behind it, and the
control both front ends run alike: which regions a step probes (`probing`) and how a folded step,
with the previous step's agreed probe fidelity, moves the health monitor (`observe_health`:
alarms, FP32 shadow windows, demotions). A front end adds how its collectives and probes are
launched and how each step is folded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from nfab.profile.schema import Phase, Profile
from nfab.runtime.control import health as health_mod
from nfab.runtime.control import probes
from nfab.runtime.control.controller import Controller
from nfab.runtime.control.fidelity import RegionFidelity
from nfab.runtime.control.window import Window
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
        self._probing: tuple[int, frozenset[str]] | None = None
        self.regions: dict[str, str] = {}
        """Every parameter's region (name -> region); a front end fills it from the model."""
        self.window: Window | None = None
        """`attach(model, "auto")`: in-run calibration's windows (the front end samples, folds and agrees)."""

    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Report this rank's loss; it rides with the next control word (stays on its device)."""
        self._loss_local = loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else float(loss)

    def take_loss(self) -> torch.Tensor | float | None:
        """This rank's observed loss, consumed by the step's first control word."""
        loss, self._loss_local = self._loss_local, None
        return loss

    def probing(self, phase: Phase, *, dense: bool = False, watch_all: bool = False) -> frozenset[str]:
        """The regions this step's fidelity probe samples (`control/probes.py`: rotating, spaced out
        once quiet, within `Health.probe_budget`; every lossy region in an alarm's shadow window).
        Asked by every bucket or reduce-scatter of the step: decided once per step, from the step and
        the health state every rank holds, so every call of every rank samples the same regions.
        `dense`, `watch_all`: see `probes.probe_regions` (DDP's drift monitor and error feedback)."""
        if self._probing is None or self._probing[0] != self.step:
            lossy = self.controller.model_lossy(phase, self.regions)
            self._probing = (self.step, probes.probe_regions(self.step, self.profile.health, self.health, lossy,
                                                             dense=dense, watch_all=watch_all, horizon=self.horizon))
        return self._probing[1]

    def observe_health(self, st: StepStats, lossy: frozenset[str], fidelity: Mapping[str, RegionFidelity],
                       probe_regions: frozenset[str],
                       with_ef: frozenset[str] = frozenset()) -> list[health_mod.HealthEvent]:
        """Fold a finished step's agreed statistics into the health monitor: `fidelity` is the previous
        step's probe of `probe_regions`, agreed over ranks (an alarm's shadow window reads it)."""
        events = health_mod.observe(self.health, self.profile.health, st, fidelity, probe_regions, lossy, with_ef)
        self.events.extend(events)
        return events

    def adopt(self, profile: Profile) -> None:
        """Run on `profile` from the next decision on (in-run calibration's fitted profile, agreed by every
        rank): a new controller over the same world size and cost model; health and step carry on."""
        old = self.controller
        self.profile = profile
        self.controller = Controller(profile, old.world_size, old.cost_model, explicit=False,
                                     total_steps=old.total_steps)
        self._probing = None

    def reference_series(self) -> dict[str, list[float]]:
        """The agreed loss and gradient-norm series of the steps kept (what health thresholds are fitted on)."""
        return {"loss": [float("nan") if s.loss is None else s.loss for s in self.history],
                "grad_norm": [s.grad_norm for s in self.history]}

    def base_state(self) -> dict[str, Any]:
        """The shared part of `state_dict`: version, step, health and in-run calibration's windows."""
        return {"version": STATE_VERSION, "step": self.step, "health": self.health.to_dict(),
                **({"window": self.window.state_dict()} if self.window is not None else {})}

    def load_base_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported runtime state version {state.get('version')!r}")
        self.step = int(state["step"])
        self.health = health_mod.HealthState.from_dict(state["health"])
        if self.window is not None and "window" in state:  # the windows measured, and the profile agreed
            self.window.load_state_dict(state["window"])
            if self.window.decided is not None:
                self.adopt(self.window.decided)
