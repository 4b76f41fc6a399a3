"""Reading a run config: YAML file (path or shipped name) + dotted `key=value` overrides -> `TrainConfig`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from nfab.config.run import TrainConfig
from nfab.config.shipped import resolve_config
from nfab.errors import ConfigError
from nfab.overrides import parse_value
from nfab.validation import validate


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value parsed as YAML: numbers, bools, null, lists)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} must look like key=value (dotted keys for sections)")
    return key.split("."), parse_value(raw)


def set_dotted(data: dict[str, Any], keys: list[str], value: Any, item: str = "") -> None:
    """Set `a.b.c = value` in a nested mapping, creating sections as needed."""
    node = data
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {item or '.'.join(keys)!r}: {k!r} is not a section")
        node = nxt
    node[keys[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted `key=value` in a nested mapping (a copy)."""
    out = copy.deepcopy(data)
    for item in overrides:
        keys, value = parse_override(item)
        set_dotted(out, keys, value, item)
    return out


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: `top`'s keys win, sections merge key by key.

    A section that names another builder (`model: {name: vit}` over `model: {name: resnet18,
    width: 16}`) replaces the section: the other builder's options do not apply to it.
    """
    out = copy.deepcopy(base)
    for key, value in top.items():
        old = out.get(key)
        renamed = isinstance(old, dict) and isinstance(value, dict) and value.get("name", old.get("name")) != old.get(
            "name")
        if isinstance(value, dict) and isinstance(old, dict) and not renamed:
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file (a path or a shipped config's name) into a mapping (one-line errors)."""
    p = resolve_config(str(path))
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config {p} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {p} must hold a mapping, got {type(data).__name__}")
    return data


def config_from_dict(data: dict[str, Any], where: str = "") -> TrainConfig:
    """Validate a nested mapping strictly into a `TrainConfig` (one-line `ConfigError`)."""
    try:
        return validate(TrainConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}" if where else str(exc)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None, sections: dict[str, Any] | None = None) -> TrainConfig:
    """`base` mapping (or defaults), the config file merged over it, `sections` over that
    (`--model`/`--dataset`), then `key=value` overrides."""
    data = dict(base or {})
    if path is not None:
        data = merge(data, read_yaml(path))
    if sections:
        data = merge(data, sections)
    return config_from_dict(apply_overrides(data, list(overrides or [])))
