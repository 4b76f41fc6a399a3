"""Shared CLI pieces: `key=value` parsing for model/data options and route strings."""

from __future__ import annotations

import json
from typing import Any

import yaml

from nfab.errors import ConfigError


def parse_kv(items: list[str]) -> dict[str, Any]:
    """`["width=16", "small_input=true"]` -> {"width": 16, "small_input": True} (YAML scalars)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected key=value, got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"cannot parse value of {key!r}: {exc}") from exc
    return out


def parse_route(text: str) -> str | dict[str, str]:
    """A route name (`sign`), or a JSON object / `region:route,glob:route` list."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"route {text!r} is not valid JSON: {exc.msg}") from exc
        if not isinstance(value, dict):
            raise ConfigError("a route object must map region or glob to route")
        return {str(k): str(v) for k, v in value.items()}
    if ":" in text:
        pairs = [p.split(":", 1) for p in text.split(",") if p]
        return {k.strip(): v.strip() for k, v in pairs}
    return text
