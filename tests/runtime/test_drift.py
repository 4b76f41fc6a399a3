"""The slow-divergence monitor: per-region preconditioned fidelity, its trend, demotion with back-off."""

from __future__ import annotations

import math

import torch

from nfab.profile.schema import Health
from nfab.runtime.control.fidelity import (
    PARAM_SAMPLES,
    RegionFidelity,
    bucket_probe,
    fold_probes,
    read_params,
    sample,
    sample_layout,
)
from nfab.runtime.control.health import HealthState, Observation, update

CFG = Health(cooldown_steps=4, readmit_after=2, warmup_steps=0, drift_demote_after=0, min_trend_cosine=0.5,
             trend_beta=0.5, trend_min_probes=2, max_backoff=4)
LOSSY = frozenset({"linear", "embedding"})


def fid(**cos: float) -> dict[str, RegionFidelity]:
    return {r: RegionFidelity(c, 0.0, True, 100) for r, c in cos.items()}


def obs(step: int, fidelity=None) -> Observation:
    return Observation(step, 1.0, 1.0, False, fidelity=fidelity or {})


def test_the_sample_is_every_kth_element_of_each_parameter_from_its_own_start():
    lengths = (10, 3, 1500, 700)
    layout = sample_layout(lengths, torch.device("cpu"))
    # independent: per parameter, every k-th element from its index 0, k = ceil(n / PARAM_SAMPLES)
    want, pos = [], 0
    for n in lengths:
        k = max(1, math.ceil(n / PARAM_SAMPLES))
        want += [pos + i for i in range(0, n, k)]
        pos += n
    assert layout.src.tolist() == want
    assert max(layout.counts) <= PARAM_SAMPLES and layout.strides == (1, 1, 3, 2)


def test_a_parameters_probe_sums_do_not_depend_on_its_bucket_neighbours():
    """DDP rebuilds its buckets after step 0 (and a resumed run starts on the initial ones):
    a parameter's probe numbers must be the same in any group."""
    g = torch.Generator().manual_seed(0)
    w_est, w_ref = torch.randn(3000, generator=g), torch.randn(3000, generator=g)
    o_est, o_ref = torch.randn(705, generator=g), torch.randn(705, generator=g)
    inv = torch.rand(3000, generator=g) + 0.1

    def sums(est, ref, slices, weights):
        layout = sample_layout(tuple(n for _, n in slices), torch.device("cpu"))
        meta, t = bucket_probe(sample(est, layout), sample(ref, layout), [(name, "linear") for name, _ in slices],
                               layout, weights.get)
        return dict(zip([m[0] for m in meta], t, strict=True))

    alone = sums(w_est, w_ref, [("w", 3000)], {"w": inv})
    mixed = sums(torch.cat([o_est[:700], w_est, o_est[700:]]), torch.cat([o_ref[:700], w_ref, o_ref[700:]]),
                 [("a", 700), ("w", 3000), ("b", 5)], {"w": inv})
    assert torch.equal(alone["w"], mixed["w"])


def _fidelity(est, ref, slices, inverse=None):
    layout = sample_layout(tuple(n for _, _, n in slices), torch.device("cpu"))
    meta, t = bucket_probe(sample(est, layout), sample(ref, layout), [(name, region) for region, name, _ in slices],
                           layout, inverse)
    return fold_probes(read_params(meta, t.reshape(-1).tolist()))


def test_region_fidelity_preconditions_before_comparing():
    slices = [("linear", "w", 6), ("norm", "n", 2)]
    ref = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.01, 0.01, 2.0, 2.0])
    est = torch.tensor([1.0, 1.0, 1.0, 1.0, -0.01, -0.01, 2.0, 2.0])  # small coordinates flipped
    cosine, plain = _fidelity(est, ref, slices)
    assert plain["linear"].cosine > 0.99 and not plain["linear"].preconditioned
    assert abs(cosine - float(est @ ref / (est.norm() * ref.norm()))) < 1e-6  # the step's plain cosine
    # Adam divides by sqrt(v): the small coordinates have a small RMS, so their flip dominates
    inv = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0, 100.0, 100.0])}
    _, pre = _fidelity(est, ref, slices, inv.get)
    e, f = est[:6] * inv["w"], ref[:6] * inv["w"]
    assert abs(pre["linear"].cosine - float(e @ f / (e.norm() * f.norm()))) < 1e-6
    assert pre["linear"].cosine < 0.34 and pre["linear"].preconditioned  # 2 of 6 equal-weight flips
    assert abs(pre["norm"].cosine - 1.0) < 1e-12 and not pre["norm"].preconditioned  # no second moment for n
    assert abs(pre["linear"].rel_error - float((e - f).norm() / f.norm())) < 1e-6
    assert pre["linear"].samples == 6 and pre["norm"].samples == 2


