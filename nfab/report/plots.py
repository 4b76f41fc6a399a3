"""PNG plots of runs and calibrations, drawn with matplotlib's object API on Agg.

`matplotlib.figure.Figure` is used directly, never pyplot: no global figure state, no
GUI backend, nothing to close. Every function returns PNG bytes; writing them
(atomically) is the caller's job. A run keeps one colour in every plot.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from nfab.report.artifacts import RunArtifacts
from nfab.report.tables import MB

_RUN_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown",
                "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "tab:red")
# Routes ordered from most to fewest bits, so stacked areas read bottom-up as FP32 first.
# Fixed colours (no red: red marks fallback steps): grey for FP32, blues for 16-bit,
# greens/olive for integer codecs, purples for 1-bit sign routes.
_ROUTE_COLOURS = {
    "fp32": "#9e9e9e", "bf16": "#6baed6", "fp16": "#2171b5", "q8": "#41ab5d",
    "qsum": "#238b45", "q4": "#a1d99b", "q2": "#bcbd22", "sign": "#9e9ac8",
    "signcount": "#6a51a3", "signgather": "#3f007d",
}
_ROUTE_ORDER = tuple(_ROUTE_COLOURS)
_SPARE_COLOURS = ("#fdae6b", "#8c6d31", "#17becf", "#e377c2", "#7f7f7f")


def run_colour(index: int) -> str:
    return _RUN_COLOURS[index % len(_RUN_COLOURS)]


def _label(run: RunArtifacts) -> str:
    return run.name if run.complete else f"{run.name} (incomplete)"


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def _integer_steps(ax: Axes) -> None:
    """Steps are whole numbers: label the x axis and keep its ticks integral."""
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _no_data(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


LOG_SCALE_RATIO = 8.0
"""A loss panel goes to a log scale when its largest value is this many times its median:
an early eval loss of 25 beside a run settling near 2 would otherwise flatten every curve."""


def wants_log_scale(values: list[float]) -> bool:
    """Whether a few large losses dwarf the rest (all finite values positive, max/median >= LOG_SCALE_RATIO)."""
    finite = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if finite.size < 2 or (finite <= 0).any():
        return False
    return float(finite.max()) >= LOG_SCALE_RATIO * float(np.median(finite))


_OUTSIDE: dict[str, Any] = {"fontsize": 8, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}
"""Legend beside the panel, right of it: inside, "upper right" hid the last points of a loss that
climbs (a diverging run) and "lower right" an accuracy that falls; "best" only makes that rarer."""


def loss_plot(runs: tuple[RunArtifacts, ...]) -> bytes:
    """`loss_figure` as PNG bytes."""
    return _png(loss_figure(runs))


def loss_figure(runs: tuple[RunArtifacts, ...]) -> Figure:
    """Loss (train line, eval dots) with fallback steps marked, plus the eval metric.

    The eval metric is accuracy (%) for classifiers and perplexity for language models
    (whose eval_accuracy is always NaN); each gets its own panel only when present.
    """
    plotted = [(i, r) for i, r in enumerate(runs) if r.metrics is not None and len(r.metrics)]
    has_acc = any(r.metrics["eval_accuracy"].notna().any() for _, r in plotted)
    lm_runs = [(i, r) for i, r in plotted
               if r.metrics["eval_accuracy"].isna().all() and r.metrics["eval_loss"].notna().any()]
    panels = 1 + int(has_acc) + int(bool(lm_runs))
    fig = Figure(figsize=(9, 3.6 * panels))
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    any_fallback = False
    for i, run in plotted:
        m, colour = run.metrics, run_colour(i)
        ax.plot(m["step"], m["loss"], color=colour, lw=1.2, alpha=0.85, label=_label(run))
        ev = m[m["eval_loss"].notna()]
        ax.plot(ev["step"], ev["eval_loss"], color=colour, lw=1, ls="--", marker="o", ms=3)
        fb = m[m["fallback"].fillna(False).astype(bool)]
        if len(fb):
            any_fallback = True
            ax.scatter(fb["step"], fb["loss"], marker="x", s=36, color="red", zorder=5)
    log_scale = wants_log_scale([v for _, r in plotted for v in (*r.metrics["loss"], *r.metrics["eval_loss"])])
    if log_scale:
        ax.set_yscale("log")
    ax.set_title("Loss vs step (solid: train, dashed with dots: eval)" + (", log scale" if log_scale else ""))
    ax.set_ylabel("loss")
    handles, _ = ax.get_legend_handles_labels()
    if any_fallback:
        handles.append(Line2D([], [], color="red", marker="x", ls="", label="fallback to FP32"))
    if handles:
        ax.legend(handles=handles, **_OUTSIDE)
    else:
        _no_data(ax, "no per-step metrics in these runs")
    ax.grid(alpha=0.3)
    next_panel = 1
    if has_acc:
        ax = axes[next_panel]
        next_panel += 1
        for i, run in plotted:
            ev = run.metrics[run.metrics["eval_accuracy"].notna()]
            if len(ev):
                ax.plot(ev["step"], ev["eval_accuracy"] * 100, color=run_colour(i), marker="o",
                        ms=3, label=_label(run))
        ax.set_title("Eval accuracy vs step")
        ax.set_ylabel("accuracy (%)")
        ax.legend(**_OUTSIDE)
        ax.grid(alpha=0.3)
    if lm_runs:
        ax = axes[next_panel]
        for i, run in lm_runs:
            ev = run.metrics[run.metrics["eval_loss"].notna()]
            ax.plot(ev["step"], np.exp(ev["eval_loss"]), color=run_colour(i), marker="o",
                    ms=3, label=_label(run))
        ax.set_title("Eval perplexity vs step (exp of eval loss)")
        ax.set_ylabel("perplexity")
        ax.legend(**_OUTSIDE)
        ax.grid(alpha=0.3)
    _integer_steps(axes[-1])
    return fig


def wire_plot(runs: tuple[RunArtifacts, ...]) -> bytes:
    """Cumulative bytes on the wire per run, against what FP32 would have sent (dotted)."""
    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    totals: list[float] = []
    for i, run in enumerate(runs):
        m = run.metrics
        if m is None or not len(m):
            continue
        wire = m["wire_bytes"].cumsum() / MB
        fp32 = m["baseline_wire_bytes"].cumsum() / MB
        ax.plot(m["step"], wire, color=run_colour(i), lw=1.5, label=_label(run), zorder=3)
        # Grey for all runs: runs of one model share the FP32 curve, so colours would hide.
        ax.plot(m["step"], fp32, color="black", lw=1.2, ls=":", zorder=2,
                label="plain DDP (bucket dtype)" if not totals else None)
        totals += [float(wire.iloc[-1]), float(fp32.iloc[-1])]
    positive = [t for t in totals if t > 0]
    if positive and max(positive) / min(positive) > 20:
        ax.set_yscale("log")  # compressed and FP32 traffic differ by orders of magnitude
    ax.set_title("Cumulative wire traffic vs step")
    _integer_steps(ax)
    ax.set_ylabel("cumulative wire MB (10^6 bytes)")
    if totals:
        ax.legend(fontsize=8, loc="upper left")
    else:
        _no_data(ax, "no per-step metrics in these runs")
    ax.grid(alpha=0.3, which="both")
    return _png(fig)


def _route_sort_key(route: str) -> tuple[int, str]:
    return (_ROUTE_ORDER.index(route) if route in _ROUTE_ORDER else len(_ROUTE_ORDER), route)


def route_mix_plot(runs: tuple[RunArtifacts, ...]) -> bytes:
    """Stacked area of the fraction of gradient elements per route, one panel per run."""
    with_metrics = [r for r in runs if r.metrics is not None and len(r.metrics)]
    mixes = [r.route_mix for r in with_metrics if r.route_mix is not None]
    routes = sorted({c for mix in mixes for c in mix.columns}, key=_route_sort_key)
    unknown = [r for r in routes if r not in _ROUTE_COLOURS]
    palette = {**_ROUTE_COLOURS, **{r: _SPARE_COLOURS[k % len(_SPARE_COLOURS)]
                                    for k, r in enumerate(unknown)}}
    fig = Figure(figsize=(9, 1.0 + 2.2 * max(1, len(mixes))))
    axes = fig.subplots(max(1, len(mixes)), 1, sharex=True, squeeze=False)[:, 0]
    if not mixes:
        _no_data(axes[0], "no per-step metrics in these runs")
    for ax, run, mix in zip(axes, with_metrics, mixes, strict=False):
        columns = [r for r in routes if r in mix.columns]
        if columns:
            ax.stackplot(mix.index.to_numpy(), [mix[c].to_numpy() for c in columns],
                         colors=[palette[c] for c in columns], labels=columns, step="mid")
        else:
            _no_data(ax, "route_mix not recorded")
        ax.set_ylim(0, 1)
        ax.set_ylabel("fraction of\nelements")
        ax.set_title(f"Route mix: {_label(run)}", fontsize=10)
        fb = run.metrics[run.metrics["fallback"].fillna(False).astype(bool)]["step"]
        for step in fb:
            ax.axvline(step, color="red", lw=0.8, ls="--")
    handles = [Line2D([], [], color=palette[r], lw=6, label=r) for r in routes]
    if any(r.metrics["fallback"].fillna(False).astype(bool).any() for r in with_metrics):
        handles.append(Line2D([], [], color="red", lw=1, label="fallback step"))
    if handles:
        axes[0].legend(handles=handles, fontsize=8, loc="upper left",
                       bbox_to_anchor=(1.01, 1.0), title="route")
    _integer_steps(axes[-1])
    return _png(fig)


def calibration_title(name: str, table: pd.DataFrame) -> str:
    """`resnet18 calibration: ...`, naming the folder only when it says more than the model
    (a folder called `calibration` or named after the model would repeat a word)."""
    model = str(table["model"].iloc[0]) if "model" in table.columns and len(table) else name
    folder = "" if name in (model, "calibration", "calibrations") else f" ({name})"
    return f"{model} calibration{folder}: chosen route per phase x region"


def calibration_heatmap(name: str, table: pd.DataFrame) -> bytes:
    """Phase x region grid; colour = bits per element of the chosen route (log scale),
    each cell annotated with the route and the cosine that justified it."""
    phases = list(dict.fromkeys(table["phase"]))
    regions = list(dict.fromkeys(table["region"]))
    bits = np.full((len(phases), len(regions)), np.nan)
    fig = Figure(figsize=(1.3 * len(regions) + 2.5, 0.9 * len(phases) + 1.8))
    ax = fig.subplots()
    for _, row in table.iterrows():
        y, x = phases.index(row["phase"]), regions.index(row["region"])
        bits[y, x] = row["bits_per_element"]
        cosine = "cos ?" if math.isnan(row["cosine"]) else f"cos {row['cosine']:.3f}"
        dark = not math.isnan(row["bits_per_element"]) and row["bits_per_element"] < 6
        ax.text(x, y, f"{row['route']}\n{cosine}", ha="center", va="center", fontsize=8,
                color="white" if dark else "black")
    image = ax.imshow(np.ma.masked_invalid(bits), cmap="viridis", aspect="auto",
                      norm=LogNorm(vmin=1, vmax=32))
    colourbar = fig.colorbar(image, ax=ax, ticks=[1, 2, 4, 8, 16, 32])
    colourbar.ax.set_yticklabels(["1", "2", "4", "8", "16", "32"])
    colourbar.set_label("bits per element (chosen route)")
    ax.set_xticks(range(len(regions)), regions)
    ax.set_yticks(range(len(phases)), phases)
    ax.set_xlabel("region")
    ax.set_ylabel("phase")
    ax.set_title(calibration_title(name, table))
    return _png(fig)
