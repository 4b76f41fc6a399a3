"""The config reference tables of docs/config.md, generated from the pydantic models.

`python -m bench.docs_tables` (`make docs-tables`) rewrites every block of docs/config.md between
`<!-- table: NAME -->` and `<!-- /table -->` from the models' fields: key, type, default and the
field's attribute docstring. `--check` rewrites nothing and exits 1 when a block is stale.
tests/test_docs_tables.py holds the key, type and default columns (and api.md's hand-written
`attach` and `StepStats` tables) to the code.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from nfab.calibrate.config import _ALIASES, CalibrationConfig
from nfab.config.run import (
    CommConfig,
    DataConfig,
    LaunchConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"
CONFIG_PAGE = DOCS / "config.md"
HEADER = "| key | type | default | meaning |\n| --- | --- | --- | --- |"
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)

SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "schedule": ScheduleConfig,
    "comm": CommConfig, "launch": LaunchConfig,
}
"""TrainConfig's sections, in the order the page lists them."""


def type_text(annotation: Any) -> str:
    """A field's type as a reader of a YAML file reads it: `int`, `str | None`, `auto | sgd | adamw`."""
    if annotation is type(None):
        return "None"
    if typing.get_origin(annotation) is Literal:
        return " | ".join(str(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is not None:
        args = typing.get_args(annotation)
        inner = ", ".join("..." if a is Ellipsis else type_text(a) for a in args)
        return f"{typing.get_origin(annotation).__name__}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def bounds_text(metadata: list[Any]) -> str:
    """The numeric bounds a field declares (`Field(ge=1)`), as `≥ 1`."""
    signs = {annotated_types.Ge: ("≥", "ge"), annotated_types.Gt: (">", "gt"),
             annotated_types.Le: ("≤", "le"), annotated_types.Lt: ("<", "lt")}
    parts = []
    for m in metadata:
        for kind, (sign, attr) in signs.items():
            if isinstance(m, kind):
                parts.append(f"{sign} {getattr(m, attr)}")
    return ", ".join(parts)


def yaml_text(value: Any) -> str:
    """A default as a YAML file writes it (`null`, `false`, `[0.9, 0.95]`, `measure`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value if value else '""'
    return str(value)


def default_text(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    return yaml_text(value)


def code(text: str) -> str:
    return f"`{text}`".replace("|", "\\|")


def field_rows(model: type[BaseModel], prefix: str = "", skip: tuple[str, ...] = ()) -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) for each of `model`'s fields, table cells already in markdown."""
    rows = []
    names = [n for n in model.model_fields if n not in skip]
    names.sort(key=lambda n: n == "options")  # an open section's builder options last, after its own keys
    for name in names:
        field = model.model_fields[name]
        bounds = bounds_text(field.metadata)
        kind = code(type_text(field.annotation)) + (f" {bounds}" if bounds else "")
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append((code(prefix + name), kind, code(default_text(field)), meaning))
    return rows


def tables() -> dict[str, list[tuple[str, str, str, str]]]:
    """Every generated table of docs/config.md by its block name."""
    out = {"train": field_rows(TrainConfig, skip=tuple(SECTIONS))}
    for section, model in SECTIONS.items():
        out[section] = field_rows(model, prefix=f"{section}.")
    out["calibrate"] = field_rows(CalibrationConfig, skip=("setting",))
    out["calibrate-aliases"] = [(code(k), "", code(v), "") for k, v in _ALIASES.items()]
    return out


def render(name: str, rows: list[tuple[str, str, str, str]]) -> str:
    if name == "calibrate-aliases":
        lines = ["| key | sets |", "| --- | --- |"] + [f"| {k} | {target} |" for k, _, target, _ in rows]
    else:
        lines = [HEADER] + ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def refresh(text: str) -> str:
    """`text` with every generated block rewritten; a block with an unknown name is an error."""
    generated = tables()

    def one(m: re.Match) -> str:
        name = m.group("name")
        if name not in generated:
            raise SystemExit(f"docs/config.md: no generated table named {name!r}")
        return m.group(1) + render(name, generated[name]) + m.group(4)

    return BLOCK.sub(one, text)


def main(argv: list[str]) -> int:
    text = CONFIG_PAGE.read_text()
    new = refresh(text)
    if "--check" in argv:
        if new != text:
            print("docs/config.md is stale: run `make docs-tables`", file=sys.stderr)
            return 1
        return 0
    CONFIG_PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
