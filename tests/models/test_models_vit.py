"""ViT: shapes per size, option validation, head naming."""

from __future__ import annotations

import pytest
import torch

from nfab.errors import ConfigError
from nfab.models import build_model


@pytest.mark.parametrize("size", ["nano", "tiny"])
def test_vit_output_shape(size: str) -> None:
    spec = build_model("vit", size=size, image_size=32, patch_size=4, num_classes=10, seed=0)
    assert spec.module(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert spec.head_modules == ("head",) and spec.optimizer == "adamw"
    assert spec.module.pos_embed.shape == (1, 8 * 8 + 1, spec.module.head.in_features)


def test_vit_on_grey_digits() -> None:
    spec = build_model("vit", size="nano", image_size=8, patch_size=2, in_channels=1, seed=0)
    assert spec.module(torch.randn(3, 1, 8, 8)).shape == (3, 10)


def test_vit_small_is_vit_s_sized() -> None:
    spec = build_model("vit", size="small", image_size=224, patch_size=16, num_classes=1000, device="meta")
    assert 21.5e6 < spec.num_parameters < 22.5e6  # ViT-S/16: 22.05M


def test_vit_rejects_bad_options() -> None:
    with pytest.raises(ConfigError, match="multiple of patch_size"):
        build_model("vit", image_size=30, patch_size=4)
    with pytest.raises(ConfigError, match="unknown size"):
        build_model("vit", size="huge")
