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


def clash(items: list[str], taken: dict[str, str]) -> str | None:
    """One line naming the first `key=value` item that sets a key an option sets too, else None.

    `taken` maps each dotted key an option set to that option (`{"steps": "--steps"}`); a whole
    section counts as each key in it (`comm={route: q8}` clashes with `--route`). One of the two
    would be dropped without a word: `steps=abc --steps 2` trained 2 steps and never said abc was
    no number, so the key must be given one way.
    """
    for item in items:
        key = item.partition("=")[0].strip()
        for other, option in taken.items():
            if key == other or other.startswith(key + ".") or key.startswith(other + "."):
                return f"{item!r} and {option} both set {other}: give it once"
    return None
