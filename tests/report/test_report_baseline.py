"""Which FP32 run a run is compared with (`nfab report`'s comparison table)."""

from __future__ import annotations

import pandas as pd

from nfab.report.tables import _baseline_for


def _ref(run: str, w: int, steps: int, parallel: str = "ddp") -> dict[str, object]:
    return {"run": run, "model": "resnet18", "dataset": "digits", "parallel": parallel, "world_size": w,
            "steps": steps}


def test_the_fp32_run_of_the_same_w_and_length_is_the_baseline() -> None:
    """A 30-step profile run was compared with the 6-step FP32 run listed first (+48% loss, 4.0x)
    although a 30-step FP32 run was there (20.1x)."""
    refs = pd.DataFrame([_ref("fp32-short", 2, 6), _ref("fp32-w3", 3, 30), _ref("fp32", 2, 30),
                         _ref("fsdp-fp32", 2, 30, "fsdp")])
    assert _baseline_for(pd.Series(_ref("profile", 2, 30)), refs)["run"] == "fp32"
    assert _baseline_for(pd.Series(_ref("w3", 3, 2)), refs)["run"] == "fp32-w3"  # W before length
    assert _baseline_for(pd.Series(_ref("w4", 4, 6)), refs)["run"] == "fp32-short"  # length when no W matches
    assert _baseline_for(pd.Series(_ref("fsdp", 2, 6, "fsdp")), refs)["run"] == "fsdp-fp32"
    assert _baseline_for(pd.Series({**_ref("vit", 2, 30), "model": "vit"}), refs) is None
