"""A real (tiny) sweep under AdamW: replay fidelity decides, so no short trial runs."""

from __future__ import annotations

import math

from nfab.calibrate import make_config
from nfab.calibrate.fit import ADAPTIVE_COSINE
from nfab.calibrate.sweep import run_sweep, table_frame, with_validated_floor
from nfab.profile.schema import Health, Profile


def test_an_adamw_sweep_runs_no_trials_and_screens_on_the_adaptive_bar() -> None:
    cfg = make_config("gpt", steps=8, phases=2, trial_steps=2, overrides={
        "data.max_bytes": 50_000, "batch_size": 2, "eval_samples": 4, "ef_steps": 2,
        "routes": ["fp32", "bf16", "q8", "sign"]})
    assert cfg.optimizer.name == "adamw"
    result = run_sweep(cfg)
    frame = table_frame(result.rows)
    assert result.meta["trials"] == 0 and (frame["trial_steps"].eq(0) | frame["route"].eq("fp32")).all()
    lossy = frame[frame["route"].isin(["q8", "sign"]) & frame["capacity_ok"]]
    screened = lossy[lossy["screen"] != "no_trial"]  # the regions big enough for trials
    assert len(screened) and set(screened["screen"]) <= {"replay", "cheaper", "bound"}
    low = screened[screened["cosine"] < ADAPTIVE_COSINE]
    assert (low["screen"] == "replay").all() and all(math.isnan(v) for v in low["loss_delta"])


def test_the_probe_floor_is_at_most_half_what_the_validated_run_read() -> None:
    profile = Profile.static("bq2").model_copy(update={"health": Health(min_fidelity_cosine=0.3)})
    assert with_validated_floor(profile, 0.2).health.min_fidelity_cosine == 0.1
    assert with_validated_floor(profile, 0.9).health.min_fidelity_cosine == 0.3  # never raised
    assert with_validated_floor(profile, 0.01).health.min_fidelity_cosine == 0.05  # never below 0.05
