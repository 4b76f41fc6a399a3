"""nfab.integrations.recipe and the Lightning reader: what a framework's recipe maps to in nfab's config, what
it leaves to nfab's defaults, and the user's keywords winning. Pure functions, no training."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nfab.calibrate import api
from nfab.integrations import recipe
from nfab.integrations.lightning_calibrate import _single, trainer_settings
from nfab.integrations.recipe import optimizer_config, run


def _params() -> list[dict[str, Any]]:
    net = torch.nn.Linear(4, 4)
    return [{"params": [net.weight], "weight_decay": 0.1}, {"params": [net.bias], "weight_decay": 0.0}]


def test_torch_optimizers_that_map_and_those_that_do_not() -> None:
    assert optimizer_config(torch.optim.AdamW(_params(), lr=1e-3, betas=(0.8, 0.9))) == {
        "name": "adamw", "lr": 1e-3, "weight_decay": 0.1, "betas": [0.8, 0.9]}  # the decay group's decay
    assert optimizer_config(torch.optim.Adam(torch.nn.Linear(2, 2).parameters(), lr=1e-3))["name"] == "adamw"
    assert optimizer_config(torch.optim.Adam(_params(), lr=1e-3)) is None  # L2 in the gradient, not decoupled
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    assert optimizer_config(sgd) == {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}
    assert optimizer_config(SimpleNamespace(optimizer=sgd)) == optimizer_config(sgd)  # a framework's wrapper
    net = torch.nn.Linear(2, 2)
    assert optimizer_config(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)) is None
    assert optimizer_config(torch.optim.RMSprop(net.parameters(), lr=0.1)) is None
    two_lrs = [{"params": [net.weight], "lr": 0.1}, {"params": [net.bias], "lr": 0.01}]
    assert optimizer_config(torch.optim.AdamW(two_lrs)) is None


def test_training_arguments_map_where_nfab_has_the_setting(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), optim="adafactor", lr_scheduler_type="linear",
                                          warmup_steps=5, max_grad_norm=0.0, use_cpu=True, report_to="none")
    got = recipe.trainer_recipe(args)
    assert "optimizer" not in got and got["schedule"] == {}  # nfab's optimizer and cosine, logged
    assert got["grad_clip"] is None and got["steps"] is None and got["warmup"] == 5.0  # no clip; epochs: nfab's
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.2)
    assert recipe.trainer_recipe(args, sgd)["optimizer"]["name"] == "sgd"  # Trainer(optimizers=...) wins


def test_the_users_keywords_win_and_a_warmup_fraction_follows_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(api, "calibrate", lambda model, data, **kw: calls.append(kw))
    read = {"steps": 10, "batch_size": 8, "grad_clip": None, "schedule": {"name": "cosine"}, "warmup": 0.2}
    run("m", "d", dict(read, schedule={"name": "cosine"}), {"steps": 5, "batch_size": None, "out": None})
    assert calls[-1] == {"steps": 5, "batch_size": 8, "schedule": {"name": "cosine", "warmup_steps": 1}}
    run("m", "d", dict(read, schedule={"name": "cosine"}), {"schedule": "constant"})
    assert calls[-1]["schedule"] == "constant"


def test_lightning_optimizer_shapes_and_trainer_settings() -> None:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    for conf in (opt, [opt], ([opt], [object()]), {"optimizer": opt, "lr_scheduler": object()},
                 [{"optimizer": opt}]):
        assert _single(conf) is opt
    assert _single([opt, opt]) is None and _single(None) is None
    trainer = SimpleNamespace(accumulate_grad_batches=4, gradient_clip_val=0.5, gradient_clip_algorithm="value",
                              precision="bf16-mixed", max_steps=-1)
    assert trainer_settings(trainer) == {"accum_steps": 4, "precision": "bf16"}  # value clipping is not nfab's
    trainer.gradient_clip_algorithm, trainer.max_steps, trainer.precision = None, 50, "64-true"
    assert trainer_settings(trainer) == {"accum_steps": 4, "grad_clip": 0.5, "precision": None, "steps": 50}
