"""Time-to-accuracy results (`nfab bench tta --json`): read, tabulate, plot loss against wall time.

A tta JSON is recognised by its `"kind": "nfab.bench.tta"`; its contract (the keys read
here) lives in this module alone. The table gives each variant's time to the target (FP32's
smoothed final validation loss + 2%, its `target_rule`), the speed-up against FP32 and against
bf16 DDP (the honest baseline), and the gradient bytes it sent until then; the plot draws every
variant's evaluation points as validation loss against training wall time, with the target as a line.
"""

from __future__ import annotations

import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from nfab.errors import NfabError
from nfab.report.tables import MB

TTA_KIND = "nfab.bench.tta"
SEEDS_KIND = "nfab.bench.tta.seeds"
"""`nfab bench tta --seeds`: the per-seed documents under `runs`, their summary under `over_seeds`."""
SEEDS_BASES: tuple[str, ...] = ("fp32", "bf16", "powersgd")
"""The variants every other is compared with over the seeds (those that ran)."""
SEEDS_COLUMNS = ("variant", "reached", "median_time_to_target_s", *(f"median_speedup_vs_{b}" for b in SEEDS_BASES))
VARIANT_KEYS = ("time_to_target_s", "steps_to_target", "steps", "final_loss", "wire_bytes", "curve")
CURVE_KEYS = ("step", "time_s", "val_loss")
COLUMNS = ("variant", "time_to_target_s", "steps_to_target", "steps", "speedup_vs_fp32", "speedup_vs_bf16",
           "final_loss", "wire_mb_to_target")


@dataclass(frozen=True, slots=True)
class TtaArtifact:
    """One tta JSON: its name in the report, the target, and each variant's result."""

    name: str
    path: Path
    target_loss: float
    variants: dict[str, dict[str, Any]]
    link: str
    model: str
    recipe: str = ""
    """What every variant trained with, in one line (`recipe_text`)."""
    over_seeds: dict[str, dict[str, Any]] | None = None
    """On the first seed's artifact of an `nfab bench tta --seeds` file: the summary over its seeds."""
    series: str | None = None
    """The `--seeds` file's name, on each of its seeds' artifacts (None: a one-run file)."""
    target_rule: str = "FP32's final validation loss"
    """How the target was set (the JSON's `target_rule`; files before it: FP32's exact final loss)."""


def is_tta(path: Path) -> bool:
    """Is `path` a JSON file written by `nfab bench tta` (its `kind`)?"""
    if not (path.is_file() and path.suffix == ".json"):
        return False
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("kind") in (TTA_KIND, SEEDS_KIND)


def load_ttas(path: Path, name: str) -> list[TtaArtifact]:
    """Read and check a tta JSON: one artifact, or one per seed of a `--seeds` file (the first carrying
    the summary over the seeds); a missing key is one `NfabError` naming the file."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("kind") != SEEDS_KIND:
            return [_artifact(path, name, doc)]
        seeds, runs, over = doc["seeds"], doc["runs"], doc["over_seeds"]
        if not runs or len(seeds) != len(runs):
            raise NfabError(f"{path}: {len(seeds)} seeds but {len(runs)} runs")
        arts = [dataclasses.replace(_artifact(path, f"{name} seed {s}", run), series=name)
                for s, run in zip(seeds, runs, strict=True)]
        return [dataclasses.replace(arts[0], over_seeds=over), *arts[1:]]
    except KeyError as exc:
        raise NfabError(f"{path}: not a complete nfab bench tta JSON (no {exc.args[0]!r})") from None
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise NfabError(f"{path}: unreadable tta JSON ({exc})") from None


def seeds_table(over: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per variant over the seeds: reached k of n, median time to target, median speed-ups
    ("unbounded" where the median seed's base never reached its target)."""
    def x(v: dict[str, Any], base: str) -> str | None:
        if v.get(f"median_speedup_vs_{base}_unbounded"):
            return "unbounded"
        r = v.get(f"median_speedup_vs_{base}")
        return None if r is None else f"{r:.2f}x"
    rows = [{"variant": name, "reached": f"{v['reached']} / {v['runs']}",
             "median_time_to_target_s": v["median_time_to_target_s"],
             **{f"median_speedup_vs_{b}": x(v, b) for b in SEEDS_BASES}}
            for name, v in over.items()]
    return pd.DataFrame(rows, columns=list(SEEDS_COLUMNS))


