"""Time to accuracy over several seeds: one side-by-side `nfab bench tta` run per seed, summarised.

Why: on a short, high-learning-rate recipe the step at which a run first reaches FP32's final
loss is chaotic. On resnet18 / digits (SGD momentum 0.9, lr 0.05, warm-up + cosine, 150 steps)
FP32 itself first reaches its own final loss at step 90, 140, 150, 140 or 110 depending on the
seed, and changing one phase's route on the first 10 steps of nfab's profile moved its step to
target from 100 to 120 or to "never" (2026-12-03, `--cost-model none`, no link). One seed
decides a 10% margin by luck; a median over seeds does not.

Each seed is a whole run with its own target (that seed's FP32 final loss), so a variant is
only ever compared with FP32 trained from the same seed. Over the seeds each variant gets:
how many seeds it reached its target in (`reached` of `runs`); the median time to target, where
a seed that never reached it counts as slower than any that did (None when that is the median);
and the median of its per-seed speed-ups against each base (a seed where the variant never reached
the target counts as 0x, one where only the base never did as unbounded).
"""

from __future__ import annotations

import math
import statistics
import sys
from typing import Any

import nfab
from nfab.errors import ConfigError
from nfab.report.tta import SEEDS_BASES, SEEDS_KIND


def parse_seeds(text: str) -> tuple[int, ...]:
    """`0,1,2` -> (0, 1, 2); `0-4` -> (0, 1, 2, 3, 4); one line and exit 2 on anything else."""
    seeds: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            lo, sep, hi = part.partition("-")
            seeds.extend(range(int(lo), int(hi) + 1) if sep else [int(part)])
    except ValueError:
        raise ConfigError(f"--seeds takes seeds like 0,1,2 or 0-4, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds needs distinct non-negative seeds, got {text!r}")
    return tuple(seeds)


def _time(v: dict[str, Any] | None) -> float:
    """A variant's time to target, +inf when it never reached it (or did not run)."""
    t = None if v is None else v.get("time_to_target_s")
    return math.inf if t is None else float(t)


def speedup(base: float, variant: float) -> float:
    """base's time / the variant's: 0 when only the variant never reached the target, inf when only
    the base never did, nan when neither did (no verdict)."""
    if math.isinf(variant):
        return math.nan if math.isinf(base) else 0.0
    return base / variant


def _finite(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def _ratio(x: float) -> float | str | None:
    """A per-seed speed-up for JSON: the number, "unbounded" (only the base never reached), None (neither did)."""
    return "unbounded" if math.isinf(x) else _finite(x)


def over_seeds(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant over the per-seed tta documents: reached, median time to target, median speed-ups."""
    names = list(dict.fromkeys(name for doc in docs for name in doc["variants"]))
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        times = [_time(doc["variants"].get(name)) for doc in docs]
        entry: dict[str, Any] = {
            "runs": len(docs),
            "reached": sum(math.isfinite(t) for t in times),
            "time_to_target_s": [_finite(t) for t in times],
            "median_time_to_target_s": _finite(statistics.median(times)),
        }
        for base in SEEDS_BASES:
            if base == name or not all(base in doc["variants"] for doc in docs):
                continue
            ratios = [speedup(_time(doc["variants"][base]), t) for doc, t in zip(docs, times, strict=True)]
            judged = [r for r in ratios if not math.isnan(r)]
            median = statistics.median(judged) if judged else math.nan
            entry[f"median_speedup_vs_{base}"] = _finite(median)
            entry[f"median_speedup_vs_{base}_unbounded"] = math.isinf(median)
            entry[f"speedup_vs_{base}"] = [_ratio(r) for r in ratios]
        out[name] = entry
    return out


def seeds_document(seeds: tuple[int, ...], docs: list[dict[str, Any]], command: str = "") -> dict[str, Any]:
    """The JSON for several seeds: the per-seed tta documents (`runs`) and `over_seeds`."""
    return {
        "kind": SEEDS_KIND,
        "nfab_version": nfab.__version__,
        "command": command or " ".join(sys.argv),
        "seeds": list(seeds),
        "over_seeds": over_seeds(docs),
        "runs": docs,
    }


def _spread(values: list[Any]) -> str:
    """Per-seed values as text: `1.54x, 0x, unbounded` (None: neither reached on that seed)."""
    return ", ".join("no verdict" if v is None else v if isinstance(v, str) else f"{v:.2f}x" for v in values)


def verdict(entry: dict[str, Any], base: str) -> str:
    """`sooner`, `slower`, `level` or `no verdict`: the median per-seed speed-up of a variant against base."""
    if entry.get(f"median_speedup_vs_{base}_unbounded"):
        return "sooner"
    r = entry.get(f"median_speedup_vs_{base}")
    if r is None:
        return "no verdict"
    return "sooner" if r > 1.0 else "slower" if r < 1.0 else "level"


def verdict_lines(over: dict[str, dict[str, Any]]) -> list[str]:
    """One line per variant over the seeds: how many seeds it reached its target in, the median time and
    the per-seed times, and against each base its verdict with the median and per-seed speed-ups."""
    lines = []
    for name, v in over.items():
        times = [t for t in v["time_to_target_s"] if t is not None]
        median = v["median_time_to_target_s"]
        head = (f"{name}: reached its target on {v['reached']} of {v['runs']} seeds; median time "
                + ("never (most seeds missed)" if median is None else f"{median:.1f} s")
                + (f" (reached in {min(times):.1f}-{max(times):.1f} s)" if times else ""))
        parts = []
        for base in SEEDS_BASES:
            if f"speedup_vs_{base}" not in v:
                continue
            r = v.get(f"median_speedup_vs_{base}")
            med = ("unbounded" if v.get(f"median_speedup_vs_{base}_unbounded")
                   else "-" if r is None else f"{r:.2f}x")
            parts.append(f"vs {base}: {verdict(v, base)} (median {med}; per seed {_spread(v[f'speedup_vs_{base}'])})")
        lines.append(head + ("; " + "; ".join(parts) if parts else ""))
    return lines
