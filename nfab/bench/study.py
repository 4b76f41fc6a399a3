"""The study: nfab against FP32, bf16 DDP, fp16 and PowerSGD, quality per byte, in a user's training loop.

Every setting runs every variant (`studyspec.VARIANTS`) with the same model, data, seed,
optimizer and steps, one after another on this machine, then writes:
- OUT/study.json: the rows (schema `nfab.bench.study`, version 2) — the source of truth;
- OUT/study.md: the tables;
- OUT/report.html with one bytes-vs-quality (Pareto) plot per setting.
`--publish` also copies study.json to bench/study.json and regenerates the tables of
docs/study.md and the Pareto PNGs from it (`studydocs`), so no number is copied by hand.

The loop that trains and the held-out models live outside the installed package, in a
repository checkout (`bench/userloop.py`, `bench/heldout/`): `harness(root)` imports the loop
by its module path from there, and says in one line when there is no checkout.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from nfab.bench import studydocs
from nfab.bench.studyspec import SCHEMA, SETTINGS, VARIANTS, VERSION, RunResult, Setting
from nfab.bench.studyverdict import judge, main_rows, quality_delta, seed_spread
from nfab.errors import NfabError
from nfab.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text

__all__ = ["SETTINGS", "VARIANTS", "RunResult", "Setting", "StudyConfig", "harness", "judge", "main_rows",
           "quality_delta", "run_study", "seed_spread"]

HARNESS = "bench.userloop"
"""The user-loop harness, by module path from the repository root."""


def harness(root: Path | None = None) -> ModuleType:
    """`bench.userloop` from the checkout at `root` (default: the working directory), put on `sys.path`.

    Spawned ranks inherit `sys.path`, so they import the held-out models (`bench.heldout.*`) from
    there too. Outside a checkout: one `NfabError` naming what is missing."""
    root = (root or Path.cwd()).resolve()
    if not (root / "bench" / "userloop.py").is_file() or not (root / "bench" / "heldout" / "__init__.py").is_file():
        raise NfabError(f"nfab bench study runs from a repository checkout: no bench/userloop.py and "
                        f"bench/heldout/ under {root} (cd to the nfab repository root)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(HARNESS)


@dataclass(kw_only=True, slots=True)
class StudyConfig:
    """What to run."""

    out: Path = Path("bench/study")
    settings: tuple[str, ...] = tuple(SETTINGS)
    variants: tuple[str, ...] = VARIANTS
    steps: int | None = None
    """Steps for every setting (None: each setting's own)."""
    world_size: int | None = None
    """Ranks for every setting (None: each setting's own, 4)."""
    tweaks: dict[str, Any] = field(default_factory=dict)
    """Setting fields replaced in every setting (tests: smaller batches, tiny models)."""
    seeds: tuple[int, ...] = (0,)
    """Every (setting, variant) runs once per seed. The main tables show the study's own seed (the
    first of a new study, an appended study's own); `seed_table` shows the spread over all of them,
    each run paired with FP32 of its seed: at the 1% line one run's rounding noise (±0.3-0.5%) is
    of the order of the differences, so a verdict needs several."""
    append: bool = False
    """Merge into OUT/study.json: rows of other (setting, variant, seed) triples are kept (results do not
    depend on timing: same seeds, same rows); the commands that made them are all listed."""

    def __post_init__(self) -> None:
        bad = [s for s in self.settings if s not in SETTINGS]
        if bad:
            raise ValueError(f"unknown study setting {bad[0]!r} (known: {', '.join(SETTINGS)})")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"unknown study variant {bad[0]!r} (known: {', '.join(VARIANTS)})")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds must be distinct integers >= 0, got {list(self.seeds)}")
        for k, v in (("steps", self.steps), ("world_size", self.world_size)):
            if v is not None and v < 1:
                raise ValueError(f"{k} must be >= 1, got {v}")

    def setting(self, name: str) -> Setting:
        changes = dict(self.tweaks)
        if self.steps is not None:
            changes["steps"] = self.steps
        if self.world_size is not None:
            changes["world_size"] = self.world_size
        return dataclasses.replace(SETTINGS[name], **changes)


def _previous(cfg: StudyConfig) -> dict[str, Any] | None:
    """The study.json to append to (None when there is none yet)."""
    import json

    path = cfg.out / "study.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA or doc.get("version") != VERSION or not isinstance(doc.get("seed"), int):
        raise ValueError(f"{path} is not a version-{VERSION} study: cannot append to it")
    return doc


def run_study(cfg: StudyConfig, command: str = "", log: Callable[[str], None] = print,
              root: Path | None = None) -> dict[str, Any]:
    """Every setting x variant; writes OUT/study.json, OUT/study.md, OUT/report.html and the Pareto PNGs."""
    run_variants = harness(root).run_variants
    cfg.out.mkdir(parents=True, exist_ok=True)
    old = _previous(cfg) if cfg.append else None  # checked before hours of runs, not after
    t0 = time.perf_counter()
    rows: list[RunResult] = []
    settings = {name: cfg.setting(name) for name in cfg.settings}
    for name, setting in settings.items():
        for seed in cfg.seeds:
            for row in run_variants(setting, cfg.variants, seed=seed, root=root):
                log(f"{name} {row.variant} seed {seed}: " + (
                    f"loss {row.eval_loss:.4f}, {row.ratio:.1f}x" if row.ok and row.ratio else f"FAILED {row.error}")
                    + f" ({row.wall_s:.0f} s)")
                rows.append(row)
    primary = old["seed"] if old else cfg.seeds[0]
    new_rows = [asdict(r) for r in rows]
    done = {(r["setting"], r["variant"], r["seed"]) for r in new_rows}
    kept = [{**r, "seed": r.get("seed", primary)} for r in (old or {}).get("rows", [])]
    kept = [r for r in kept if (r["setting"], r["variant"], r["seed"]) not in done]
    order = {(n, v): i for i, (n, v) in enumerate((n, v) for n in SETTINGS for v in VARIANTS)}
    doc: dict[str, Any] = {
        "schema": SCHEMA, "version": VERSION,
        "command": " ; ".join([*([old["command"]] if old else []), command]),
        "total_s": round(time.perf_counter() - t0 + (old["total_s"] if old else 0.0), 1),
        "seed": primary,
        "settings": {**(old or {}).get("settings", {}), **{name: asdict(s) for name, s in settings.items()}},
        "note": "one user-style DDP loop per run (constant LR unless the setting line says otherwise), W gloo "
                "ranks on loopback, same seed for every variant; nfab variants attach with cost_model=None (on "
                "loopback the cost gate would send every bucket to FP32); PowerSGD gets one bucket (it aborts on "
                "gloo with several)",
        "rows": sorted(kept + new_rows, key=lambda r: (order.get((r["setting"], r["variant"]), 1 << 30), r["seed"])),
    }
    doc["settings"] = {n: doc["settings"][n] for n in SETTINGS if n in doc["settings"]}
    doc["verdicts"] = judge(doc)
    atomic_write_json(cfg.out / "study.json", doc)
    atomic_write_text(cfg.out / "study.md", studydocs.study_markdown(doc, images=True))
    for name in settings:
        atomic_write_bytes(cfg.out / f"pareto_{name}.png", studydocs.pareto_png(doc, name))
    atomic_write_text(cfg.out / "report.html", studydocs.report_html(doc))
    return doc
