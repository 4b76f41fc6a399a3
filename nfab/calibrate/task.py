"""The training task a sweep simulates: model, W data shards, optimizer, held-out batch.

W virtual ranks live in one process. A step runs each rank's shard through the one
model, keeps each rank's flat gradient, and emulates DDP's buffer broadcast (every
rank starts the step from rank 0's buffers; rank 0's updated buffers win), so batch
norm statistics evolve as in a real W-rank run.

A step is the setting's recipe, as `nfab train` steps it: each rank accumulates `accum_steps`
micro-batches (the loss divided by their number), its forward under autocast at `precision`
(under fp16 with GradScaler's dynamic loss scale, `lossscale`), and the mean gradient is clipped
to `optim.grad_clip` before the optimizer steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from nfab.calibrate.config import CalibrationConfig
from nfab.calibrate.lossscale import LossScale
from nfab.config.optim import autocast, build_optimizer, lr_factor, warmup_steps
from nfab.config.pairing import adopt_task, check_pairing
from nfab.data import build_dataset, make_loader
from nfab.data.spec import SpecDataset
from nfab.data.user import Collate, resolve_collate
from nfab.errors import ConfigError, UserCodeError
from nfab.loss import resolve_loss
from nfab.models import build_model
from nfab.runtime.bindings import classify
from nfab.runtime.control.moment import NoiseMoment
from nfab.runtime.control.optim import Preconditioner, is_adaptive


@dataclass(frozen=True, slots=True)
class Region:
    """One region class: which parameters (by index) and their element counts, in model order."""

    name: str
    indices: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.lengths)


class ShardStream:
    """The W per-rank batches of any global step, as `make_loader` would deal them."""

    def __init__(self, data: SpecDataset, cfg: CalibrationConfig, collate: Collate = default_collate) -> None:
        self.data = data
        self.cfg = cfg
        self.collate = collate
        self.loaders = [
            make_loader(data, batch_size=cfg.batch_size, rank=r, world_size=cfg.world_size, seed=cfg.seed)
            for r in range(cfg.world_size)
        ]
        self.per_epoch = len(self.loaders[0])
        self._epoch: int | None = None
        self._indices: list[list[int]] = []

    def batches(self, step: int) -> list[Any]:
        epoch, b = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._indices = []
            for loader in self.loaders:
                loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]
                self._indices.append(list(iter(loader.sampler)))  # type: ignore[arg-type]
            self._epoch = epoch
        bs = self.cfg.batch_size
        return [collate(self.data, idx[b * bs : (b + 1) * bs], self.collate) for idx in self._indices]


def collate(data: SpecDataset, indices: list[int], fn: Collate = default_collate) -> Any:
    """The samples at `indices`, collated as the user's loader would (`default_collate`: tuples and dicts
    of stacked tensors)."""
    try:
        return fn([data[i] for i in indices])
    except (ConfigError, UserCodeError):
        raise
    except Exception as exc:  # a sample the collate function cannot batch: the user's data, one line
        raise UserCodeError(f"collating samples of {data.spec.name} raised {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def seeded(*key: int) -> Iterator[None]:
    """Run the user's loss with torch's CPU generator seeded from `key`, the caller's stream left as it was.

    A loss may draw (a denoiser's noise, a contrastive loss's augmentations, dropout): the same step of a
    trial and of the FP32 reference then draws the same numbers, so their difference is the route's, and
    the held-out loss is a function of the weights alone."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(hash(key) & 0x7FFF_FFFF_FFFF_FFFF)
        yield


