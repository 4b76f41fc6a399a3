"""`key=value` overrides: one parser for train, calibrate and inspect."""

import pytest

from nfab.errors import ConfigError
from nfab.overrides import clash, parse_kv, parse_value


@pytest.mark.parametrize("raw,value", [
    ("1e-3", 1e-3), ("3", 3), ("0.05", 0.05), ("true", True), ("null", None), ("none", "none"),
    ("[0.9, 0.95]", [0.9, 0.95]), ("stdlib-text", "stdlib-text"), ("", ""),
])
def test_values(raw, value):
    assert parse_value(raw) == value


def test_items_and_errors():
    assert parse_kv(["lr=1e-3", "model.width=8"]) == {"lr": 1e-3, "model.width": 8}
    with pytest.raises(ConfigError, match="key=value"):
        parse_kv(["lr"])


def test_clash_names_a_key_set_both_ways():
    taken = {"steps": "--steps", "comm.route": "--route"}
    assert clash(["steps=abc"], taken) == "'steps=abc' and --steps both set steps: give it once"
    assert clash(["comm={route: q8}"], taken) == "'comm={route: q8}' and --route both set comm.route: give it once"
    assert clash(["comm.cost_model=none", "model.width=8", "steps_x=1"], taken) is None
