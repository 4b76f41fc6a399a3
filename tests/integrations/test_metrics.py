"""step_metrics (what the integrations log) and the lazy-import promise of `import nfab`."""

from __future__ import annotations

import subprocess
import sys

from nfab.integrations.metrics import step_metrics
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
