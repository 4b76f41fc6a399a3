"""The one route grammar: `sign`, `conv:sign,norm:fp32,*.bias:fp32`, or a mapping.

`nfab train --route`, `nfab inspect --route`, a config's `comm.route`, `nfab.attach(route=)`
and `Profile.static` all read a route through `parse_route`, so every spelling means
the same everywhere. A route is either one route name for every region, or a mapping
from region class or parameter-name glob to a route name (unnamed regions stay fp32).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import yaml

from nfab.errors import ConfigError
from nfab.wire.routes import ROUTES

REGIONS: tuple[str, ...] = ("conv", "linear", "embedding", "head", "norm", "bias", "small", "other")
"""Region classes a route may name (see runtime/bindings.py)."""

RouteSpec = str | dict[str, str]
"""A parsed route: one name for every region, or region/glob -> route name."""

_GLOB_CHARS = ("*", "?", "[", ".")


def is_glob(key: str) -> bool:
    """Whether a route key names parameters (a glob or a dotted name) rather than a region class."""
    return any(c in key for c in _GLOB_CHARS)


def check_route_name(route: Any, where: str = "route") -> str:
    """A known route name, else one `ConfigError` line listing the routes."""
    if not isinstance(route, str) or route not in ROUTES:
        raise ConfigError(f"{where}: unknown route {route!r} (routes: {', '.join(ROUTES)})")
    return route


def check_key(key: Any, where: str = "route") -> str:
    """A region class or a parameter-name glob; a bare word that is no region is a typo, not a glob."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{where}: a route key must be a region class or a parameter glob, got {key!r}")
    if key not in REGIONS and not is_glob(key):
        raise ConfigError(f"{where}: unknown region {key!r} (regions: {', '.join(REGIONS)}; "
                          "a parameter glob holds '*', '?', '[' or '.')")
    return key


def _parse_text(text: str) -> str | Mapping[str, Any]:
    text = text.strip()
    if not text:
        raise ConfigError("route must not be empty")
    if text.startswith("{"):
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"route {text!r} is not a valid mapping: {getattr(exc, 'problem', exc)}") from exc
        if not isinstance(value, dict):
            raise ConfigError(f"route {text!r} must map region or glob to route")
        return value
    if ":" in text or "," in text:
        pairs: dict[str, str] = {}
        for item in (p.strip() for p in text.split(",")):
            key, sep, route = item.rpartition(":")
            if not item or not sep or not key.strip():
                raise ConfigError(f"route {text!r}: {item!r} must look like region:route or glob:route")
            pairs[key.strip()] = route.strip()
        return pairs
    return text


def parse_route(value: Any, where: str = "route") -> RouteSpec:
    """Any accepted spelling of a route -> a route name or a checked region/glob -> route dict."""
    if isinstance(value, str):
        value = _parse_text(value)
    if isinstance(value, str):
        return check_route_name(value, where)
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"{where}: expected a route name or a non-empty mapping, got {value!r}")
    return {check_key(k, where): check_route_name(v, f"{where} {k!r}") for k, v in value.items()}


def format_route(route: RouteSpec) -> str:
    """The grammar's text form: `sign` or `conv:sign,*.bias:fp32` (for labels and summaries)."""
    if isinstance(route, str):
        return route
    return ",".join(f"{k}:{v}" for k, v in route.items())


def split_route(route: RouteSpec) -> tuple[dict[str, str], dict[str, str]]:
    """(routes per region class, routes per parameter glob) of a parsed route."""
    if isinstance(route, str):
        return {r: route for r in REGIONS}, {}
    return ({k: v for k, v in route.items() if k in REGIONS},
            {k: v for k, v in route.items() if k not in REGIONS})


def route_json(route: RouteSpec) -> str:
    """A stable text for a route (summary.json's `route` for a mapping)."""
    return route if isinstance(route, str) else json.dumps(route, sort_keys=True)
