"""ResNet-18: torchvision parameter parity, shapes for both stems, seeded init."""

from __future__ import annotations

import torch

from nfab.models import build_model


def test_resnet18_has_torchvision_parameter_count() -> None:
    spec = build_model("resnet18", device="meta")
    assert spec.num_parameters == 11_689_512
    shapes = dict((n, tuple(p.shape)) for n, p in spec.module.named_parameters())
    assert shapes["conv1.weight"] == (64, 3, 7, 7)
    assert shapes["layer4.1.conv2.weight"] == (512, 512, 3, 3)
    assert shapes["fc.weight"] == (1000, 512)
    assert spec.head_modules == ("fc",)
    assert spec.is_head("fc") and not spec.is_head("layer1.0.conv1")
    assert spec.task == "classification" and spec.optimizer == "sgd"


def test_resnet18_imagenet_stem_output_shape() -> None:
    spec = build_model("resnet18", num_classes=7, width=16, seed=0)
    assert spec.module(torch.randn(2, 3, 64, 64)).shape == (2, 7)


def test_resnet18_small_input_on_digits_shape() -> None:
    spec = build_model("resnet18", num_classes=10, width=16, small_input=True, in_channels=1, seed=0)
    assert spec.module.conv1.kernel_size == (3, 3) and spec.module.conv1.stride == (1, 1)
    assert isinstance(spec.module.maxpool, torch.nn.Identity)
    out = spec.module(torch.randn(4, 1, 8, 8))
    assert out.shape == (4, 10)
    assert spec.in_channels == 1 and spec.num_classes == 10


def test_resnet18_seeded_init_is_deterministic_and_local() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("resnet18", width=16, num_classes=10, seed=5).module.state_dict()
    assert torch.equal(torch.rand(1), before), "a seeded build must not consume the global RNG"
    b = build_model("resnet18", width=16, num_classes=10, seed=5).module.state_dict()
    c = build_model("resnet18", width=16, num_classes=10, seed=6).module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["conv1.weight"], c["conv1.weight"])