def test_a_falling_trend_demotes_only_that_region_after_enough_probes():
    st = HealthState()
    assert update(st, CFG, obs(0, fid(linear=0.2, embedding=0.9)), LOSSY) == []  # one probe is not a trend
    ev = update(st, CFG, obs(5, fid(linear=0.3, embedding=0.8)), LOSSY)
    assert len(ev) == 1 and ev[0].kind == "fallback" and ev[0].regions == ("linear",)
    assert ev[0].reason.startswith("drift(preconditioned cosine trend linear=0.250")
    assert st.demoted() == {"linear"} and st.strikes == {"linear": 1}


def test_healthy_fluctuation_above_the_floor_never_demotes():
    st = HealthState()
    for t, c in enumerate([0.9, 0.55, 0.95, 0.6, 0.7, 0.52, 0.8]):
        assert update(st, CFG, obs(t, fid(linear=c, embedding=c)), LOSSY) == []


def test_back_off_doubles_each_drift_demotion_and_readmission_needs_a_fresh_trend():
    st = HealthState()
    update(st, CFG, obs(0, fid(linear=0.1)), LOSSY)
    update(st, CFG, obs(1, fid(linear=0.1)), LOSSY)
    assert st.demoted() == {"linear"} and st.cooldown(CFG, "linear") == 4
    back = None
    for t in range(2, 20):
        ev = update(st, CFG, obs(t), LOSSY)
        if ev:
            back = t
            break
    assert back == 1 + 4 + 1  # cool-down 4, then 2 healthy steps
    assert "linear" not in st.trend  # a fresh trend after re-admission
    assert st.probation_until == back + 1 + CFG.dense_probe_steps  # and probes every step for a while
    assert HealthState.from_dict(st.to_dict()) == st
    update(st, CFG, obs(10, fid(linear=0.1)), LOSSY)
    ev = update(st, CFG, obs(11, fid(linear=0.1)), LOSSY)
    assert ev[0].regions == ("linear",) and st.cooldown(CFG, "linear") == 8
    st.strikes["linear"] = 10
    assert st.cooldown(CFG, "linear") == 16  # capped at max_backoff cool-downs


def test_threshold_zero_only_observes_and_state_round_trips():
    quiet = Health(min_trend_cosine=0.0, warmup_steps=0)
    st = HealthState()
    for t in range(5):
        assert update(st, quiet, obs(t, fid(linear=-0.5)), LOSSY) == []
    assert st.trend["linear"] < 0 and st.probes["linear"] == 5
    assert HealthState.from_dict(st.to_dict()) == st
    old = st.to_dict()
    for k in ("trend", "probes", "strikes"):
        old.pop(k)
    assert HealthState.from_dict(old).trend == {}  # states saved before the drift monitor still load


def test_plain_cosines_are_observed_but_never_demote():
    """Without a second moment (SGD, no optimizer given) a low plain cosine is normal for sign."""
    st = HealthState()
    plain = {"linear": RegionFidelity(0.1, 2.0, False, 100)}
    for t in range(6):
        assert update(st, CFG, obs(t, plain), LOSSY) == []
    assert "linear" not in st.trend


