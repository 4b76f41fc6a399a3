"""`key=value` overrides: one parser for train, calibrate and inspect."""

import pytest

from nfab.errors import ConfigError
from nfab.overrides import parse_kv, parse_value


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
