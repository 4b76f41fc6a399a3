"""Which regions a step probes: rotation, spacing once quiet, every region in a shadow window."""

import torch

from nfab.profile.schema import Health
from nfab.runtime.control.fidelity import fold_probes, probe_mask, read_params, sample_layout
from nfab.runtime.control.health import HealthState
from nfab.runtime.control.probes import probe_interval, probe_regions

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


def test_regular_probes_pause_over_budget_but_shadows_and_dense_probes_do_not():
    st = HealthState(probe_bytes=60, sent_bytes=1060)  # 60 probe bytes over 1000 others: 6% > 5%
    assert probe_regions(10, CFG, st, LOSSY, dense=True) == frozenset()
    assert probe_regions(2, CFG, st, LOSSY, dense=True) == {"norm"}
    st.shadow_until = 11
    assert probe_regions(10, CFG, st, LOSSY, dense=True) == set(LOSSY)
    assert probe_regions(10, CFG, HealthState(probe_bytes=40, sent_bytes=1040), LOSSY, dense=False) == {"linear"}
