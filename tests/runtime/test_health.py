"""The health monitor as a pure state machine: fallback, cool-down, hysteresis, re-admission."""

import math

from nfab.profile.schema import Health
from nfab.runtime.control.health import HealthState, Observation, update

CFG = Health(loss_spike_ratio=2.0, grad_norm_jump=5.0, cooldown_steps=3, readmit_after=2, warmup_steps=2,
             baseline_beta=0.5, min_fidelity_cosine=0.3)
LOSSY = frozenset({"conv", "linear"})


def obs(step, loss=1.0, norm=1.0, nonfinite=False, cos=None, regions=frozenset()):
    return Observation(step, loss, norm, nonfinite, cos, regions)


def test_loss_spike_demotes_then_readmits_after_cooldown_and_healthy_streak():
    st = HealthState()
    for t in range(5):
        assert update(st, CFG, obs(t), LOSSY) == []
    ev = update(st, CFG, obs(5, loss=10.0), LOSSY)
    assert ev[0].kind == "fallback" and ev[0].reason == "loss_spike" and ev[0].regions == ("conv", "linear")
    assert st.demoted() == LOSSY
    assert st.loss_baseline == 1.0  # the spike did not poison the baseline
    readmitted_at = None
    for t in range(6, 20):
        ev = update(st, CFG, obs(t), LOSSY)
        if ev and ev[0].kind == "readmit":
            readmitted_at = t
            break
    # cool-down of 3 steps (6, 7 are within), then 2 healthy steps past it (8, 9)
    assert readmitted_at == 9 and st.demoted() == frozenset()


def test_unhealthy_step_during_cooldown_resets_the_streak():
    st = HealthState()
    for t in range(3):
        update(st, CFG, obs(t), LOSSY)
    update(st, CFG, obs(3, nonfinite=True, norm=math.nan), LOSSY)
    update(st, CFG, obs(6), LOSSY)
    update(st, CFG, obs(7, loss=100.0), LOSSY)  # spike while demoted: streak back to 0
    assert st.healthy_streak["conv"] == 0 and "conv" in st.demoted()


def test_fidelity_probe_only_demotes_probed_regions_and_grad_jump_is_global():
    st = HealthState()
    for t in range(3):
        update(st, CFG, obs(t), LOSSY)
    ev = update(st, CFG, obs(3, cos=0.1, regions=frozenset({"conv"})), LOSSY)
    assert [e.regions for e in ev] == [("conv",)] and ev[0].reason.startswith("fidelity")
    ev = update(st, CFG, obs(4, norm=50.0), LOSSY)
    assert ev[0].reason == "grad_norm_jump" and ev[0].regions == ("linear",)


def test_state_round_trips_through_a_dict():
    st = HealthState()
    for t in range(4):
        update(st, CFG, obs(t, loss=1.0 + t), LOSSY)
    update(st, CFG, obs(4, loss=50.0), LOSSY)
    assert HealthState.from_dict(st.to_dict()) == st


def test_fidelity_floor_waits_out_the_warmup():
    """Adam's first second moments rest on a few squared gradients: a probe read through them
    in the first `warmup_steps` steps does not demote; the same probe afterwards does."""
    st = HealthState()
    assert update(st, CFG, obs(0, cos=0.1, regions=frozenset({"conv"})), LOSSY) == []
    assert update(st, CFG, obs(1, cos=0.1, regions=frozenset({"conv"})), LOSSY) == []
    ev = update(st, CFG, obs(2, cos=0.1, regions=frozenset({"conv"})), LOSSY)
    assert [e.regions for e in ev] == [("conv",)] and ev[0].reason.startswith("fidelity")
