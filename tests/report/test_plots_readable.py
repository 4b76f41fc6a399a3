"""Plots a person can read: a log loss scale when early losses dwarf the rest; titles without a repeated word."""

from __future__ import annotations

import pandas as pd

from nfab.report.plots import calibration_title, wants_log_scale


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
