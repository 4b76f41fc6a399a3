"""Plots a person can read: a log loss scale when early losses dwarf the rest; titles without a repeated word."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection

from nfab.report.artifacts import load_run
from nfab.report.plots import calibration_title, loss_figure, wants_log_scale


def test_log_scale_only_when_a_few_losses_dwarf_the_rest() -> None:
    demo = [25.0] + [2.5 - 0.01 * i for i in range(50)]  # the demo's eval loss of 25 at step 24
    assert wants_log_scale(demo)
    assert not wants_log_scale([3.0, 2.6, 2.4, 2.3])
    assert not wants_log_scale([25.0, 0.0, 2.0])  # a zero loss cannot go on a log axis
    assert not wants_log_scale([float("nan"), 2.0])


def test_calibration_titles_do_not_repeat_the_folder_name() -> None:
    table = pd.DataFrame({"model": ["resnet18"]})
    assert calibration_title("calibration", table).startswith("resnet18 calibration:")
    assert calibration_title("resnet18", table).startswith("resnet18 calibration:")
    assert calibration_title("quick-w8", table).startswith("resnet18 calibration (quick-w8):")
    assert "calibration calibration" not in calibration_title("calibration", table).lower()


def test_calibration_headings_do_not_repeat_the_folder_name() -> None:
    from nfab.report.formatting import calibration_heading

    assert calibration_heading("calibration") == "Calibration"
    assert calibration_heading("gpt") == "Calibration gpt"


def _points(ax: Axes) -> np.ndarray:
    """Display coordinates of every plotted point of a panel: line vertices and scatter markers."""
    xy = [line.get_xydata() for line in ax.get_lines()]
    xy += [c.get_offsets() for c in ax.collections if isinstance(c, PathCollection)]
    data = np.concatenate([np.asarray(a, dtype=float).reshape(-1, 2) for a in xy])
    data = data[np.isfinite(data).all(axis=1)]
    return ax.transData.transform(data)


def test_no_legend_covers_a_plotted_point(make_run: Callable[..., Path]) -> None:
    """A run whose loss climbs at the end (a diverging low-bit run) drew its last points under the
    loss panel's legend ("upper right"); eval dots of a late accuracy drop sat under "lower right"."""
    runs = []
    for i, name in enumerate(("fp32-run", "a-longer-run-name-that-widens-the-legend", "diverging")):
        path = make_run(name, route="sign", wire_per_step=200_000, route_mix={"sign": 1.0},
                         fallback_steps=(17, 18) if i == 2 else ())
        metrics = pd.read_parquet(path / "metrics.parquet")
        if i == 2:  # climbs to the top right corner, and its accuracy falls to the bottom right one
            metrics["loss"] = metrics["loss"].where(metrics["step"] < 12, 0.4 + 0.35 * (metrics["step"] - 11))
            metrics["eval_loss"] = metrics["eval_loss"].where(metrics["eval_loss"].isna(), metrics["loss"] + 0.05)
            last = metrics["eval_accuracy"].notna() & (metrics["step"] >= 14)
            metrics.loc[last, "eval_accuracy"] = 0.05
        metrics.to_parquet(path / "metrics.parquet", index=False)
        runs.append(load_run(path, name))
    fig = loss_figure(tuple(runs))
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 2  # loss and accuracy panels
    for ax, legend in legends:
        box = legend.get_window_extent(renderer)
        points = _points(ax)
        inside = ((points[:, 0] >= box.x0) & (points[:, 0] <= box.x1)
                  & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1))
        assert not inside.any(), f"{ax.get_title()!r}: the legend covers {int(inside.sum())} points"
