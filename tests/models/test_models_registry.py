"""Registry: errors, user `module:factory` models, and `model_signature`."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nfab.errors import ConfigError
from nfab.models import MODELS, build_model, model_signature

USER_MODULE = "nfab_test_user_models"
USER_SOURCE = """
import torch
from torch import nn


def mlp(*, hidden: int = 8, num_classes: int = 3):
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, hidden), nn.ReLU())
    model.add_module("head", nn.Linear(hidden, num_classes))
    return model


class TinyLM(nn.Module):
    task = "lm"
    vocab_size = 16
    block_size = 4
    head_modules = ("out",)

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, idx):
        return self.out(self.emb(idx))


def lm():
    return TinyLM()


def lm_without_vocab():
    return nn.Linear(2, 2)


def lm_by_options(*, vocab_size: int = 16, block_size: int = 4, width: int = 8):
    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))


def not_a_module():
    return 42


def broken():
    raise RuntimeError("boom")


NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / f"{USER_MODULE}.py").write_text(textwrap.dedent(USER_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, USER_MODULE, raising=False)
    return USER_MODULE


def test_registry_is_explicit() -> None:
    assert set(MODELS) == {"resnet18", "vit", "gpt"}


def test_unknown_model_and_option() -> None:
    with pytest.raises(ConfigError, match="unknown model 'resnet99'"):
        build_model("resnet99")
    with pytest.raises(ConfigError, match="unknown option 'depth'"):
        build_model("resnet18", depth=50)
    with pytest.raises(ConfigError, match="option width must be an integer, got \"16\""):
        build_model("resnet18", width="16")
    with pytest.raises(ConfigError, match="option small_input must be true or false, got 1"):
        build_model("resnet18", small_input=1)
    with pytest.raises(ConfigError, match="option small_input must be true or false, got \"false\""):
        build_model("resnet18", small_input="false")
    with pytest.raises(ConfigError, match="option width must be an integer, got 25.5"):
        build_model("resnet18", width=25.5)


def test_user_factory_with_options(user_module: str) -> None:
    spec = build_model(f"{user_module}:mlp", hidden=5, num_classes=4, seed=0)
    assert spec.task == "classification" and spec.optimizer == "sgd"
    assert spec.head_modules == ("head",)
    assert spec.module(torch.randn(2, 2, 2)).shape == (2, 4)
    with pytest.raises(ConfigError, match="unknown option 'depth'"):
        build_model(f"{user_module}:mlp", depth=3)


def test_user_lm_reads_attributes(user_module: str) -> None:
    spec = build_model(f"{user_module}:lm")
    assert spec.task == "lm" and spec.optimizer == "adamw"
    assert (spec.vocab_size, spec.block_size, spec.head_modules) == (16, 4, ("out",))


def test_user_task_option_overrides(user_module: str) -> None:
    spec = build_model(f"{user_module}:lm", task="classification")  # its model class says task = "lm"
    assert spec.task == "classification"
    with pytest.raises(ConfigError, match="must take vocab_size and block_size"):
        build_model(f"{user_module}:lm_without_vocab", task="lm")


def test_user_lm_takes_its_facts_from_the_options_it_was_built_with(user_module: str) -> None:
    """A factory taking `vocab_size=` / `block_size=` as options (train.md: the data set fills them in)
    was refused unless it also set them as attributes."""
    spec = build_model(f"{user_module}:lm_by_options", task="lm", vocab_size=32, block_size=8)
    assert (spec.vocab_size, spec.block_size) == (32, 8)
    with pytest.raises(ConfigError, match="task must be one of"):
        build_model(f"{user_module}:mlp", task="regression")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nfab_no_such_module_xyz:make", "cannot import 'nfab_no_such_module_xyz'"),
        (f"{USER_MODULE}:missing", "has no attribute 'missing'"),
        (f"{USER_MODULE}:NOT_CALLABLE", "is not callable"),
        (f"{USER_MODULE}:not_a_module", "returned int, not a torch.nn.Module"),
        (f"{USER_MODULE}:broken", "failed: RuntimeError: boom"),
        (f"{USER_MODULE}:", "must look like module.path:factory"),
    ],
)
def test_user_model_errors(user_module: str, target: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_model(target)
    assert "\n" not in str(info.value)


def test_user_model_on_meta(user_module: str) -> None:
    spec = build_model(f"{user_module}:mlp", device="meta")
    assert all(p.is_meta for p in spec.module.parameters())


def test_model_signature_depends_on_names_and_shapes_only() -> None:
    a = build_model("gpt", size="nano", seed=0).module
    b = build_model("gpt", size="nano", seed=1).module
    meta = build_model("gpt", size="nano", device="meta").module
    other = build_model("gpt", size="nano", block_size=32, device="meta").module
    sig = model_signature(a)
    assert len(sig) == 64 and int(sig, 16) >= 0
    assert sig == model_signature(b) == model_signature(meta)
    assert sig != model_signature(other)


def test_user_model_under_the_working_directory_is_importable(tmp_path, monkeypatch):
    """`nfab calibrate mymodels.net:build` from the folder that holds mymodels/, as `python -m` would find it."""
    import sys

    from nfab.models.registry import load_factory

    (tmp_path / "cwdmodels_probe").mkdir()
    (tmp_path / "cwdmodels_probe" / "__init__.py").write_text("def build():\n    return 'built'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_factory("cwdmodels_probe:build")() == "built"
