"""The health monitor as a pure state machine: fallback, cool-down, hysteresis, re-admission."""

import math

from nfab.profile.schema import Health
from nfab.runtime.control.fidelity import RegionFidelity
from nfab.runtime.control.health import HealthState, Observation, horizon_threshold, update

CFG = Health(loss_spike_ratio=2.0, grad_norm_jump=5.0, cooldown_steps=3, readmit_after=2, warmup_steps=2,
             baseline_beta=0.5, min_fidelity_cosine=0.3)
NO_SHADOW = CFG.model_copy(update={"shadow_steps": 0})
LOSSY = frozenset({"conv", "linear"})


def obs(step, loss=1.0, norm=1.0, nonfinite=False, cos=None, regions=frozenset()):
    return Observation(step, loss, norm, nonfinite, cos, regions)


def test_without_shadows_a_loss_spike_demotes_then_readmits_after_cooldown_and_healthy_streak():
    st = HealthState()
    for t in range(5):
        assert update(st, NO_SHADOW, obs(t), LOSSY) == []
    ev = update(st, NO_SHADOW, obs(5, loss=10.0), LOSSY)
    assert ev[0].kind == "fallback" and ev[0].reason == "loss_spike" and ev[0].regions == ("conv", "linear")
    assert st.demoted() == LOSSY
    assert st.loss_baseline == 1.0  # the spike did not poison the baseline
    readmitted_at = None
    for t in range(6, 20):
        ev = update(st, NO_SHADOW, obs(t), LOSSY)
        if ev and ev[0].kind == "readmit":
            readmitted_at = t
            break
    # cool-down of 3 steps (6, 7 are within), then 2 healthy steps past it (8, 9)
    assert readmitted_at == 9 and st.demoted() == frozenset()


def test_unhealthy_step_during_cooldown_resets_the_streak():
    st = HealthState()
    for t in range(3):
        update(st, CFG, obs(t), LOSSY)
    update(st, CFG, obs(3, cos=0.1, regions=frozenset({"conv"})), LOSSY)
    update(st, CFG, obs(6), LOSSY)
    update(st, CFG, obs(7, loss=100.0), LOSSY)  # spike while demoted: streak back to 0
    assert st.healthy_streak["conv"] == 0 and "conv" in st.demoted()


def test_a_nonfinite_gradient_is_an_alarm_a_shadow_window_checks():
    """A non-finite gradient is the step's input, not what was sent: under a loss scaler an fp16 overflow
    the scaler skips. It demoted every lossy region for the cooldown; now it opens a shadow window, and
    a window whose probes find every region faithful closes as a false alarm, demoting nothing."""
    st = HealthState()
    for t in range(3):
        update(st, CFG, obs(t), LOSSY)
    ev = update(st, CFG, obs(3, nonfinite=True, norm=math.nan), LOSSY)
    assert [(e.kind, e.reason) for e in ev] == [("alarm", "nonfinite")] and not st.demoted()
    assert st.shadow_until == 3 + 1 + CFG.shadow_steps and st.norm_baseline == 1.0  # it learns nothing from it
    for t in range(4, st.shadow_until + 1):
        ev = update(st, CFG, obs(t, cos=0.99, regions=LOSSY), LOSSY)
    assert [(e.kind, e.reason) for e in ev] == [("shadow", "false alarm")] and not st.demoted()
    assert (st.alarms, st.false_alarms) == (1, 1)


def test_fidelity_probe_only_demotes_probed_regions_and_grad_jump_is_an_alarm():
    st = HealthState()
    for t in range(3):
        update(st, CFG, obs(t), LOSSY)
    ev = update(st, CFG, obs(3, cos=0.1, regions=frozenset({"conv"})), LOSSY)
    assert [e.regions for e in ev] == [("conv",)] and ev[0].reason.startswith("fidelity")
    ev = update(st, CFG, obs(4, norm=50.0), LOSSY)
    assert [(e.kind, e.reason, e.regions) for e in ev] == [("alarm", "grad_norm_jump", ("linear",))]
    assert st.demoted() == {"conv"} and st.shadow_until == 4 + 1 + CFG.shadow_steps


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


def fid(**cos):
    return {r: RegionFidelity(c, 0.0, True, 64) for r, c in cos.items()}


def run_shadow(linear_cos):
    """A jump at step 4, then shadow probes of both regions (fidelity arrives a step later)."""
    st = HealthState()
    for t in range(4):
        update(st, CFG, obs(t), LOSSY)
    events = update(st, CFG, obs(4, norm=50.0), LOSSY)
    for t in range(5, 5 + CFG.shadow_steps + 2):
        probe = fid(conv=0.9, linear=linear_cos) if t > 5 else {}
        o = Observation(t, 1.0, 1.0, False, 0.9 if probe else None, frozenset(probe), probe)
        events += update(st, CFG, o, LOSSY)
    return st, [(e.kind, e.reason, e.regions) for e in events]


def test_shadow_demotes_only_the_region_it_finds_unfaithful():
    st, events = run_shadow(linear_cos=0.1)
    assert ("alarm", "grad_norm_jump", ("conv", "linear")) in events
    assert ("fallback", "fidelity(0.100)", ("linear",)) in events
    assert ("shadow", "demotion needed", ()) in events
    assert st.demoted() == {"linear"} and (st.alarms, st.false_alarms) == (1, 0)


def test_shadow_that_finds_every_region_faithful_is_a_false_alarm():
    st, events = run_shadow(linear_cos=0.8)
    assert [e for e in events if e[0] == "fallback"] == [] and st.demoted() == frozenset()
    assert ("shadow", "false alarm", ()) in events and (st.alarms, st.false_alarms) == (1, 1)
    assert st.shadow_until == 0


def test_a_healthy_level_shift_alarms_once():
    """The baselines learn while an alarm is under review: a norm that stays 3x higher (clipping
    and a decaying learning rate move it for healthy reasons) does not raise alarm after alarm."""
    st = HealthState()
    for t in range(4):
        update(st, CFG, obs(t), LOSSY)
    kinds = [e.kind for t in range(4, 40) for e in update(st, CFG, obs(t, norm=6.0), LOSSY)]
    assert kinds.count("alarm") == 1 and "fallback" not in kinds and st.false_alarms == 1


def test_horizon_threshold_widens_for_a_longer_run_only():
    assert horizon_threshold(2.0, 100, 300) == math.exp(math.log(2.0) * math.sqrt(math.log(300) / math.log(100)))
    assert round(horizon_threshold(2.0, 100, 300), 2) == 2.16
    assert horizon_threshold(2.0, 100, 100) == horizon_threshold(2.0, 100, 50) == 2.0
    assert horizon_threshold(2.0, None, 300) == 2.0