class Task:
    """Model + optimizer + shards + held-out batch for one sweep."""

    def __init__(self, cfg: CalibrationConfig) -> None:
        self.cfg = cfg
        spec = build_model(cfg.model, seed=cfg.seed, **cfg.model_options)
        data_opts = dict(cfg.data_options)
        if spec.task == "lm" and "block_size" not in data_opts and cfg.dataset.partition(":")[0] in (
                "stdlib-text", "text", "tokens"):
            data_opts["block_size"] = spec.block_size
        self.data_options = data_opts
        self.train = build_dataset(cfg.dataset, split="train", seed=cfg.seed, **data_opts)
        held_out = cfg.setting.data.eval
        test = build_dataset(held_out or cfg.dataset, split="test", seed=cfg.seed,
                             **(data_opts if held_out is None else {}))
        check_pairing(spec, self.train)
        self.spec = adopt_task(spec, self.train.spec)
        self.loss = resolve_loss(cfg.setting.loss)
        """The step's loss, `loss(model, batch)`: the user's, else the model's own or cross-entropy."""
        self.collate = resolve_collate(cfg.setting.data.collate)
        self.stream = ShardStream(self.train, cfg, self.collate)
        n_eval = min(cfg.eval_samples, len(test))
        g = torch.Generator().manual_seed(cfg.seed + 17)
        self.eval_batch = collate(test, torch.randperm(len(test), generator=g, device="cpu")[:n_eval].tolist(),
                                  self.collate)
        self.eval_samples = n_eval
        self.model: nn.Module = self.spec.module
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        bindings = classify(self.model, self.spec.head_modules)
        by_region: dict[str, list[int]] = {}
        for i, name in enumerate(self.names):
            by_region.setdefault(bindings[name].region, []).append(i)
        self.regions = {
            name: Region(name, tuple(idx), tuple(self.params[i].numel() for i in idx))
            for name, idx in by_region.items()
        }
        self.optimizer = self.make_optimizer()
        named = dict(zip(self.names, self.params, strict=True))
        self.preconditioner = Preconditioner(self.optimizer, named)
        """Reads `optimizer`'s state as it is (restore loads into the same optimizer)."""
        self.moment = NoiseMoment(self.optimizer, named) if cfg.noise_moment and is_adaptive(self.optimizer) else None
        """Corrects the optimizer's second moment for the rounding variance `reduce_step` records, as the
        hook's does (`attach(noise_moment="auto")` under an adaptive optimizer)."""
        self.buffers = list(self.model.buffers())
        self.loss_scale = LossScale() if cfg.precision == "fp16" else None
        """fp16's dynamic loss scale, as `nfab train`'s GradScaler keeps it (None: no scaling)."""
        self._index: dict[str, torch.Tensor] = {}
        self._runs: dict[str, tuple[tuple[int, int], ...]] = {}

    # ---- optimizer and schedule ---------------------------------------------------
    def make_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer `nfab train` builds for this setting (same groups, same decay exemptions)."""
        return build_optimizer(self.model, self.cfg.optimizer, self.spec.optimizer)

    def lr_at(self, step: int) -> float:
        """The learning rate of `nfab train`'s schedule at `step` (one shared function), so a phase
        found here lies where the training run's learning rate is the same."""
        assert self.cfg.optimizer.lr is not None  # resolved by make_config
        return self.cfg.optimizer.lr * lr_factor(step, self.cfg.steps, self.cfg.schedule)

    @property
    def warmup_steps(self) -> int:
        return warmup_steps(self.cfg.steps, self.cfg.schedule)

    # ---- state --------------------------------------------------------------------
    def checkpoint(self) -> dict:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": _clone(self.optimizer.state_dict()),
            "loss_scale": None if self.loss_scale is None else self.loss_scale.state(),
        }

    def restore(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(_clone(ckpt["optimizer"]))
        if self.loss_scale is not None:
            self.loss_scale.load(ckpt["loss_scale"])
        if self.moment is not None:
            self.moment.clear()  # a variance recorded for a step that never ran

    # ---- one step -----------------------------------------------------------------
    def rank_grads(self, step: int) -> tuple[list[torch.Tensor], float]:
        """Each rank's flat gradient (params in model order) at `step`, and the mean loss: the mean over
        its `accum_steps` micro-batches (global batches step * A .. step * A + A - 1, as `nfab train`'s
        stream deals them), forward under the setting's autocast. Under fp16 the loss is scaled by
        `loss_scale` and the gradients divided by it (exact: a power of two); a step that overflows
        on any rank is taken again at the halved scale (`LossScale.settle`)."""
        self.model.train()
        start = [b.clone() for b in self.buffers]
        a = self.cfg.accum_steps
        micro = [self.stream.batches(step * a + k) for k in range(a)]  # micro[k][rank]
        tries = 0
        while True:
            grads, loss = self._scaled_grads(step, micro, start)
            if self.loss_scale is None or self.loss_scale.settle(grads, tries):
                return grads, loss
            tries += 1

    def _scaled_grads(self, step: int, micro: list[list[Any]],
                      start: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        """`rank_grads` at the current loss scale, every rank from the buffers `start`; after it the
        buffers are rank 0's (DDP's broadcast)."""
        scale = 1.0 if self.loss_scale is None else self.loss_scale.scale
        after0: list[torch.Tensor] = []
        grads, losses = [], []
        a = len(micro)
        for r in range(self.cfg.world_size):
            for b, s in zip(self.buffers, start, strict=True):
                b.copy_(s)
            for p in self.params:
                p.grad = None
            for k in range(a):
                with autocast(self.cfg.precision, "cpu"), seeded(self.cfg.seed, step, r, k):
                    loss = self.loss(self.model, micro[k][r])
                part = loss / a if a != 1 else loss
                (part * scale if scale != 1.0 else part).backward()  # GradScaler.scale(loss / a)
                losses.append(float(loss.detach()))
            flat = torch.cat([_grad(p).reshape(-1) for p in self.params])
            grads.append(flat.div_(scale) if scale != 1.0 else flat)
            if r == 0:
                after0 = [b.clone() for b in self.buffers]
        for b, s in zip(self.buffers, after0, strict=True):
            b.copy_(s)
        return grads, sum(losses) / len(losses)

    def apply(self, flat_mean: torch.Tensor, step: int) -> None:
        """Write a flat mean gradient into .grad, clip it as the setting does (`clip_grad_norm_`, as
        `nfab train` clips the reduced gradient) and take one optimizer step at step's lr."""
        pos = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat_mean[pos : pos + n].view_as(p).clone()
            pos += n
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(step)
        self.optimizer.step()

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Loss on the fixed held-out batch, a function of the weights alone.

        Normalisation uses the batch's own statistics (train mode, buffers restored): early
        in training running statistics lag the weights, and a trial's score would measure
        that lag instead of the route.
        """
        saved = [b.clone() for b in self.buffers]
        with seeded(self.cfg.seed, -1):
            loss = float(self.loss(self.model, self.eval_batch))
        for b, s in zip(self.buffers, saved, strict=True):
            b.copy_(s)
        return loss

    @property
    def eval_predictions(self) -> tuple[int, int]:
        """(classes, predictions) of the held-out batch: what one held-out prediction weighs in its
        mean loss (validation's `resolution`). A language model predicts every token of a vocabulary."""
        spec = self.train.spec
        if spec.task == "custom" or not isinstance(self.eval_batch, tuple | list):
            return 0, self.eval_samples  # the user's loss: no prediction's weight to bound it by
        classes = spec.vocab_size if spec.task == "lm" else spec.num_classes
        return int(classes or 0), int(self.eval_batch[1].numel())

    def region_names(self, region: str) -> list[str]:
        """The region's parameter names, in its flat (gather) order."""
        return [self.names[i] for i in self.regions[region].indices]

    def region_runs(self, region: str) -> tuple[tuple[int, int], ...]:
        """A region's elements in the flat gradient as (start, end) runs: its parameters in model
        order, neighbours merged (resnet18's 697k conv elements are 20 runs)."""
        hit = self._runs.get(region)
        if hit is None:
            starts, pos = [], 0
            for p in self.params:
                starts.append(pos)
                pos += p.numel()
            runs: list[list[int]] = []
            for i in self.regions[region].indices:
                a, b = starts[i], starts[i] + self.params[i].numel()
                if runs and runs[-1][1] == a:
                    runs[-1][1] = b
                else:
                    runs.append([a, b])
            hit = self._runs[region] = tuple((a, b) for a, b in runs)
        return hit

    def gather(self, flat: torch.Tensor, region: str) -> torch.Tensor:
        """`flat`'s elements of `region`, in region order (a copy): `flat[region_index(region)]` by runs,
        a memory copy instead of an indexed gather where the runs are few."""
        runs = self.region_runs(region)
        if len(runs) > GATHER_RUNS:
            return flat.index_select(0, self.region_index(region))
        return torch.cat([flat[a:b] for a, b in runs]) if len(runs) > 1 else flat[runs[0][0]:runs[0][1]].clone()

    def scatter(self, flat: torch.Tensor, region: str, values: torch.Tensor) -> None:
        """Write `values` (region order) into `flat`'s elements of `region`: `index_copy_` by runs."""
        runs = self.region_runs(region)
        if len(runs) > GATHER_RUNS:
            flat.index_copy_(0, self.region_index(region), values)
            return
        pos = 0
        for a, b in runs:
            flat[a:b].copy_(values[pos : pos + b - a])
            pos += b - a

    def region_index(self, region: str) -> torch.Tensor:
        """Positions of a region's elements in the flat gradient (its parameters in model order)."""
        hit = self._index.get(region)
        if hit is None:
            starts, pos = [], 0
            for p in self.params:
                starts.append(pos)
                pos += p.numel()
            hit = torch.cat([torch.arange(starts[i], starts[i] + self.params[i].numel(), device="cpu")
                             for i in self.regions[region].indices])
            self._index[region] = hit
        return hit


GATHER_RUNS = 64
"""A region of more runs than this is gathered by index (one call instead of many small copies)."""


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
