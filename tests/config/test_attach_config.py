"""`AttachConfig`: `nfab.attach`'s options as one typed record, the same whether given as keywords or as `config=`."""

from __future__ import annotations

import inspect

import pytest
import torch

import nfab
from nfab.config.attach import AttachConfig
from nfab.errors import ConfigError, NfabError


def test_keywords_over_a_config_win_and_the_config_keeps_what_was_set() -> None:
    cfg = AttachConfig(route="conv:sign,*.bias:fp32", cost_model=None, seed=3)
    assert cfg.route == {"conv": "sign", "*.bias": "fp32"}  # kept parsed, as the train config keeps it
    merged = AttachConfig.of(cfg, seed=5, qsum_scale="delayed")
    assert (merged.seed, merged.qsum_scale, merged.cost_model, merged.route) == (5, "delayed", None, cfg.route)
    assert AttachConfig.of(cfg) is cfg and AttachConfig.of() == AttachConfig()
    assert AttachConfig.of(None, route="sign") == AttachConfig(route="sign")


def test_what_a_framework_knows_fills_only_the_options_the_user_left_unset() -> None:
    model = torch.nn.Linear(2, 2)
    mine, theirs = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.AdamW(model.parameters())
    user = AttachConfig(route="sign", optimizer=mine, total_steps=None)  # None set on purpose: kept
    filled = user.unless_set(total_steps=100, optimizer=theirs, loss_scaler=torch.amp.GradScaler("cpu"))
    assert filled.optimizer is mine and filled.total_steps is None and filled.loss_scaler is not None
    assert AttachConfig(route="sign").unless_set(total_steps=100, optimizer=theirs).optimizer is theirs


def test_a_frameworks_optimizer_wrapper_is_unwrapped() -> None:
    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    class Wrapper(torch.optim.Optimizer):  # as Accelerate's AcceleratedOptimizer: `.optimizer` acts
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    assert AttachConfig(optimizer=Wrapper(inner)).optimizer is inner


@pytest.mark.parametrize(("options", "line"), [
    ({"seed": True}, "seed must be an int, got True"),
    ({"error_feedback": "on"}, "error_feedback must be 'auto', True or False, got 'on'"),
    ({"qsum_scale": "late"}, "qsum_scale must be one of delayed, exact, got 'late'"),
    ({"total_steps": 0}, "total_steps must be a positive integer, got 0"),
    ({"hierarchy": "8y8"}, "hierarchy must be 'auto', 'flat'"),
    ({"cost_model": "link:fast"}, "cost model 'link:fast': bandwidth 'fast'"),
    ({"route": "q3"}, "route: unknown route 'q3'"),
    ({"optimizer": "adam"}, "optimizer must be a torch.optim.Optimizer, got str"),
    ({"coalesce": "yes"}, 'coalesce must be true or false, got "yes"'),
    ({"noise_moment": True}, "noise_moment=True needs optimizer="),
    ({"find_unused_parameters": True}, "nfab.attach has no option 'find_unused_parameters' (options: route, "),
])
def test_a_bad_option_is_one_line_naming_it(options: dict, line: str) -> None:
    with pytest.raises(ConfigError) as info:
        AttachConfig(**options)
    assert str(info.value).startswith(line) and "\n" not in str(info.value)
    with pytest.raises(NfabError, match="^" + line[:20]):  # attach refuses it before it looks at the model
        nfab.attach(object(), **{"route": "bq2", **options})


def test_attach_takes_a_config_or_the_same_keywords() -> None:
    with pytest.raises(NfabError, match="config must be an nfab AttachConfig, got dict"):
        nfab.attach(object(), config={"route": "bq2"})
    params = inspect.signature(nfab.attach).parameters
    assert list(params) == ["ddp_model", "profile", "config", "options"]
    assert set(AttachConfig.model_fields) >= {"route", "optimizer", "total_steps", "cost_model", "loss_scaler"}
    assert all(f.description for f in AttachConfig.model_fields.values()), "every option has its docstring"
