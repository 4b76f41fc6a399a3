"""Checking builder options against the builder's own signature.

Registries map a name to a plain builder function with keyword-only options. The
signature is the single source of truth for which options exist and their types, so
an unknown key or a wrongly typed value is a `ConfigError` before anything is built.
Values are expected already converted (the CLI converts `key=value` strings).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Mapping

from nfab.errors import ConfigError


def accepted_options(builder: Callable[..., object]) -> tuple[str, ...] | None:
    """Names of the keyword options `builder` takes; None when it takes any (`**kwargs`)."""
    params = inspect.signature(builder).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _allowed_types(hint: object) -> tuple[type, ...] | None:
    """The runtime types a type hint admits, or None when it cannot be checked simply."""
    if hint is None or hint is type(None):
        return (type(None),)
    if isinstance(hint, type):
        return (hint, int) if hint is float else (hint,)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        allowed: list[type] = []
        for arg in typing.get_args(hint):
            sub = _allowed_types(arg)
            if sub is None:
                return None
            allowed.extend(sub)
        return tuple(allowed)
    return None


def check_options(what: str, builder: Callable[..., object], options: Mapping[str, object]) -> None:
    """Raise `ConfigError` for an option `builder` does not take or a value of the wrong type."""
    names = accepted_options(builder)
    if names is None:
        return
    unknown = sorted(set(options) - set(names))
    if unknown:
        listed = ", ".join(names) if names else "none"
        raise ConfigError(f"{what}: unknown option {unknown[0]!r} (options: {listed})")
    try:
        hints = typing.get_type_hints(builder)
    except Exception:  # unresolvable annotations in user code: skip type checks
        return
    for key, value in options.items():
        allowed = _allowed_types(hints.get(key))
        if allowed is None:
            continue
        # bool is an int subclass; `width=True` is a mistake, not a width of 1.
        bad_bool = isinstance(value, bool) and bool not in allowed
        if bad_bool or not isinstance(value, allowed):
            want = " | ".join(t.__name__ for t in allowed)
            raise ConfigError(f"{what}: option {key!r} must be {want}, got {value!r}")
