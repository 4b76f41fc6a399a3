"""Runs priced at a declared link (`nfab.report.linktime`): bytes, accuracy and time to accuracy, in the
report and in `nfab demo`'s closing table. Synthetic runs: exact bytes, a fixed measured step time."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from nfab.cli.demo import print_summary
from nfab.report.build import build_report
from nfab.report.linktime import accuracy_target, price, time_to
from nfab.wire.cost import parse_link

FP32_STEP = 4_000_000  # the fixtures' FP32 bytes a step


def _declare(run: Path, link: str = "link:100mbit") -> Path:
    (run / "config.json").write_text(json.dumps({"comm": {"cost_model": link}}))
    return run


def test_a_step_is_its_median_compute_plus_its_bytes_at_the_link():
    link = parse_link("link:100mbit")  # 12.5 MB/s, 50 us a collective
    metrics = pd.DataFrame({"step": range(4), "wire_bytes": [1_250_000] * 4, "collectives": [2, 2, 2, 2],
                            "step_time_s": [9.0, 0.1, 0.3, 0.1],  # step 1's set-up is left out; median 0.1
                            "eval_accuracy": [None, 0.5, None, 0.9], "eval_loss": [None, 1.0, None, 0.2]})
    run = price("x", "sign", False, metrics.astype({"eval_accuracy": float, "eval_loss": float}), link)
    step = 0.1 + 0.1 + 2 * 50e-6
    assert run.compute_s == pytest.approx(0.1) and run.total_s == pytest.approx(4 * step)
    assert run.curve["step"].tolist() == [2, 4] and run.curve["time_s"].tolist() == pytest.approx([2 * step, 4 * step])
    assert time_to(run.curve, 0.9) == pytest.approx(4 * step) and time_to(run.curve, 0.95) is None
    # the target: FP32's mean accuracy over its last three evaluations, less one point
    fp32 = pd.DataFrame({"accuracy": [0.5, 0.96, 0.98, 0.97]})
    assert accuracy_target(fp32) == pytest.approx(0.96)


def test_report_and_demo_price_every_run_at_the_declared_link(make_run: Callable[..., Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]):
    runs = [_declare(make_run("fp32", route="fp32", wire_per_step=FP32_STEP, route_mix={"fp32": 1.0},
                              accuracy=0.95)),
            _declare(make_run("bf16", route="bf16", wire_per_step=FP32_STEP // 2, route_mix={"bf16": 1.0},
                              accuracy=0.95)),
            _declare(make_run("profile", route=None, wire_per_step=FP32_STEP // 20, route_mix={"sign": 1.0},
                              accuracy=0.945))]
    report = build_report([str(r) for r in runs], tmp_path / "report")
    view = next(t for t in report.ttas if t.name == "at the declared link:100mbit (modelled)")
    rows = view.table.set_index("run")
    assert rows.loc["profile", "fewer_bytes_vs_fp32"] == pytest.approx(20.0)
    assert rows.loc["profile", "fewer_bytes_vs_bf16"] == pytest.approx(10.0)
    assert rows.loc["profile", "accuracy_delta_pts"] == pytest.approx(-0.5)
    # the same curve, cheaper steps: the profile gets there at the same evaluation, sooner by the step ratio
    step = {name: 0.05 + b / 12.5e6 + 50e-6 for name, b in (("fp32", FP32_STEP), ("profile", FP32_STEP // 20))}
    assert rows.loc["profile", "speedup_vs_fp32"] == pytest.approx(step["fp32"] / step["profile"])
    assert rows.loc["fp32", "speedup_vs_fp32"] == pytest.approx(1.0)
    assert "Time to accuracy: at the declared link:100mbit (modelled)" in (tmp_path / "report" / "report.html"
                                                                           ).read_text()
    print_summary(runs)
    out = capsys.readouterr().out
    assert "trained for link:100mbit" in out and "20.0x" in out and "10.0x" in out
    assert "the profile: 20.0x fewer gradient bytes than FP32 (10.0x fewer than bf16)" in " ".join(out.split())
    # without a declared link, no such table: the report does not invent a link
    for r in runs:
        (r / "config.json").unlink()
    assert not any("declared" in t.name for t in build_report([str(r) for r in runs], tmp_path / "r2").ttas)
