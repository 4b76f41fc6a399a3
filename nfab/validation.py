"""Strict, typed validation at the boundary: one pydantic base and one-line errors.

Every file a user writes (train configs, profiles, model and data options, bench
configs) is validated here, once, by pydantic v2 in strict mode: `"false"` is not a
bool, `25.5` is not an int, and an unknown key is an error. Input is validated as JSON
(YAML and override values are JSON-shaped), so a list is a tuple and an int a float,
as a person writing a file means them.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from nfab.errors import ConfigError, NfabError

M = TypeVar("M", bound=BaseModel)
D = TypeVar("D")


STRICT_DATACLASS = ConfigDict(extra="forbid")
"""`__pydantic_config__` of a plain dataclass validated by `validate_dataclass`."""


class StrictModel(BaseModel):
    """Base of every typed config: unknown keys are errors; values are checked on assignment too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class FrozenModel(BaseModel):
    """An immutable typed record (profiles): unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _located(loc: tuple[int | str, ...], where: str) -> str:
    """`_path(loc)` under `where` (the file or section the data came from), as the error line shows it."""
    path = _path(loc)
    return f"{where}.{path}" if where and path else where or path


_EXPECTED = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "dataclass_type": "a mapping",
}


def _known_keys(cls: type[BaseModel] | None, loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the (sub-)model an unknown key at `loc` was found in."""
    for part in loc[:-1]:
        if cls is None or isinstance(part, int):
            continue
        field = cls.model_fields.get(part)
        if field is None:
            return []
        inner = field.annotation
        args = getattr(inner, "__args__", ())
        candidates = [a for a in (inner, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
        cls = candidates[0] if candidates else None
    return sorted(cls.model_fields) if cls is not None else []


_UNION_TYPES = ("bool", "int", "float", "str", "none")
_UNION_PREFIXES = ("literal[", "list[", "dict[", "tuple[", "function-")


def _union_tag(part: int | str) -> bool:
    """Whether a location part is pydantic's name of a union member (`bool`, `literal['auto']`), not a key."""
    return isinstance(part, str) and (part in _UNION_TYPES or part.startswith(_UNION_PREFIXES))


def _alternatives(errors: list[Any], where: str) -> str | None:
    """One line for a value that matched none of a union's members (`true`, `false` or `'auto'`): pydantic
    reports one error per member, at `field.bool`, `field.literal['auto']`, ..."""
    locs = [tuple(e["loc"]) for e in errors]
    if len(errors) < 2 or len({loc[:-1] for loc in locs}) != 1 or not all(loc and _union_tag(loc[-1]) for loc in locs):
        return None
    wanted = [_EXPECTED.get(e["type"]) or (e.get("ctx") or {}).get("expected") or str(e["msg"]).lower()
              for e in errors]
    return f"{_located(locs[0][:-1], where)} must be {' or '.join(wanted)}, got {_shown(errors[0].get('input'))}"


def describe(exc: ValidationError, where: str = "", cls: type[BaseModel] | None = None) -> str:
    """One line for a validation error: field path, what was expected, what was given."""
    errors = exc.errors(include_url=False)
    if (merged := _alternatives(errors, where)) is not None:
        return merged
    first = errors[0]
    path = _located(tuple(first["loc"]), where)
    kind = first["type"]
    given = first.get("input")
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        known = _known_keys(cls, tuple(first["loc"]))
        text = f"unknown key {path!r}" + (f" (keys: {', '.join(known)})" if known else "")
    elif kind == "missing":
        text = f"{path}: required, not given"
    elif kind in _EXPECTED:
        text = f"{path} must be {_EXPECTED[kind]}, got {_shown(given)}"
    else:
        msg = str(first["msg"]).removeprefix("Value error, ")
        msg = msg[0].lower() + msg[1:] if msg else msg
        shown = f" (got {_shown(given)})" if kind != "value_error" and _jsonable(given) else ""
        text = (f"{path}: {msg}" if path else msg) + shown
    more = len(errors) - 1
    return text + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def _shown(value: Any, limit: int = 60) -> str:
    """A given value as the user wrote it (JSON), cut to one short piece of a line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def validate(cls: type[M], data: Any, *, where: str = "", error: type[NfabError] = ConfigError) -> M:
    """Validate JSON-shaped `data` (a mapping from YAML, JSON or overrides) strictly into `cls`."""
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise error(f"{where or 'config'}: not plain data ({exc})") from exc
    try:
        return cls.model_validate_json(text, strict=True)
    except ValidationError as exc:
        raise error(describe(exc, where, cls)) from None


def validate_dataclass(cls: type[D], data: Any, *, where: str = "", error: type[NfabError] = ConfigError) -> D:
    """`validate` for a plain typed dataclass (records that cross into spawned ranks as JSON).

    The dataclass refuses unknown keys by declaring `__pydantic_config__ = STRICT_DATACLASS`.
    """
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise error(f"{where or 'config'}: not plain data ({exc})") from exc
    try:
        return TypeAdapter(cls).validate_json(text, strict=True)
    except ValidationError as exc:
        raise error(describe(exc, where)) from None
