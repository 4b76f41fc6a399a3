"""Region classes from module types and names."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import twins  # noqa: E402

from nfab.models import build_model  # noqa: E402
from nfab.runtime.bindings import classify  # noqa: E402


def test_awkward_model_regions():
    regions = {n: b.region for n, b in classify(twins.Awkward()).items()}
    assert regions["embed.weight"] == "embedding"  # tied with the head: listed once, first name
    assert "head.weight" not in regions
    assert regions["conv.weight"] == "conv" and regions["conv.bias"] == "bias"
    assert regions["norm.weight"] == "norm" and regions["bn.bias"] == "norm"
    assert regions["mlp.weight"] == "linear" and regions["mlp.bias"] == "bias"


def test_resnet18_head_and_small():
    spec = build_model("resnet18", num_classes=10, width=16, small_input=True)
    regions = {n: b.region for n, b in classify(spec.module, spec.head_modules).items()}
    assert regions["fc.weight"] == "head" and regions["fc.bias"] == "bias"
    assert regions["conv1.weight"] == "small"  # 16*3*3*3 = 432 < 1024 elements
    assert regions["layer1.0.conv1.weight"] == "conv" and regions["bn1.weight"] == "norm"
