"""`key=value` overrides from the command line, parsed one way everywhere.

Values are numbers first (so `lr=1e-3` is a float: PyYAML alone would read it as a
string), then YAML scalars and lists (`true`, `null`, `[0.9, 0.95]`), else the text
(`none` stays the word: `comm.cost_model=none` names a choice).
"""

from __future__ import annotations

from typing import Any

import yaml

from nfab.errors import ConfigError


def parse_value(raw: str) -> Any:
    """One override value: int, float, YAML (bool, null, list, dict) or the plain text."""
    text = raw.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        return raw


def split_item(item: str) -> tuple[str, Any]:
    """`key=value` -> (key, parsed value); a malformed item is a `ConfigError`."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"expected key=value, got {item!r}")
    return key.strip(), parse_value(raw)


def parse_kv(items: list[str]) -> dict[str, Any]:
    """`["width=16", "lr=1e-3"]` -> {"width": 16, "lr": 0.001}."""
    return dict(split_item(item) for item in items)