def _artifact(path: Path, name: str, doc: dict[str, Any]) -> TtaArtifact:
    """One tta document's artifact (KeyError on a missing key: `load_ttas` names the file)."""
    variants = doc["variants"]
    for v, entry in variants.items():
        missing = [k for k in VARIANT_KEYS if k not in entry]
        missing += [f"curve.{k}" for p in entry["curve"] for k in CURVE_KEYS if k not in p][:1]
        if missing:
            raise NfabError(f"{path}: variant {v!r} lacks {', '.join(missing)}")
    if "fp32" not in variants:
        raise NfabError(f"{path}: no fp32 variant (it sets the target)")
    link = doc.get("link") or {}
    return TtaArtifact(name=name, path=path, target_loss=float(doc["target_loss"]), variants=variants,
                       link=link.get("rate", "loopback"), model=str(doc["config"]["model"]), recipe=recipe_text(doc),
                       target_rule=str(doc.get("target_rule") or TtaArtifact.target_rule))


def recipe_text(doc: dict[str, Any]) -> str:
    """The recipe a tta run stepped, in one line, from its JSON's `recipe` (the training config): optimizer
    and learning rate, schedule, batch, and the clipping, accumulation and precision where set. Why: a
    time to accuracy is the recipe's; two runs compare only when it is the same."""
    r = doc.get("recipe") or {}
    optim, data, sched = r.get("optim") or {}, r.get("data") or {}, r.get("schedule") or {}
    name = str(optim.get("name", "?"))
    parts = [f"{name} lr {optim['lr']:g}" if optim.get("lr") else name]
    if sched.get("name"):
        parts.append(f"{sched['name']} schedule")
    if data.get("batch_size"):
        parts.append(f"batch {data['batch_size']}/rank")
    if optim.get("grad_clip"):
        parts.append(f"clip {optim['grad_clip']:g}")
    if (r.get("accum_steps") or 1) > 1:
        parts.append(f"{r['accum_steps']} micro-batches")
    if r.get("precision", "fp32") != "fp32":
        parts.append(str(r["precision"]))
    return ", ".join(parts)


def speedup(base: dict[str, Any] | None, variant: dict[str, Any]) -> str | None:
    """base's time to target / the variant's (> 1: sooner than base), as text; `>= X` when base never
    reached the target (X: base's whole training time / the variant's time); None when the variant never did."""
    if base is None or variant["time_to_target_s"] is None:
        return None
    if base["time_to_target_s"] is None:
        train = base.get("train_time_s")
        return None if train is None else f">= {train / variant['time_to_target_s']:.2f}x"
    return f"{base['time_to_target_s'] / variant['time_to_target_s']:.2f}x"


def tta_table(tta: TtaArtifact) -> pd.DataFrame:
    """One row per variant: time and steps to target, speed-ups against FP32 and bf16, MB sent to target."""
    fp32, bf16 = tta.variants["fp32"], tta.variants.get("bf16")
    rows = [{"variant": name, "time_to_target_s": v["time_to_target_s"], "steps_to_target": v["steps_to_target"],
             "steps": v["steps"], "speedup_vs_fp32": speedup(fp32, v), "speedup_vs_bf16": speedup(bf16, v),
             "final_loss": v["final_loss"], "wire_mb_to_target": v["wire_bytes"] / MB}
            for name, v in tta.variants.items()]
    return pd.DataFrame(rows, columns=list(COLUMNS))


def tta_plot(tta: TtaArtifact) -> bytes:
    """PNG: validation loss against training wall time per variant, the target as a line."""
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.add_subplot()
    for name, v in tta.variants.items():
        curve = v["curve"]
        ax.plot([p["time_s"] for p in curve], [p["val_loss"] for p in curve], marker="o", markersize=3,
                label=name if v["time_to_target_s"] is None else f"{name} ({v['time_to_target_s']:.0f} s)")
    ax.axhline(tta.target_loss, color="black", linestyle="--", linewidth=1, label=f"target ({tta.target_rule})")
    ax.set_xscale("log")
    ax.set_yscale("log")  # the approach to the target, not the early spikes, is what the plot is for
    ax.set_xlabel("training wall time, s (log; evaluation excluded)")
    ax.set_ylabel("validation loss (log)")
    ax.set_title(f"{tta.name}: time to accuracy ({tta.model}, {tta.link})")
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()