def test_a_drifting_region_with_error_feedback_loses_error_feedback_before_its_route():
    st = HealthState()
    ef = frozenset({"linear"})
    ev = update(st, CFG, obs(0, fid(linear=0.1, embedding=0.1)), LOSSY, ef)
    assert [(e.kind, e.regions) for e in ev] == [("ef_off", ("linear",))]  # costs no bytes: one probe suffices
    ev = update(st, CFG, obs(1, fid(linear=0.9, embedding=0.1)), LOSSY, ef)
    assert [(e.kind, e.regions) for e in ev] == [("fallback", ("embedding",))]  # a route needs a trend
    assert st.ef_off == {"linear"} and st.demoted() == {"embedding"} and st.probes["linear"] == 1  # a fresh trend
    # still drifting without error feedback: now the route goes
    update(st, CFG, obs(2, fid(linear=0.1)), LOSSY, ef)
    ev = update(st, CFG, obs(3, fid(linear=0.1)), LOSSY, ef)
    assert [(e.kind, e.regions) for e in ev] == [("fallback", ("linear",))]
    assert HealthState.from_dict(st.to_dict()) == st


def test_the_first_error_feedback_drift_switches_it_off_in_every_region():
    """Drift is measured only under an adaptive optimizer, where error feedback itself is the suspect:
    one region's drift takes it off everywhere (each with a fresh trend), routes stay."""
    st = HealthState()
    ef = frozenset({"linear", "embedding"})
    update(st, CFG, obs(0, fid(linear=0.9, embedding=0.9)), LOSSY, ef)
    ev = update(st, CFG, obs(1, fid(linear=0.9, embedding=0.05)), LOSSY, ef)
    assert [(e.kind, e.regions) for e in ev] == [("ef_off", ("embedding", "linear"))]
    assert "embedding=" in ev[0].reason and "linear=" not in ev[0].reason  # the reason names the drifting one
    assert st.ef_off == {"linear", "embedding"} and not st.demoted() and not st.trend


def test_demotions_wait_for_the_preconditioner_but_error_feedback_goes_at_once():
    """Adam's first steps give low preconditioned cosines even for healthy routes: a demotion
    (FP32 bytes) waits `drift_demote_after` steps; switching error feedback off (free) does not."""
    cfg = CFG.model_copy(update={"drift_demote_after": 10})
    st = HealthState()
    assert update(st, cfg, obs(1, fid(linear=0.1)), LOSSY) == []
    assert update(st, cfg, obs(2, fid(linear=0.1)), LOSSY) == []  # two probes, a low trend, but step 2 < 10
    ev = update(st, cfg, obs(3, fid(embedding=0.1)), LOSSY, ef_regions=frozenset({"embedding"}))
    assert [e.kind for e in ev] == ["ef_off"] and st.ef_off == {"embedding"}
    # a confirmed suspect (error feedback already off for drift) is demoted before step 10
    assert update(st, cfg, obs(4, fid(embedding=0.1)), LOSSY) == []  # a fresh trend: one probe is not one
    ev = update(st, cfg, obs(5, fid(embedding=0.1, linear=0.1)), LOSSY)
    assert [(e.kind, e.regions) for e in ev] == [("fallback", ("embedding",))]
    ev = update(st, cfg, obs(10, fid(linear=0.1)), LOSSY)
    assert [(e.kind, e.regions) for e in ev] == [("fallback", ("linear",))]


def test_step_cosine_is_preconditioned_only_when_every_probed_parameter_is():
    slices = [("linear", "w", 6), ("norm", "n", 2)]
    ref = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.01, 0.01, 2.0, 2.0])
    est = torch.tensor([1.0, 1.0, 1.0, 1.0, -0.01, -0.01, 2.0, 2.0])
    inv = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0, 100.0, 100.0]), "n": torch.tensor([1.0, 1.0])}
    step, pre = _fidelity(est, ref, slices, inv.get)
    e, f = est * torch.cat([inv["w"], inv["n"]]), ref * torch.cat([inv["w"], inv["n"]])
    assert abs(step - float(e @ f / (e.norm() * f.norm()))) < 1e-6 and step < 0.9
    # one parameter without a second moment: the step's cosine stays plain
    step, _ = _fidelity(est, ref, slices, {"w": inv["w"]}.get)
    assert abs(step - float(est @ ref / (est.norm() * ref.norm()))) < 1e-6 and step > 0.99
