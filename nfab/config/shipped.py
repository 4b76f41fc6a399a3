"""Shipped configs and calibrations, found by name whether nfab is cloned or installed.

A wheel carries `configs/*.yaml` and `calibrations/*/profile.json` as package data
(`nfab/shipped/...`); a checkout has them at the repository root. `--config
gpt-nano-stdlib` and `--profile resnet18` resolve to them; a path that exists always wins.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

from nfab.errors import ConfigError, ProfileError
from nfab.profile.schema import Profile

Kind = Literal["configs", "calibrations"]

DEFAULT_CONFIGS: dict[str, str] = {
    "resnet18": "resnet18-digits",
    "vit": "vit-digits",
    "gpt": "gpt-nano-stdlib",
}
"""The shipped config `nfab calibrate MODEL` starts from for each registered model."""


def shipped_dir(kind: Kind) -> Path | None:
    """Where the shipped `kind` lives: the wheel's package data, else the checkout's root folder."""
    try:
        packaged = Path(str(resources.files("nfab") / "shipped" / kind))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - nfab is always importable here
        packaged = None
    if packaged is not None and packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / kind
    return checkout if checkout.is_dir() else None


def shipped_names(kind: Kind) -> list[str]:
    """Names that resolve: config stems, or calibration folders holding a profile.json."""
    root = shipped_dir(kind)
    if root is None:
        return []
    if kind == "configs":
        return sorted(p.stem for p in root.glob("*.yaml"))
    return sorted(p.parent.name for p in root.glob("*/profile.json"))


def _is_name(text: str) -> bool:
    return "/" not in text and "\\" not in text and not text.endswith((".yaml", ".yml", ".json"))


def resolve_config(text: str) -> Path:
    """A config path, or the name of a shipped config (`gpt-nano-stdlib`)."""
    path = Path(text)
    if path.exists() or not _is_name(text):
        return path
    root = shipped_dir("configs")
    if root is not None and (root / f"{text}.yaml").is_file():
        return root / f"{text}.yaml"
    raise ConfigError(f"no config file {text!r} and no shipped config of that name "
                      f"(shipped: {', '.join(shipped_names('configs')) or 'none'})")


def resolve_profile(text: str) -> Path:
    """A profile path, or the name of a shipped calibration (`resnet18`)."""
    path = Path(text)
    if path.exists() or not _is_name(text):
        return path
    root = shipped_dir("calibrations")
    if root is not None and (root / text / "profile.json").is_file():
        return root / text / "profile.json"
    raise ProfileError(f"no profile file {text!r} and no shipped profile of that name "
                       f"(shipped: {', '.join(shipped_names('calibrations')) or 'none'})")


def load_profile(profile: str | Path | Profile) -> Profile:
    """A `Profile` as given, or loaded from a path or a shipped name (what `attach` and the adapters take)."""
    return profile if isinstance(profile, Profile) else Profile.load(resolve_profile(str(profile)))
