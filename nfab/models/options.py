"""Checking builder options against the builder's own signature, strictly (pydantic).

Registries map a name to a plain builder function with keyword-only options. The
signature is the single source of truth for which options exist and their types: a
pydantic model is made from it once per builder, so an unknown key or a wrongly typed
value (`"false"` for a bool, `25.5` for an int) is a one-line `ConfigError` before
anything is built. Values are JSON-shaped (YAML, JSON, `key=value` overrides).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from nfab.errors import ConfigError
from nfab.validation import validate

_SKIP = ("split", "seed")
"""Options a registry passes itself (data sets), never taken from a user."""


def accepted_options(builder: Callable[..., object]) -> tuple[str, ...] | None:
    """Names of the keyword options `builder` takes; None when it takes any (`**kwargs`)."""
    params = inspect.signature(builder).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


@functools.cache
def options_model(builder: Callable[..., object]) -> type[BaseModel] | None:
    """A strict pydantic model of `builder`'s keyword options (None when it takes `**kwargs`)."""
    names = accepted_options(builder)
    if names is None:
        return None
    try:
        hints = typing.get_type_hints(builder)
    except Exception:  # unresolvable annotations in user code: names are still checked
        hints = {}
    params = inspect.signature(builder).parameters
    fields: dict[str, Any] = {}
    for name in names:
        if name in _SKIP:
            continue
        default = params[name].default
        fields[name] = (hints.get(name, Any), ... if default is inspect.Parameter.empty else default)
    config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    return create_model(f"{getattr(builder, '__name__', 'builder')}_options", __config__=config, **fields)


def check_options(what: str, builder: Callable[..., object], options: Mapping[str, object]) -> None:
    """Raise `ConfigError` for an option `builder` does not take or a value of the wrong type."""
    model = options_model(builder)
    if model is None:
        return
    names = [n for n in model.model_fields]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigError(f"{what}: unknown option {unknown[0]!r} (options: {', '.join(names) or 'none'})")
    try:
        validate(model, dict(options))
    except ConfigError as exc:
        raise ConfigError(f"{what}: option {exc}") from None
