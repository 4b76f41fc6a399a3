"""step_metrics (what the integrations log) and the lazy-import promise of `import nfab`."""

from __future__ import annotations

import subprocess
import sys

from nfab.integrations.metrics import StepLog, step_metrics
from nfab.runtime.stats import StepStats


def test_step_metrics_flattens_one_step():
    st = StepStats(step=3, phase="p", wire_bytes=100, baseline_wire_bytes=3200,
                   route_elements={"signgather": 600, "fp32": 200}, fallback=True, fallback_reason="health(conv)")
    m = step_metrics(st)
    assert m["nfab/compression"] == 32.0
    assert m["nfab/wire_bytes"] == 100.0 and m["nfab/baseline_wire_bytes"] == 3200.0
    assert m["nfab/route/signgather"] == 0.75 and m["nfab/route/fp32"] == 0.25
    assert m["nfab/fallback"] == 1.0 and m["nfab/skipped"] == 0.0
    assert "nfab/fidelity_cosine" not in m  # no probe this step: nothing to log
    assert all(isinstance(v, float) for v in m.values())  # loggers take numbers only


def test_step_metrics_without_traffic_is_not_a_division_by_zero():
    assert step_metrics(StepStats(step=0, phase="p"))["nfab/compression"] == 1.0


def test_import_nfab_never_imports_a_framework():
    code = ("import sys, nfab, nfab.api, nfab.integrations, nfab.integrations.metrics; "
            "print(sorted({'lightning', 'accelerate', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_step_log_logs_each_step_once_and_zeroes_a_route_the_step_left():
    log = StepLog()
    first = StepStats(step=1, phase="p", wire_bytes=10, baseline_wire_bytes=320,
                      route_elements={"bq2": 800, "fp32": 200})
    assert log.metrics(first)["nfab/route/bq2"] == 0.8
    assert log.metrics(first) is None  # a second optimizer, or a closure that skipped backward: same step
    assert log.metrics(None) is None
    fell_back = StepStats(step=2, phase="p", wire_bytes=320, baseline_wire_bytes=320, route_elements={"fp32": 1000},
                          fallback=True)
    m = log.metrics(fell_back)
    # a logger keeping each key's last value would otherwise still read bq2 at 0.8 beside fp32 at 1.0
    assert m["nfab/route/bq2"] == 0.0 and m["nfab/route/fp32"] == 1.0
    log.reset()
    assert log.metrics(fell_back) is not None  # a new run starts its count afresh
