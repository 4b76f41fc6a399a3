"""NFAB_FAULT parsing and the pre-launch world-size / capacity decision (in-process, fast)."""

from __future__ import annotations

import math

import pytest

from nfab.errors import ConfigError, NfabError
from nfab.profile.schema import Fallback, Profile, WorldRange
from nfab.train.fault import Fault, loss_factor, parse_faults
from nfab.train.launch import check_world


def test_every_kind_parses() -> None:
    faults = parse_faults("nan@step=2,rank=1; inf@step=4 ;spike@step=5,factor=10,steps=3;"
                          "slow@step=3,rank=1,seconds=2;hang@step=2,rank=1,attempt=1;crash@step=1")
    assert [f.kind for f in faults] == ["nan", "inf", "spike", "slow", "hang", "crash"]
    assert faults[1] == Fault("inf", 4, 0, 0)
    assert faults[2].rank is None and faults[2].steps == 3  # a spike hits every rank unless rank= is given
    assert faults[4].attempt == 1


def test_loss_factors() -> None:
    faults = parse_faults("nan@step=2,rank=1;inf@step=4;spike@step=5,factor=10,steps=2")
    assert math.isnan(loss_factor(faults, 2, 1)) and loss_factor(faults, 2, 0) is None
    assert loss_factor(faults, 4, 0) == math.inf and loss_factor(faults, 4, 1) is None
    assert [loss_factor(faults, s, r) for s in (4, 5, 6, 7) for r in (1,)] == [None, 10.0, 10.0, None]


@pytest.mark.parametrize("text, message", [
    ("spike@step=2", "needs factor=VALUE"),
    ("spike@step=2,factor=-1", "factor must be a positive float"),
    ("slow@step=2,rank=1", "needs seconds=VALUE"),
    ("nan@step=2,seconds=3", "unknown key(s) seconds for nan"),
    ("melt@step=2", "KIND in"),
    ("hang@rank=1", "needs step=K"),
])
def test_bad_fault_is_a_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_faults(text)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_world_size_and_capacity_warn_when_safe_and_refuse_when_strict() -> None:
    warnings: list[str] = []
    check_world(Profile.static("q2"), 4, "route", warnings.append)  # q2 lanes cannot hold 4 ranks
    assert warnings == ["route q2 cannot run exactly at W=4 (qsum: 2-bit lanes leave fewer than 2 levels per "
                        "rank): its regions fall back to fp32"]
    sign, q2 = Profile.static("sign"), Profile.static("q2")
    narrow = Profile(model=sign.model, phases=sign.phases, world_size=WorldRange(min=4, max=8))
    warnings.clear()
    check_world(narrow, 2, "profile p.json", warnings.append)
    assert len(warnings) == 1 and "valid for world sizes 4..8, this run has 2 ranks" in warnings[0]
    strict = Fallback(on_capacity="error")
    with pytest.raises(NfabError, match=r"this run has 2 ranks \(fallback.on_capacity is 'error'\)"):
        check_world(Profile(model=sign.model, phases=sign.phases, world_size=narrow.world_size, fallback=strict),
                    2, "profile p.json", warnings.append)
    with pytest.raises(NfabError, match=r"route q2 cannot run exactly at W=4 .*fallback.on_capacity is 'error'"):
        check_world(Profile(model=q2.model, phases=q2.phases, fallback=strict), 4, "route", warnings.append)
    check_world(sign, 2, "route", warnings.append)  # in range, within capacity: silent
    assert len(warnings) == 1
