"""Models fit their data set: options a model can take default to the data set's own facts.

`nfab train --model resnet18 --dataset digits` builds a 10-class, 1-channel resnet18
with the small-input stem, because digits has 10 classes of 1x8x8 images. Options
the user gave explicitly always win; a real contradiction (explicit `num_classes=1000`
with digits) is then caught by `check_pairing` as one line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nfab.data import SpecDataset, build_dataset
from nfab.data.spec import DataSpec
from nfab.errors import ConfigError
from nfab.models import ModelSpec, build_model
from nfab.models.options import accepted_options
from nfab.models.registry import MODELS, load_factory

SMALL_IMAGE_PX = 32
"""Images this small get the small-input stem (no 7x7/2 + max-pool that would erase them)."""


def model_option_names(model: str) -> tuple[str, ...] | None:
    """Keyword options a registered builder or a user factory takes (None: any, `**kwargs`)."""
    builder = MODELS.get(model) if ":" not in model else load_factory(model)
    if builder is None:
        raise ConfigError(f"unknown model {model!r}; choose one of {sorted(MODELS)} or give module.path:factory")
    return accepted_options(builder)


def data_facts(data: DataSpec) -> dict[str, Any]:
    """The model options a data set decides: classes, channels and size of images; vocab and window of text
    (none for a user's data, whose samples only the user's loss reads)."""
    if data.task == "custom":
        return {}
    if data.task == "classification" and len(data.input_shape) != 3:  # rows of features, not images
        return {"num_classes": data.num_classes}
    if data.task == "classification":
        channels, height = data.input_shape[0], data.input_shape[-1]
        return {"num_classes": data.num_classes, "in_channels": channels, "image_size": height,
                "small_input": height <= SMALL_IMAGE_PX}
    return {"vocab_size": data.vocab_size, "block_size": data.input_shape[0]}


def fit_model_options(model: str, options: dict[str, Any], data: DataSpec) -> dict[str, Any]:
    """`options` plus every data fact the model takes and the user did not give."""
    names = model_option_names(model)
    if names is None:
        return dict(options)
    facts = {k: v for k, v in data_facts(data).items() if k in names and k not in options and v is not None}
    return {**options, **facts}


def adopt_task(spec: ModelSpec, data: DataSpec) -> ModelSpec:
    """A user model that declared no task takes its data's (a language model's vocabulary and window
    from the data's), so its default optimizer family and checks follow the data it trains on."""
    if spec.task_declared or data.task in ("custom", spec.task):
        return spec
    if data.task == "lm":
        return replace(spec, task="lm", optimizer="adamw", vocab_size=spec.vocab_size or data.vocab_size,
                       block_size=spec.block_size or data.input_shape[0])
    return replace(spec, task="classification", num_classes=spec.num_classes or data.num_classes)


def check_pairing(spec: ModelSpec, data: SpecDataset | DataSpec) -> None:
    """Refuse a model and data set that cannot train together (one line). A user's data (task `custom`)
    is its loss's to read: nothing here can check it."""
    d = data if isinstance(data, DataSpec) else data.spec
    if d.task == "custom":
        return
    spec = adopt_task(spec, d)
    if spec.task != d.task:
        raise ConfigError(f"model {spec.name} is a {spec.task} model but data set {d.name} is {d.task}")
    if spec.task == "classification":
        if spec.num_classes is not None and d.num_classes is not None and spec.num_classes != d.num_classes:
            raise ConfigError(f"model {spec.name} has {spec.num_classes} classes, data set {d.name} {d.num_classes}"
                              " (drop model.num_classes: it defaults to the data set's)")
        if spec.in_channels is not None and d.input_shape[0] != spec.in_channels:
            raise ConfigError(f"model {spec.name} takes {spec.in_channels} input channels, data set {d.name} has "
                              f"{d.input_shape[0]} (drop model.in_channels, or set data.channels)")
        if spec.image_size is not None and d.input_shape[-1] != spec.image_size:
            raise ConfigError(f"model {spec.name} takes {spec.image_size}px images, data set {d.name} has "
                              f"{d.input_shape[-1]}px (drop model.image_size, or set data.image_size)")
    else:
        if d.vocab_size is not None and spec.vocab_size is not None and d.vocab_size > spec.vocab_size:
            raise ConfigError(f"data set {d.name} has vocab {d.vocab_size}, model {spec.name} only {spec.vocab_size}")
        if spec.block_size is not None and d.input_shape[0] > spec.block_size:
            raise ConfigError(f"data set {d.name} windows are {d.input_shape[0]} tokens, longer than model "
                              f"{spec.name}'s block_size {spec.block_size} (set data.block_size)")


@dataclass(frozen=True, slots=True)
class Pairing:
    """A model and data set resolved to fit each other, built on the meta device for checking."""

    model_options: dict[str, Any]
    data_options: dict[str, Any]
    spec: ModelSpec
    data: DataSpec


DEFAULT_DATA = {"lm": "stdlib-text", "classification": "digits"}
"""The data set a model trains and calibrates on when neither a config nor --dataset names one."""


def default_data(model: str, options: dict[str, Any]) -> str:
    """`DEFAULT_DATA` for the model's task (built on the meta device: a user factory declares its task)."""
    return DEFAULT_DATA[build_model(model, device="meta", **options).task]


def resolve_pairing(model: str, model_options: dict[str, Any], dataset: str, data_options: dict[str, Any],
                    seed: int) -> Pairing:
    """Fit the model's options to the data set (and a text window to a fixed-context model), then check."""
    data = build_dataset(dataset, split="train", seed=seed, **data_options).spec
    options = fit_model_options(model, model_options, data)
    spec = build_model(model, device="meta", **options)
    data_opts = dict(data_options)
    window_fixed_by_model = spec.block_size is not None and "block_size" not in options
    if (data.task == "lm" and window_fixed_by_model and "block_size" not in data_opts
            and spec.block_size != data.input_shape[0]):
        # a model whose context the user cannot set (a user factory) decides the text window
        data_opts["block_size"] = spec.block_size
        data = build_dataset(dataset, split="train", seed=seed, **data_opts).spec
    check_pairing(spec, data)
    return Pairing(options, data_opts, adopt_task(spec, data), data)
