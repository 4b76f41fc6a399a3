"""Safe defaults: error feedback only for non-adaptive optimizers; the preconditioner read from Adam."""

from __future__ import annotations

import pytest
import torch

from nfab.runtime.control.optim import Preconditioner, is_adaptive, resolve_error_feedback, resolve_noise_moment


def _params():
    return [torch.nn.Parameter(torch.randn(5))]


@pytest.mark.parametrize("make,adaptive", [
    (lambda p: torch.optim.SGD(p, lr=0.1), False),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
    (lambda p: torch.optim.Adam(p), True),
    (lambda p: torch.optim.AdamW(p), True),
    (lambda p: torch.optim.RMSprop(p), True),
    (lambda p: torch.optim.Adagrad(p), True),
])
def test_optimizer_families(make, adaptive):
    opt = make(_params())
    assert is_adaptive(opt) is adaptive
    assert resolve_error_feedback("auto", opt) is (not adaptive)
    assert resolve_error_feedback(True, opt) is True and resolve_error_feedback(False, opt) is False


def test_unknown_optimizer_and_unknown_choice():
    class Lion(torch.optim.Optimizer):  # a third-party adaptive optimizer, known only by name
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-4})

    assert is_adaptive(Lion(_params()))
    assert resolve_error_feedback("auto", None) is False  # unknown optimizer: the safe side
    with pytest.raises(ValueError, match="error_feedback"):
        resolve_error_feedback("yes", None)


def test_noise_moment_auto_corrects_an_adaptive_optimizer_on_a_static_route_or_a_profile_calibrated_with_it():
    adam, sgd = torch.optim.AdamW(_params()), torch.optim.SGD(_params(), lr=0.1)
    assert resolve_noise_moment("auto", adam, static_route=True, calibrated_with=False)
    assert resolve_noise_moment("auto", adam, static_route=False, calibrated_with=True)
    assert not resolve_noise_moment("auto", adam, static_route=False, calibrated_with=False)  # runs as validated
    assert not resolve_noise_moment("auto", sgd, static_route=True, calibrated_with=True)
    assert not resolve_noise_moment(True, None, static_route=True, calibrated_with=True)  # nothing to correct
    assert resolve_noise_moment(True, adam, static_route=False, calibrated_with=False)
    assert not resolve_noise_moment(False, adam, static_route=True, calibrated_with=True)


def test_preconditioner_reads_adams_second_moment():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], eps=1e-3)
    pre = Preconditioner(opt, {"p": p})
    assert pre.inverse_rms("p") is None  # no step yet
    p.grad = torch.tensor([1.0, 2.0, 0.0, -3.0])
    opt.step()
    v = opt.state[p]["exp_avg_sq"]
    rms = v.sqrt() + 1e-3
    assert torch.equal(pre.inverse_rms("p"), 1.0 / rms.clamp_min(rms.mean() * 0.01))
    assert pre.inverse_rms("missing") is None
    assert Preconditioner(torch.optim.SGD([p], lr=0.1), {"p": p}).inverse_rms("p") is None


def test_quantization_scale_is_adams_denominator_floored_at_a_percent_of_its_mean():
    p = torch.nn.Parameter(torch.ones(6))
    opt = torch.optim.AdamW([p], eps=1e-8)
    pre = Preconditioner(opt, {"p": p})
    assert pre.quantization_scale("p") is None  # no step yet: block-scaled qsum rounds plain
    p.grad = torch.tensor([1.0, 2.0, 0.0, -3.0, 1e-6, 5.0])
    opt.step()
    rms = opt.state[p]["exp_avg_sq"].sqrt() + 1e-8
    got = pre.quantization_scale("p")
    want = torch.maximum(rms, rms.mean() * 0.01)
    assert torch.equal(got, want)
    assert float(got[2]) == float(rms.mean() * 0.01) > float(rms[2])  # a still-zero v is floored
    assert float(got[3]) == float(rms[3])
    assert torch.equal(opt.state[p]["exp_avg_sq"].sqrt() + 1e-8, rms)  # the optimizer's state is untouched


@pytest.mark.parametrize("fused", [False, True])
def test_a_steps_scales_are_computed_once_and_renewed_with_the_next_step(fused: bool) -> None:
    # fused Adam updates v without bumping its version counter: the memo is keyed by the
    # hook's step, not by the tensor's version
    p = torch.nn.Parameter(torch.ones(5))
    opt = torch.optim.AdamW([p], fused=fused)
    pre = Preconditioner(opt, {"p": p})
    p.grad = torch.tensor([1.0, 2.0, 0.5, -3.0, 4.0])
    opt.step()
    first = pre.flat_scale(["p"], [5], torch.device("cpu"), step=1)
    assert pre.flat_scale(["p"], [5], torch.device("cpu"), step=1) is first  # shared within the step
    assert torch.equal(pre.inverse_rms("p", step=1), first.reciprocal())
    p.grad = torch.tensor([9.0, -9.0, 9.0, 9.0, 9.0])
    opt.step()
    fresh = pre.quantization_scale("p")  # no step: always afresh
    assert not torch.equal(fresh, first)
    assert torch.equal(pre.flat_scale(["p"], [5], torch.device("cpu"), step=2), fresh)
    assert torch.equal(pre.inverse_rms("p", step=2), fresh.reciprocal())


@pytest.mark.parametrize("eps", [(1e-8, 1e-8), (1e-8, 1e-6)])
def test_flat_scale_is_each_parameters_quantization_scale_bit_for_bit(eps: tuple[float, float]) -> None:
    # whole-tensor passes over the concatenated moments must give every parameter's own floored
    # scale exactly (calibration's replay calls quantization_scale per parameter)
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (7, 13), "b": (300,), "c": (1,), "d": (64, 65), "e": (4097,)}
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in shapes.items()}
    opt = torch.optim.AdamW([{"params": [params["a"], params["b"], params["c"]], "eps": eps[0]},
                             {"params": [params["d"], params["e"]], "eps": eps[1]}])
    for p in params.values():  # gradients spanning decades, some exactly zero (floored)
        p.grad = torch.randn(p.shape, generator=g) * torch.logspace(-6, 2, p.numel()).reshape(p.shape)
        p.grad.view(-1)[:: 5] = 0.0
    opt.step()
    pre = Preconditioner(opt, params)
    names = ["d", "a", "e", "c", "b"]
    lengths = [params[n].numel() for n in names]
    want = torch.cat([pre.quantization_scale(n) for n in names])
    for step in (None, 3):
        got = pre.flat_scale(names, lengths, torch.device("cpu"), step=step)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for n, part in zip(names, want.split(lengths), strict=True):  # shared with the probe's inverse
        assert torch.equal(pre.quantization_scale(n, step=3), part)
        assert torch.equal(pre.inverse_rms(n, step=3), part.reciprocal())
    # a parameter without a second moment yet: 1 there, the others as before
    params["f"] = torch.nn.Parameter(torch.zeros(9))
    pre = Preconditioner(opt, params)
    got = pre.flat_scale(["a", "f"], [91, 9], torch.device("cpu"), step=4)
    assert torch.equal(got, torch.cat([pre.quantization_scale("a"), torch.ones(9)]))
