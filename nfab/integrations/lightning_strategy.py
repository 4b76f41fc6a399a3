"""nfab's Lightning strategy, defined once and built for each Lightning namespace.

Lightning ships the same code under two names: `lightning.pytorch` (the `lightning` package)
and the classic `pytorch_lightning`. A Trainer of one namespace accepts only strategies that
subclass its own namespace's `Strategy` (anything else is "an invalid strategy name"), so one
class cannot serve both. `ddp_strategy_class` builds nfab's strategy on the `DDPStrategy` it is
given; `nfab.integrations.lightning` builds it for `lightning.pytorch` and
`nfab.integrations.pytorch_lightning` for the classic namespace. Neither this module nor the
class imports a namespace itself: the base class carries everything namespace-specific.

Lightning's own `DDPStrategy` registers a communication hook only when its root device is CUDA
(`_register_ddp_hooks`), so on CPU it would drop nfab silently. The strategy overrides the
public `setup(trainer)` instead: Lightning's own setup wraps the module in DDP
(`configure_ddp`) and builds the optimizers; right after it, before the first batch, nfab
attaches to the wrapped model whatever the device, and can be given the optimizer (which
`error_feedback="auto"` reads). Overriding the private `_register_ddp_hooks` would bind nfab
to a Lightning internal, and the public `configure_ddp` runs before the optimizers exist.

Checkpoints carry nfab's state under `checkpoint["nfab"]`: every rank's (the error-feedback
residuals differ per rank; `nfab.integrations.state.RankStates`), gathered in
`save_checkpoint` (which Lightning calls on every rank, writing on rank 0), and restored on
each rank right after `setup` attaches, from what `load_checkpoint` read on `fit(ckpt_path=...)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from nfab.config.attach import AttachConfig
from nfab.errors import NfabError
from nfab.integrations.defaults import adapter_config, attach_with_defaults, checked
from nfab.integrations.metrics import StepLog
from nfab.integrations.state import KEY, RankStates, restore
from nfab.profile.schema import Profile
from nfab.runtime.frontends.ddp import Runtime


def ddp_strategy_class(ddp_strategy: type, module: str) -> type:
    """nfab's strategy as a subclass of `ddp_strategy` (one namespace's `DDPStrategy`), named
    `NfabDDPStrategy` in `module` (where it is bound, so that pickle finds it by name)."""

    class NfabDDPStrategy(ddp_strategy):  # type: ignore[misc, valid-type]
        """Lightning's DDP with nfab's communication hook; the hook's state is `strategy.runtime`.

        `profile` / `route` and the options (`config=`, an `AttachConfig`, and/or `nfab.attach`'s keyword
        options, validated here) go to `nfab.attach` as given; `total_steps` (what
        a profile's fractional phase starts are fractions of) defaults to the trainer's
        `estimated_stepping_batches`, and `optimizer` (where `nfab.attach` takes one) to the
        module's single optimizer. `strategy_kwargs` go to Lightning's `DDPStrategy` (e.g.
        `find_unused_parameters=True`, `process_group_backend="gloo"`). Each optimizer step logs
        nfab's statistics through the LightningModule's `log_dict` (`nfab/compression`,
        `nfab/route/<route>`, `nfab/fallback`, ...), so they reach whatever logger the trainer has.
        """

        def __init__(
            self,
            profile: str | Path | Profile | None = None,
            route: str | dict[str, str] | None = None,
            *,
            strategy_kwargs: Mapping[str, Any] | None = None,
            config: AttachConfig | None = None,
            **options: Any,
        ) -> None:
            config = adapter_config(config, route, options)
            profile = checked(profile, config.route, "NfabDDPStrategy: ")
            strategy_kwargs = dict(strategy_kwargs or {})
            if "ddp_comm_hook" in strategy_kwargs or "ddp_comm_wrapper" in strategy_kwargs:
                raise NfabError("NfabDDPStrategy registers nfab's hook; DDP takes one, so drop ddp_comm_hook/wrapper")
            super().__init__(**strategy_kwargs)
            self._nfab_profile = profile
            self._nfab_config = config
            self.runtime: Runtime | None = None
            """nfab's hook state on this rank, set when `fit` wraps the model in DDP."""
            self._nfab_log = StepLog()
            self._pending: dict[str, Any] | None = None

        def setup(self, trainer: Any) -> None:
            """Lightning's setup (DDP wrap in `configure_ddp`, then optimizers), then attach nfab on any device."""
            super().setup(trainer)
            if not isinstance(self.model, DistributedDataParallel):  # validate/test/predict: no DDP, no gradients
                return
            optimizer = self.optimizers[0] if len(self.optimizers) == 1 else None
            self.runtime = attach_with_defaults(self.model, self._nfab_profile, self._nfab_config,
                                                total_steps=_total_steps(trainer),
                                                optimizer=optimizer,
                                                loss_scaler=getattr(self.precision_plugin, "scaler", None))
            self._nfab_log.reset()
            if self._pending is not None:  # resuming: nfab's state from the checkpoint, this rank's entry
                restore(self.runtime, self._pending)
                self._pending = None

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            """Add every rank's nfab state (a collective: Lightning calls this on every rank), then save."""
            if self.runtime is not None:
                checkpoint[KEY] = RankStates(self.runtime).state_dict()
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

        def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            """Lightning's load; nfab's state is kept for `setup` (the hook does not exist yet)."""
            checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
            self._pending = checkpoint.get(KEY)
            return checkpoint

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            """Lightning's training step; its loss feeds nfab's health monitor (it rides with the next control word)."""
            out = super().training_step(*args, **kwargs)
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if self.runtime is not None and isinstance(loss, torch.Tensor):
                self.runtime.observe_loss(loss)
            return out

        def optimizer_step(
            self,
            optimizer: Optimizer,
            closure: Callable[[], Any],
            model: torch.nn.Module | None = None,
            **kwargs: Any,
        ) -> Any:
            """Lightning's optimizer step (its closure runs the backward, hence the hook), then log the step's stats."""
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            self._log_step()
            return out

        def _log_step(self) -> None:
            metrics = self._nfab_log.metrics(self.runtime.step_stats() if self.runtime is not None else None)
            if metrics is not None:
                self.lightning_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    NfabDDPStrategy.__module__ = module
    NfabDDPStrategy.__qualname__ = NfabDDPStrategy.__name__
    return NfabDDPStrategy


def _total_steps(trainer: Any) -> int | None:
    """Optimizer steps the trainer will take (None when unbounded, e.g. max_steps=-1 and max_epochs=-1)."""
    steps = trainer.estimated_stepping_batches
    return int(steps) if math.isfinite(steps) else None
