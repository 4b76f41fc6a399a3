"""Region classes from module types and names."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import pytest  # noqa: E402
import twins  # noqa: E402
from torch import nn  # noqa: E402

from nfab.heads import default_heads  # noqa: E402
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


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)  # a block's MLP layer under the name torchvision gives its head


class _UserGPT(nn.Module):
    def __init__(self, head: str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        if head is not None:
            setattr(self, head, nn.Linear(64, 100))


def test_a_blocks_mlp_named_fc_is_not_the_head():
    """Only the output layer is `head`: a user GPT's `blocks.N.fc` once made 30% of its gradient FP32."""
    regions = {n: b.region for n, b in classify(_UserGPT("lm_head")).items()}
    assert regions["lm_head.weight"] == "head"
    assert regions["blocks.0.fc.weight"] == regions["blocks.1.fc.weight"] == "linear"
    assert "head" not in {b.region for b in classify(_UserGPT(None)).values()}  # no head name outside the stack


def test_the_default_head_is_the_strongest_name_then_the_shallowest():
    twin = _UserGPT("fc")  # torchvision's head name at the top, the same name inside the blocks
    assert default_heads(twin) == ("fc",)
    nested = nn.Sequential()
    nested.add_module("block1", _Block())
    nested.add_module("fc", nn.Linear(64, 10))
    assert default_heads(nested) == ("fc",)  # not block1.fc
    vit_like = nn.Module()
    vit_like.heads = nn.Module()
    vit_like.heads.head = nn.Linear(64, 10)  # torchvision's ViT: `heads.head`
    vit_like.fc = nn.Linear(64, 64)
    assert default_heads(vit_like) == ("heads.head",)  # `head` is a stronger name than `fc`
    assert {n: b.region for n, b in classify(vit_like).items()}["fc.weight"] == "linear"


def test_transformers_conv1d_is_a_linear_layer():
    """GPT-2's attention and MLP layers are Transformers' `Conv1D` (a linear layer, weight transposed):
    classed `other`, a profile's linear route left 81.5% of a GPT-2's gradient FP32."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    model = nn.Sequential(pytorch_utils.Conv1D(96, 32), nn.Conv1d(4, 4, 3))
    regions = {n: b.region for n, b in classify(model, small_numel=1).items()}
    assert regions["0.weight"] == "linear" and regions["1.weight"] == "conv"
