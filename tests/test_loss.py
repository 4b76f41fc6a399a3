"""nfab.loss: the contract between a batch, a model and the scalar a step minimises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nfab.errors import ConfigError, UserCodeError
from nfab.loss import batch_size_of, carried_loss, default_loss, resolve_loss, takes_target, to_device


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class WithTargets(Classifier):
    """nanoGPT's shape: forward(idx, targets) -> (logits, loss)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):  # type: ignore[override]
        logits = self.fc(x)
        return logits, None if targets is None else F.cross_entropy(logits, targets) * 2  # *2: its own loss


class DictModel(Classifier):
    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):  # type: ignore[override]
        logits = self.fc(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels) * 3
        return out


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)


def test_default_loss_follows_the_contract_table() -> None:
    x, y = _batch()
    plain = Classifier()
    assert torch.equal(default_loss(plain, (x, y)), F.cross_entropy(plain(x), y))
    own = WithTargets()
    own.load_state_dict(plain.state_dict())
    assert takes_target(own) and not takes_target(plain)
    assert torch.equal(default_loss(own, (x, y)), 2 * F.cross_entropy(plain(x), y))  # the model's own loss
    d = DictModel()
    d.load_state_dict(plain.state_dict())
    assert torch.equal(default_loss(d, {"x": x, "labels": y}), 3 * F.cross_entropy(plain(x), y))
    with pytest.raises(ConfigError, match="no 'labels'"):
        default_loss(d, {"x": x})


def test_a_language_models_logits_take_cross_entropy_per_token() -> None:
    logits = torch.randn(2, 5, 7)
    target = torch.randint(0, 7, (2, 5))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return logits + self.w

    got = default_loss(LM(), (torch.zeros(2, 5), target))
    assert torch.equal(got, F.cross_entropy(logits.flatten(0, 1), target.flatten()))


def test_carried_loss_reads_tuples_mappings_and_model_outputs() -> None:
    from transformers.modeling_outputs import CausalLMOutput

    loss = torch.tensor(1.5)
    logits = torch.randn(2, 3)
    assert carried_loss((logits, loss)) is loss and carried_loss((loss, logits)) is loss
    assert carried_loss({"loss": loss, "logits": logits}) is loss
    assert carried_loss(CausalLMOutput(loss=loss, logits=logits)) is loss
    assert carried_loss(CausalLMOutput(logits=logits)) is None
    assert carried_loss((logits, None)) is None and carried_loss(logits) is None


def test_a_regression_target_without_a_loss_is_one_line_naming_the_flag() -> None:
    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    with pytest.raises(ConfigError, match=r"give the loss \(--loss module.path:fn") as info:
        default_loss(Regressor(), (torch.randn(3, 4), torch.randn(3)))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="carries no target"):
        default_loss(Regressor(), torch.randn(3, 4))


def test_a_user_loss_that_raises_is_one_line_naming_it() -> None:
    def broken(model: nn.Module, batch: object) -> torch.Tensor:
        raise KeyError("pixel_values")

    with pytest.raises(UserCodeError, match=r"loss (tests.)?test_loss:.*broken raised KeyError: 'pixel_values'"):
        resolve_loss(broken)(Classifier(), _batch())
    with pytest.raises(ConfigError, match="must return a scalar tensor, got"):
        resolve_loss(lambda m, b: m(b[0]))(Classifier(), _batch())
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        resolve_loss(f"{__name__}:nope")
    assert resolve_loss(f"{__name__}:mse_on_first")(Classifier(), _batch()).dim() == 0


def mse_on_first(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0]).pow(2).mean()


def test_to_device_and_batch_size_keep_the_structure() -> None:
    batch = {"a": torch.zeros(3, 2), "b": (torch.ones(3), [torch.ones(3, 1)])}
    moved = to_device(batch, torch.device("meta"))
    assert moved["a"].device.type == "meta" and moved["b"][1][0].device.type == "meta"
    assert isinstance(moved["b"], tuple) and batch_size_of(batch) == 3
