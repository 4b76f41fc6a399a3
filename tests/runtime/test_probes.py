"""Which regions a step probes: rotation, spacing once quiet, every region in a shadow window."""

import torch

from nfab.profile.schema import Health
from nfab.runtime.control.fidelity import fold_probes, probe_mask, read_params, sample_layout
from nfab.runtime.control.health import HealthState, observe
from nfab.runtime.control.probes import probe_interval, probe_regions
from nfab.runtime.stats import StepStats

CFG = Health(probe_every=10, dense_probe_steps=4, probe_spacing_max=4)
LOSSY = ("embedding", "linear", "norm")


def test_dense_steps_rotate_then_regular_probes_rotate_every_interval():
    st = HealthState()
    assert [probe_regions(t, CFG, st, LOSSY, dense=True) for t in range(4)] == [
        {"embedding"}, {"linear"}, {"norm"}, {"embedding"}]
    assert probe_regions(3, CFG, st, LOSSY, dense=False) == frozenset()  # no optimizer: no dense probes
    assert [probe_regions(t, CFG, st, LOSSY, dense=True) for t in (10, 20, 30)] == [
        {"linear"}, {"norm"}, {"embedding"}]
    assert probe_regions(15, CFG, st, LOSSY, dense=True) == frozenset()
    assert probe_regions(10, CFG.model_copy(update={"probe_rotate": False}), st, LOSSY, dense=True) == set(LOSSY)
    assert probe_regions(0, CFG, st, (), dense=True) == frozenset()
    # error feedback in a lossy region: the dense probes watch every region
    assert probe_regions(1, CFG, st, LOSSY, dense=True, watch_all=True) == set(LOSSY)
    assert probe_regions(10, CFG, st, LOSSY, dense=True, watch_all=True) == {"linear"}


def test_interval_doubles_while_quiet_up_to_the_cap_and_resets_on_an_event():
    st = HealthState()
    assert [probe_interval(t, CFG, st) for t in (0, 39, 40, 79, 80, 500)] == [10, 10, 20, 20, 40, 40]
    st.quiet_since = 480  # an event at step 480
    assert probe_interval(500, CFG, st) == 10


def test_a_shadow_window_probes_every_region():
    st = HealthState(shadow_until=57)
    assert probe_regions(56, CFG, st, LOSSY, dense=False) == set(LOSSY)
    assert probe_regions(57, CFG, st, LOSSY, dense=False) == frozenset()


def test_a_masked_layout_samples_only_its_regions_and_the_fold_skips_the_rest():
    mask = probe_mask(["linear", "norm", "linear"], frozenset({"norm"}))
    assert mask == (False, True, False) and probe_mask(["linear"], frozenset({"norm"})) is None
    layout = sample_layout((2000, 64, 3000), torch.device("cpu"), mask)
    assert layout.counts == (0, 64, 0) and layout.src.tolist() == list(range(2000, 2064))
    meta = (("a", "linear", False, 0), ("b", "norm", False, 64))
    params = read_params(meta, [0.0] * 7 + [2.0, 1.0, 4.0, 0, 0, 0, 0])
    cosine, regions = fold_probes(params)
    assert set(params) == {"b"} and set(regions) == {"norm"} and cosine == 1.0


def test_regular_probes_pause_over_budget_dense_ones_borrow_against_the_run_shadows_never_pause():
    st = HealthState(probe_bytes=60, sent_bytes=1060, steps_seen=10)  # 60 probe bytes over 1000 others: 6% > 5%
    assert probe_regions(10, CFG, st, LOSSY, dense=True) == frozenset()
    assert probe_regions(2, CFG, st, LOSSY, dense=True) == {"norm"}  # no run length: nothing to borrow against
    # over a 300-step run of ~100 other bytes a step, 60 is within half of its 1,500-byte budget
    assert probe_regions(2, CFG, st, LOSSY, dense=True, horizon=300) == {"norm"}
    assert probe_regions(2, CFG, HealthState(probe_bytes=800, sent_bytes=1800, steps_seen=10), LOSSY,
                         dense=True, horizon=300) == frozenset()
    st.shadow_until = 11
    assert probe_regions(10, CFG, st, LOSSY, dense=True) == set(LOSSY)
    assert probe_regions(10, CFG, HealthState(probe_bytes=40, sent_bytes=1040), LOSSY, dense=False) == {"linear"}
    # the next probe is estimated by the last one: 40 + 20 would pass 5% of 1,000
    assert probe_regions(10, CFG, HealthState(probe_bytes=40, sent_bytes=1040, last_probe_bytes=20), LOSSY,
                         dense=False) == frozenset()


def test_the_probe_budget_holds_over_a_run_and_shadows_are_counted_apart():
    """300 steps of 1,000 compressed bytes; a probe of one region costs 1,500 (a small model's 512-element
    samples outweigh its low-bit payload), so 20 unbudgeted dense probes alone would be 10% of the run.
    An alarm's 3-step shadow probes all three regions."""
    cfg = Health(probe_every=10, dense_probe_steps=20, probe_spacing_max=4, warmup_steps=1000)
    st, steps, per_region, probed = HealthState(), 300, 1_500, []
    for t in range(steps):
        if t == 151:
            st.shadow_until = 154  # an alarm at step 150's fold: steps 151-153 shadow every region
        regions = probe_regions(t, cfg, st, LOSSY, dense=True, horizon=steps)
        probed.append(bool(regions))
        stats = StepStats(step=t, phase="p0", wire_bytes=1_000 + per_region * len(regions),
                          probe_wire_bytes=per_region * len(regions), grad_norm=1.0, loss=1.0)
        observe(st, cfg, stats, {}, regions, frozenset(LOSSY), frozenset())
        assert stats.shadow == (151 <= t < 154) and (stats.shadow_wire_bytes > 0) == stats.shadow
    other = st.sent_bytes - st.probe_bytes - st.shadow_bytes
    assert other == 1_000 * steps and st.shadow_bytes == 3 * 3 * per_region
    assert st.probe_bytes <= cfg.probe_budget * other  # 5% of the compressed bytes, over the run
    assert probed[0] and sum(probed[:20]) >= 3  # early safety probes still ran
    assert sum(probed[160:]) >= 2  # and regular ones once the run had earned them back
