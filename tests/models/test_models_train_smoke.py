"""A few optimizer steps on real nfab data: the model/data pairing learns at all."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nfab.data import build_dataset, make_loader
from nfab.models import build_model

STEPS = 31


def _losses(module, loader, opt, loss_of) -> list[float]:
    """Losses of the first STEPS optimizer steps of `module` on `loader`."""
    losses = []
    for step, (x, y) in enumerate(loader):
        loss = loss_of(module(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == STEPS - 1:
            break
    return losses


def test_gpt_nano_learns_stdlib_text() -> None:
    spec = build_model("gpt", size="nano", seed=0)
    data = build_dataset("stdlib-text", split="train", seed=0, block_size=spec.block_size, max_bytes=100_000)
    assert data.spec.vocab_size == spec.vocab_size
    opt = torch.optim.AdamW(spec.module.parameters(), lr=3e-3)
    losses = _losses(spec.module, make_loader(data, batch_size=16, rank=0, world_size=1, seed=0), opt,
                     lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    assert losses[0] > 5.0  # ~ln(256) = 5.55 at init
    assert sum(losses[-5:]) / 5 < 3.8


def test_resnet18_small_learns_digits() -> None:
    spec = build_model("resnet18", num_classes=10, width=8, small_input=True, in_channels=1, seed=0)
    data = build_dataset("digits", split="train", seed=0)
    opt = torch.optim.SGD(spec.module.parameters(), lr=0.05, momentum=0.9)
    losses = _losses(spec.module, make_loader(data, batch_size=32, rank=0, world_size=1, seed=0), opt,
                     F.cross_entropy)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
