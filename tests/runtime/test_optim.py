"""Safe defaults: error feedback only for non-adaptive optimizers; the preconditioner read from Adam."""

from __future__ import annotations

import pytest
import torch

from nfab.runtime.optim import Preconditioner, is_adaptive, resolve_error_feedback


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
