"""The report over real generated artifacts: numbers, files, HTML references, CSV."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import matplotlib.image
import pandas as pd
import pytest

from nfab.errors import NfabError
from nfab.report import build_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_run_table_numbers_come_from_the_files(standard: dict[str, Path], tmp_path: Path):
    report = build_report([str(standard["fp32"]), str(standard["sign"])], tmp_path / "out")
    runs = report.runs.set_index("run")
    sign_metrics = pd.read_parquet(standard["sign"] / "metrics.parquet")
    wire, fp32 = sign_metrics["wire_bytes"].sum(), sign_metrics["baseline_wire_bytes"].sum()
    assert runs.loc["sign-run", "compression_ratio"] == pytest.approx(fp32 / wire)
    assert runs.loc["sign-run", "wire_mb"] == pytest.approx(wire / 1e6)
    assert runs.loc["sign-run", "baseline_mb"] == pytest.approx(fp32 / 1e6)
    assert runs.loc["fp32-run", "compression_ratio"] == pytest.approx(1.0)
    assert runs.loc["sign-run", "fallback_steps"] == 2
    assert runs.loc["sign-run", "accuracy"] == pytest.approx(0.93)
    assert runs.loc["sign-run", "route"] == "sign"
    assert bool(runs.loc["fp32-run", "fp32_reference"])
    assert set(runs["status"]) == {"complete"}


def test_comparison_against_the_fp32_run(standard: dict[str, Path], tmp_path: Path):
    report = build_report([str(standard["fp32"]), str(standard["sign"])], tmp_path / "out")
    (row,) = report.comparison.to_dict("records")
    assert row["run"] == "sign-run" and row["baseline"] == "fp32-run"
    assert row["accuracy_delta_pts"] == pytest.approx(-2.0)
    assert row["loss_delta_pct"] == pytest.approx(5.0)
    runs = report.runs.set_index("run")
    assert row["traffic_ratio"] == pytest.approx(
        runs.loc["fp32-run", "wire_mb"] / runs.loc["sign-run", "wire_mb"])


def test_every_png_is_valid_and_referenced_by_the_html(standard: dict[str, Path],
                                                       tmp_path: Path):
    out = tmp_path / "out"
    report = build_report([str(p) for p in standard.values()], out)
    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} == {"loss.png", "wire_bytes.png", "route_mix.png",
                                      "calibration_cal.png"}
    html = (out / "report.html").read_text()
    referenced = set(re.findall(r'<img src="([^"]+)"', html))
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_MAGIC
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert png.name in referenced
    assert referenced <= {p.name for p in pngs}  # no dangling references
    assert set(report.files) >= set(pngs)
    assert not list(out.glob("*.tmp"))  # atomic writes leave no temp files


def test_a_report_over_other_inputs_removes_the_stale_plots_and_keeps_user_files(
        standard: dict[str, Path], make_calibration: Callable[..., Path], tmp_path: Path):
    """The second report's dir held the first one's loss.png, route_mix.png, ... and summary.csv beside a
    report.html that no longer showed them: a reader took them for current."""
    out = tmp_path / "out"
    build_report([str(p) for p in standard.values()], out)
    assert {p.name for p in out.glob("*.png")} == {"loss.png", "wire_bytes.png", "route_mix.png",
                                                   "calibration_cal.png"}
    mine = {"calibration_mine.png": b"a user's figure", "notes.png": b"another"}  # never written by report
    for name, data in mine.items():
        (out / name).write_bytes(data)
    report = build_report([str(make_calibration("other"))], out)
    assert {p.name for p in out.glob("*.png")} == {"calibration_other.png", *mine}
    assert not (out / "summary.csv").exists()
    assert {p.name for p in report.removed} == {"loss.png", "wire_bytes.png", "route_mix.png",
                                                "calibration_cal.png", "summary.csv"}
    assert all((out / name).read_bytes() == data for name, data in mine.items())
    html = (out / "report.html").read_text()
    assert set(re.findall(r'<img src="([^"]+)"', html)) == {"calibration_other.png"}
    again = build_report([str(make_calibration("other2")), str(standard["fp32"])], out)  # and back
    assert {p.name for p in again.removed} == {"calibration_other.png"}
    assert {p.name for p in out.glob("*.png")} == {"loss.png", "wire_bytes.png", "route_mix.png",
                                                   "calibration_other2.png", *mine}


def test_summary_csv_has_one_row_per_run(standard: dict[str, Path], tmp_path: Path):
    out = tmp_path / "out"
    build_report([str(standard["fp32"]), str(standard["sign"])], out)
    csv = pd.read_csv(out / "summary.csv")
    assert list(csv["run"]) == ["fp32-run", "sign-run"]
    assert csv.set_index("run").loc["sign-run", "accuracy_delta_pts"] == pytest.approx(-2.0)
    assert {"compression_ratio", "wire_mb", "baseline_mb", "status"} <= set(csv.columns)


def test_calibration_table_shows_choice_and_evidence(standard: dict[str, Path],
                                                     tmp_path: Path):
    report = build_report([str(standard["cal"])], tmp_path / "out")
    (view,) = report.calibrations
    assert view.fitted and view.heatmap == "calibration_cal.png"
    table = view.table.set_index(["phase", "region"])
    assert table.loc[("main", "conv"), "route"] == "sign"
    assert table.loc[("main", "conv"), "cosine"] == pytest.approx(0.8)
    assert table.loc[("main", "conv"), "loss_delta"] == pytest.approx(0.32)
    # Not in profile evidence: taken from the matching calibration.parquet row.
    assert table.loc[("warmup", "linear"), "bits_per_element"] == 8.0
    assert table.loc[("warmup", "linear"), "cosine"] == pytest.approx(0.99)
    assert len(view.table) == 6
    assert not (tmp_path / "out" / "summary.csv").exists()  # no runs, no run table


def test_unfitted_calibration_lists_measurements(make_calibration: Callable[..., Path],
                                                 tmp_path: Path):
    cal = make_calibration("raw", profile=False)
    report = build_report([str(cal)], tmp_path / "out")
    (view,) = report.calibrations
    assert not view.fitted and view.heatmap is None
    assert len(view.table) == 2 * 3 * 3 * 2


def test_incomplete_runs_are_marked(make_run: Callable[..., Path], tmp_path: Path):
    going = make_run("going", route="sign", wire_per_step=100, route_mix={"sign": 1.0},
                     steps=7, summary=False)
    cut = make_run("cut", route="sign", wire_per_step=100, route_mix={"sign": 1.0},
                   complete=False)
    report = build_report([str(going), str(cut)], tmp_path / "out")
    runs = report.runs.set_index("run")
    assert runs.loc["going", "status"] == "incomplete"
    assert runs.loc["cut", "status"] == "incomplete"
    assert runs.loc["going", "steps"] == 7
    assert runs.loc["going", "wire_mb"] == pytest.approx(7 * 100 / 1e6)
    assert "incomplete" in (tmp_path / "out" / "report.html").read_text()


def test_language_model_runs_get_perplexity_not_accuracy(
        make_run: Callable[..., Path], tmp_path: Path):
    fp32 = make_run("lm-fp32", route="fp32", wire_per_step=4000, route_mix={"fp32": 1.0},
                    loss=2.36, lm=True)
    mixed = make_run("lm-mixed", route='{"linear": "sign", "norm": "fp32"}', wire_per_step=400,
                     route_mix={"fp32": 0.2, "sign": 0.8}, loss=2.45, lm=True)
    out = tmp_path / "out"
    report = build_report([str(fp32), str(mixed)], out)
    runs = report.runs.set_index("run")
    assert runs["accuracy"].isna().all()
    assert runs.loc["lm-mixed", "perplexity"] == pytest.approx(math.exp(2.45))
    assert runs.loc["lm-mixed", "route"] == "linear:sign norm:fp32"
    (row,) = report.comparison.to_dict("records")
    assert row["loss_delta_pct"] == pytest.approx((2.45 - 2.36) / 2.36 * 100)
    assert matplotlib.image.imread(out / "loss.png").shape[0] > 100


def test_globs_are_expanded(standard: dict[str, Path], tmp_path: Path):
    report = build_report([str(tmp_path / "runs" / "*")], tmp_path / "out")
    assert sorted(report.runs["run"]) == ["fp32-run", "sign-run"]


def test_a_folder_of_runs_stands_for_its_run_dirs(standard: dict[str, Path], tmp_path: Path):
    """`nfab report runs/*` after `make demo`: `runs/demo` holds the runs (and a `report` folder)."""
    (tmp_path / "runs" / "report").mkdir()
    report = build_report([str(tmp_path / "runs")], tmp_path / "out")
    assert sorted(report.runs["run"]) == ["fp32-run", "sign-run"]


def test_an_fsdp2_run_is_compared_with_an_fsdp2_fp32_run(make_run: Callable[..., Path], tmp_path: Path):
    """FSDP2's baseline is its reduce-scatter (W-1)/W of the gradient, DDP's an all-reduce: a profile
    under FSDP2 read 21.3x against the DDP FP32 run, 10.7x against its own."""
    runs = [make_run("ddp-fp32", route="fp32", wire_per_step=2000, route_mix={"fp32": 1.0}),
            make_run("fsdp-fp32", route="fp32", wire_per_step=1000, route_mix={"fp32": 1.0}, parallel="fsdp"),
            make_run("fsdp-bq2", route="bq2", wire_per_step=100, route_mix={"bq2": 1.0}, parallel="fsdp")]
    report = build_report([str(r) for r in runs], tmp_path / "out")
    (row,) = report.comparison.to_dict("records")
    assert row["baseline"] == "fsdp-fp32" and row["traffic_ratio"] == pytest.approx(10.0)
    assert list(report.runs["parallel"]) == ["ddp", "fsdp", "fsdp"]  # no key in summary.json: DDP


def test_same_dir_name_is_disambiguated(make_run: Callable[..., Path], tmp_path: Path):
    a = make_run("a/seed0", route="fp32", wire_per_step=4, route_mix={"fp32": 1.0})
    b = make_run("b/seed0", route="fp32", wire_per_step=4, route_mix={"fp32": 1.0})
    report = build_report([str(a), str(b)], tmp_path / "out")
    assert list(report.runs["run"]) == ["a/seed0", "b/seed0"]


@pytest.mark.parametrize("breakage, message", [
    ("missing", "does not exist"),
    ("foreign", "is not a run dir"),
    ("truncated", "truncated or not Parquet"),
    ("bad_json", "is not valid JSON"),
    ("missing_column", "lacks required column(s): wire_bytes"),
    ("missing_key", "lacks required key(s): model"),
    ("bad_route_mix", "route_mix at step 3 is not JSON"),
    ("no_glob_match", "no path matches"),
])
def test_user_errors_name_the_problem(make_run: Callable[..., Path], tmp_path: Path,
                                      breakage: str, message: str):
    run = make_run("r", route="sign", wire_per_step=10, route_mix={"sign": 1.0})
    target = str(run)
    if breakage == "missing":
        target = str(tmp_path / "nope")
    elif breakage == "foreign":
        (tmp_path / "empty").mkdir()
        target = str(tmp_path / "empty")
    elif breakage == "truncated":
        data = (run / "metrics.parquet").read_bytes()
        (run / "metrics.parquet").write_bytes(data[: len(data) // 2])
    elif breakage == "bad_json":
        (run / "summary.json").write_text('{"model": "resnet18", ')
    elif breakage == "missing_column":
        pd.read_parquet(run / "metrics.parquet").drop(columns=["wire_bytes"]).to_parquet(
            run / "metrics.parquet")
    elif breakage == "missing_key":
        text = (run / "summary.json").read_text().replace('"model"', '"modle"')
        (run / "summary.json").write_text(text)
    elif breakage == "bad_route_mix":
        frame = pd.read_parquet(run / "metrics.parquet")
        frame.loc[3, "route_mix"] = "{not json"
        frame.to_parquet(run / "metrics.parquet")
    elif breakage == "no_glob_match":
        target = str(tmp_path / "nothing-*")
    with pytest.raises(NfabError, match=re.escape(message)):
        build_report([target], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # validation happens before any file is written
