"""nfab in the Transformers Trainer: a callback that attaches nfab's hook when training begins.

The Trainer has no setting for a communication hook, and it wraps the model in DDP only
inside `train()`. So `attach(trainer, ...)` adds a `TrainerCallback` that, at
`on_train_begin`, calls `nfab.attach` on `trainer.model_wrapped` (the DDP model the Trainer
just built, before the first backward; or its FSDP2 model under `fsdp="full_shard"`,
`fsdp_config={"fsdp_version": 2}`, which Accelerate builds on accelerator devices only: on CPU
it builds DDP, docs/integrations.md) and then puts each
logged step's nfab statistics into the Trainer's logs through `trainer.log`, so `log_history`
and every `report_to` reporter see them.

Checkpoints: at `on_save` every rank writes its own nfab state (error-feedback residuals are
per rank) into the checkpoint folder the Trainer just wrote, `nfab_state_rank<r>.pt`,
temp file + rename, as the Trainer writes its per-process RNG states. A resumed
`train(resume_from_checkpoint=...)` restores it at `on_train_begin`, right after attaching,
from `args.resume_from_checkpoint` when that names a folder, else from
`<output_dir>/checkpoint-<global step>` (where `resume_from_checkpoint=True` resumes from);
set `callback.resume_from` to name another folder.

`calibrate(trainer, out=...)` calibrates the training the Trainer would run, from its model, datasets,
collator, `compute_loss` and `TrainingArguments`, and writes the profile `attach` then takes.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("nfab.integrations.transformers needs Transformers: pip install 'nfab[transformers]'") from e
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset

from nfab.config.attach import AttachConfig
from nfab.errors import ConfigError, NfabError
from nfab.integrations.defaults import adapter_config, attach_with_defaults, checked
from nfab.integrations.metrics import StepLog
from nfab.integrations.recipe import named_loss, run, trainer_recipe
from nfab.integrations.state import load_rank_file, save_rank_file
from nfab.profile.schema import Profile
from nfab.runtime.frontends import fsdp2
from nfab.runtime.frontends.ddp import Runtime

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from nfab.calibrate.api import CalibrationResult

log = logging.getLogger(__name__)


class NfabCallback(TrainerCallback):
    """The handle `attach` returns: `.runtime` is nfab's hook state once `trainer.train()` has begun.

    `.runtime` stays None before training and on a single process (nothing to compress).
    Statistics are logged on the steps the Trainer logs (`logging_steps`, `logging_strategy`,
    `logging_first_step`), keyed `nfab/compression`, `nfab/route/<route>`, `nfab/fallback`, ...;
    every step's are in `runtime.history`.
    """

    def __init__(
        self,
        trainer: Trainer,
        profile: str | Path | Profile | None,
        config: AttachConfig,
    ) -> None:
        self.trainer = trainer
        self.profile = profile
        self.config = config
        self.runtime: Runtime | None = None
        self._ddp: DistributedDataParallel | FSDPModule | None = None
        self._log = StepLog()
        self.resume_from: str | Path | None = None
        """The checkpoint folder to restore nfab's state from (default: see the module doc)."""

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        model = self.trainer.model_wrapped
        if model is self._ddp:  # a second train() reuses the DDP model, and DDP takes one hook
            return
        if args.world_size == 1:
            log.info("nfab: one process, no gradient communication to compress; training without nfab")
            return
        if not (isinstance(model, DistributedDataParallel) or fsdp2.is_fsdp2(model)):
            raise NfabError(f"nfab needs the Trainer to wrap the model in DistributedDataParallel or FSDP2, got "
                            f"{type(model).__name__} (FSDP1 and DeepSpeed own their communication)")
        self.runtime = attach_with_defaults(model, self.profile, self.config, total_steps=state.max_steps,
                                            optimizer=self.trainer.optimizer,
                                            loss_scaler=getattr(self.trainer.accelerator, "scaler", None))
        self._ddp = model
        self._log.reset()
        if state.global_step > 0:
            self._restore(args, state)

    def _restore(self, args: TrainingArguments, state: TrainerState) -> None:
        assert self.runtime is not None
        folder = self.resume_from
        named = args.resume_from_checkpoint
        if folder is None and isinstance(named, str) and Path(named).is_dir():
            folder = named
        if folder is None:
            folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not load_rank_file(self.runtime, folder):
            log.warning("nfab: resumed at step %d but %s holds no nfab state: residuals and health start afresh",
                        state.global_step, folder)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Every rank writes its nfab state into the checkpoint folder the Trainer just saved."""
        if self.runtime is not None:
            save_rank_file(self.runtime, Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.runtime is None:
            return
        # every step: the step's statistics are folded here, after it, with their one read from the
        # device; left to the next step, the fold ran inside its first reduction, during backward
        stats = self.runtime.step_stats()
        # DefaultFlowCallback (always first) has already decided whether this step is logged
        if not control.should_log:
            return
        metrics = self._log.metrics(stats)
        if metrics is None:
            return
        self.trainer.log(metrics)
        # that log's `on_log` (DefaultFlowCallback) cleared should_log, which dropped the Trainer's own
        # loss / grad_norm / learning_rate log of this step: the step is still to be logged
        self.trainer.control.should_log = True


def attach(
    trainer: Trainer,
    profile: str | Path | Profile | None = None,
    route: str | dict[str, str] | None = None,
    *,
    config: AttachConfig | None = None,
    **options: Any,
) -> NfabCallback:
    """Make `trainer.train()` run with nfab's hook; the returned handle's `.runtime` is set when training begins.

    `profile` / `route` and the options (`config=`, an `AttachConfig`, and/or `nfab.attach`'s keyword
    options, validated here) go to `nfab.attach` untouched; `total_steps`
    defaults to the Trainer's `max_steps` for the run and `optimizer` (where `nfab.attach`
    takes one) to the optimizer the Trainer built. The Trainer hands callbacks no loss
    before the backward, so the trainer's `compute_loss` is wrapped (on this instance, a
    subclass's override included) to report each training loss to the health monitor.
    """
    cfg = adapter_config(config, route, options)
    callback = NfabCallback(trainer, checked(profile, cfg.route), cfg)
    trainer.add_callback(callback)
    trainer.compute_loss = _observing(trainer.compute_loss, trainer, callback)  # type: ignore[method-assign]
    return callback


def _observing(compute_loss: Any, trainer: Trainer, callback: NfabCallback) -> Any:
    """`compute_loss` that also hands a training step's loss to nfab's runtime (`observe_loss`, before its
    backward: it rides the step's first control word); evaluation's losses are not the step's."""

    def wrapped(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        out = compute_loss(model, inputs, *args, **kwargs)
        if callback.runtime is not None and trainer.model.training:
            loss = out[0] if isinstance(out, tuple) else out
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                callback.runtime.observe_loss(loss)
        return out

    return wrapped


def calibrate(trainer: Trainer, *, out: str | Path | None = None, world_size: int = 4, steps: int | None = None,
              **kwargs: Any) -> CalibrationResult:
    """Calibrate the training `trainer` would run, from what it holds; `attach(trainer, result.profile_path)`
    then trains with the profile (docs/integrations.md).

    - model: `trainer.model_init` when set, else a copy of `trainer.model` taken now (call this before
      `train()`), on the CPU, where calibration runs;
    - data: the datasets and collator of `trainer.get_train_dataloader()` / `get_eval_dataloader()`, so
      the Trainer's removal of the columns `forward` does not take, and a subclass's overrides, apply
      (without an eval dataset the train set's last 10% is held out);
    - loss: `trainer.compute_loss(model, inputs)`, a subclass's override included, called as the
      Trainer calls it less `num_items_in_batch` (each micro-batch's own mean, as nfab averages
      accumulated micro-batches), on a copy of the batch (it may pop `labels`);
    - recipe: `TrainingArguments` where nfab's config has the same setting (`recipe.trainer_recipe`:
      batch size, accumulation, `max_grad_norm`, AdamW's or SGD's lr / weight decay / betas, a cosine or
      constant schedule and its warm-up, `max_steps`, bf16 / fp16, seed).

    `out`, `world_size`, `steps` and `kwargs` go to `nfab.calibrate` and win over what was read.
    """
    if trainer.train_dataset is None:
        raise ConfigError("the Trainer has no train_dataset to calibrate on")
    train = trainer.get_train_dataloader()
    if isinstance(train.dataset, IterableDataset):
        raise ConfigError("nfab calibrates from a map-style train_dataset (len and indexing); the Trainer's "
                          "is an IterableDataset")
    eval_data = None
    if trainer.eval_dataset is not None:
        named = next(iter(trainer.eval_dataset)) if isinstance(trainer.eval_dataset, dict) else None
        eval_data = trainer.get_eval_dataloader(named).dataset
    recipe = trainer_recipe(trainer.args, trainer.optimizer)
    recipe.update(eval_data=eval_data, collate=train.collate_fn, loss=trainer_loss(trainer))
    kwargs.update(out=out, world_size=world_size, steps=steps)
    return run(_model_factory(trainer), train.dataset, recipe, kwargs)


def _model_factory(trainer: Trainer) -> Callable[[], nn.Module] | nn.Module:
    """`model_init` itself where it takes no trial (so it is named as the CLI would name it), else a call
    through the Trainer; without one, a copy of the model as it is now."""
    init = trainer.model_init
    if init is None:
        return copy.deepcopy(trainer.model).cpu()
    if not inspect.signature(init).parameters:
        return init

    def fresh_model() -> nn.Module:
        return trainer.call_model_init()

    fresh_model.__qualname__ = f"<{type(trainer).__name__}.model_init>"
    return fresh_model


def trainer_loss(trainer: Trainer) -> Callable[[nn.Module, Any], Any]:
    """`trainer.compute_loss` as `loss(model, batch)`, named after the class that defines it."""
    compute_loss = trainer.compute_loss

    def loss(model: nn.Module, batch: Any) -> Any:
        return compute_loss(model, dict(batch) if isinstance(batch, Mapping) else batch)

    return named_loss(loss, type(trainer), "compute_loss")
