"""The study: nfab against FP32, bf16 DDP, fp16 and PowerSGD, quality per byte, in a user's training loop.

    python -m bench.study --out bench/study --publish          # every setting x variant (`make study`)
    python -m bench.study --settings heldout3 --variants fp32,profile --seeds 0,1,2
    python -m bench.study --regen-docs                        # docs/study.md and the PNGs from bench/study.json

Run from the repository root (or with it on `PYTHONPATH`): the study lives beside the loop it trains
in (`bench.userloop`) and the held-out models (`bench/heldout/`), none of them installed. Every
setting runs every variant (`studyspec.VARIANTS`) with the same model, data, seed, optimizer and
steps, one after another on this machine, then writes:
- OUT/study.json: the rows (schema `nfab.bench.study`, version 2) — the source of truth;
- OUT/study.md: the tables;
- OUT/report.html with one bytes-vs-quality (Pareto) plot per setting.
`--publish` also copies study.json to bench/study.json and regenerates the tables of
docs/study.md and the Pareto PNGs from it (`studydocs`), so no number is copied by hand.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import studydocs
from bench.studyspec import SCHEMA, SETTINGS, VARIANTS, VERSION, RunResult, Setting
from bench.studyverdict import judge, main_rows, quality_delta, seed_spread
from nfab.errors import NfabError
from nfab.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text

__all__ = ["SETTINGS", "VARIANTS", "RunResult", "Setting", "StudyConfig", "judge", "main", "main_rows",
           "quality_delta", "run_study", "seed_spread"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the settings' profiles (`bench/calibrations/...`) and the published files are under it."""


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
    """Every setting x variant; writes OUT/study.json, OUT/study.md, OUT/report.html and the Pareto PNGs.
    `root`: where the settings' profile paths resolve (default: this checkout)."""
    from bench.userloop import run_variants  # torch and the ranks: only when something runs

    root = root or ROOT
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


def _names(text: str | None, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A comma-separated subset of `known` (None: all of it)."""
    if text is None:
        return known
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown study {what} {bad[0]!r} (known: {', '.join(known)})")
    return names


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must be distinct integers >= 0, got {text!r}")
    return seeds


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    """Quality and gradient bytes of every variant, side by side, with a bytes-vs-quality plot."""
    root = root or ROOT
    ap = argparse.ArgumentParser(prog="python -m bench.study", description=main.__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench/study"),
                    help="folder for study.json/.md, report.html and the Pareto PNGs (default: bench/study)")
    ap.add_argument("--settings", default=None, help=f"comma-separated subset of {','.join(SETTINGS)} (default: all)")
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="steps for every setting (default: each its own)")
    ap.add_argument("--world-size", "-w", type=int, default=None, help="gloo ranks for every setting (default 4)")
    ap.add_argument("--publish", action="store_true", help="copy study.json to bench/study.json, regenerate "
                    "docs/study.md's tables and the Pareto PNGs from it")
    ap.add_argument("--append", action="store_true",
                    help="merge into OUT/study.json, keeping its rows of other settings/variants/seeds")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds: every setting x variant runs once per "
                    "seed; the tables show the first (an appended study's own), an across-seed table the spread")
    ap.add_argument("--regen-docs", action="store_true",
                    help="only regenerate docs/study.md's tables and the PNGs from bench/study.json")
    a = ap.parse_args(argv)
    try:
        if a.regen_docs:
            print("regenerated " + ", ".join(str(p) for p in studydocs.regen_docs(root)))
            return 0
        cfg = StudyConfig(out=a.out, settings=_names(a.settings, tuple(SETTINGS), "setting"),
                          variants=_names(a.variants, VARIANTS, "variant"), steps=a.steps, world_size=a.world_size,
                          seeds=_seeds(a.seeds), append=a.append)
        for s in cfg.settings:
            prof = SETTINGS[s].profile
            if prof is not None and not (root / prof).is_file() and any(v.startswith("profile") for v in cfg.variants):
                raise ValueError(f"{prof} not found under {root} (calibrate {s} first)")
        command = shlex.join(["python", "-m", "bench.study", *(sys.argv[1:] if argv is None else argv)])
        doc = run_study(cfg, command=command, root=root)
    except (ValueError, NfabError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print((a.out / "study.md").read_text())
    print(f"wrote {a.out / 'study.json'}, {a.out / 'study.md'}, {a.out / 'report.html'}")
    if a.publish:
        shutil.copyfile(a.out / "study.json", root / studydocs.STUDY_JSON)
        written = studydocs.regen_docs(root)
        print("published " + ", ".join(str(p) for p in [root / studydocs.STUDY_JSON, *written]))
    if any(not r["ok"] for r in doc["rows"]):
        print("error: some study runs failed (see study.md)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
