"""Shared CLI pieces: route strings (`key=value` parsing lives in nfab.overrides)."""

from __future__ import annotations

import json

from nfab.errors import ConfigError


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
