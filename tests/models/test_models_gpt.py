"""GPT: shapes, weight tying, causality, and the large sizes on the meta device."""

from __future__ import annotations

import pytest
import torch

from nfab.errors import ConfigError
from nfab.models import build_model


def test_gpt_nano_shapes_and_tied_head() -> None:
    spec = build_model("gpt", size="nano", seed=0)
    gpt = spec.module
    assert spec.task == "lm" and spec.vocab_size == 256 and spec.block_size == 64
    assert spec.head_modules == ("head",) and spec.optimizer == "adamw"
    assert gpt.head.weight is gpt.tok_emb.weight
    names = [n for n, _ in gpt.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names
    logits = gpt(torch.randint(0, 256, (2, 64)))
    assert logits.shape == (2, 64, 256)


def test_gpt_is_causal() -> None:
    gpt = build_model("gpt", size="nano", seed=0).module.eval()
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        a, b = gpt(idx), gpt(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_rejects_sequences_longer_than_block() -> None:
    gpt = build_model("gpt", size="nano", block_size=8, seed=0).module
    with pytest.raises(ValueError, match="block_size"):
        gpt(torch.zeros(1, 9, dtype=torch.long))


def test_gpt_1_3b_builds_on_meta() -> None:
    spec = build_model("gpt", size="1.3b", device="meta")
    assert all(p.device.type == "meta" for p in spec.module.parameters())
    # 24 x (12 d^2 + 13 d) + 50304 d + 2048 d with d = 2048: 1,315,819,520
    assert 1.25e9 < spec.num_parameters < 1.40e9
    assert spec.vocab_size == 50304 and spec.block_size == 2048


@pytest.mark.parametrize(("size", "low", "high"), [("125m", 120e6, 130e6), ("350m", 340e6, 370e6)])
def test_gpt_large_sizes_match_gpt3_counts(size: str, low: float, high: float) -> None:
    assert low < build_model("gpt", size=size, device="meta").num_parameters < high


def test_gpt_unknown_size() -> None:
    with pytest.raises(ConfigError, match="unknown size '7b'"):
        build_model("gpt", size="7b", device="meta")
