"""ResNet-18, the torchvision architecture, with knobs for small CPU runs.

With `num_classes=1000`, `width=64` and the ImageNet stem the parameter names, shapes
and count (11,689,512) match `torchvision.models.resnet18`, so published numbers and
state dicts line up. `width=16` and `small_input=True` give a model that trains on
8x8..32x32 images in seconds on a CPU, which is what calibration sweeps need.
"""

from __future__ import annotations

import torch
from torch import nn

from nfab.errors import ConfigError
from nfab.models.spec import ModelSpec


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual; a 1x1 strided projection when the shape changes."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet with BasicBlocks; attribute names follow torchvision (`conv1`, `layer1`, `fc`)."""

    def __init__(
        self,
        layers: tuple[int, int, int, int],
        *,
        num_classes: int,
        width: int,
        in_channels: int,
        small_input: bool,
    ) -> None:
        super().__init__()
        if small_input:
            # 3x3 stride-1 stem, no max-pool: an 8x8 digit still has 1x1 spatial size
            # left after layer4's three stride-2 stages instead of vanishing.
            self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        planes = (width, 2 * width, 4 * width, 8 * width)
        in_planes = width
        stages: list[nn.Sequential] = []
        for i, (n_blocks, p) in enumerate(zip(layers, planes, strict=True)):
            stride = 1 if i == 0 else 2
            blocks = [BasicBlock(in_planes, p, stride)]
            blocks += [BasicBlock(p, p) for _ in range(n_blocks - 1)]
            stages.append(nn.Sequential(*blocks))
            in_planes = p
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_planes, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # torchvision's init: He-normal (fan_out) convs, unit-gain BN; `fc` keeps the
        # nn.Linear default. zero_init_residual is off by default there, so here too.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(
    *,
    num_classes: int = 1000,
    small_input: bool = False,
    width: int = 64,
    in_channels: int = 3,
    image_size: int | None = None,
) -> ModelSpec:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2]).

    `width` is the stem's channel count (64 = torchvision); `small_input` swaps the
    7x7/2 + max-pool stem for a 3x3/1 stem for 8x8..32x32 inputs. `image_size` is only
    recorded in the spec (the network is size-agnostic thanks to adaptive pooling).
    """
    for key, value in (("num_classes", num_classes), ("width", width), ("in_channels", in_channels)):
        if value < 1:
            raise ConfigError(f"resnet18: {key} must be >= 1, got {value}")
    module = ResNet(
        (2, 2, 2, 2),
        num_classes=num_classes,
        width=width,
        in_channels=in_channels,
        small_input=small_input,
    )
    return ModelSpec(
        name="resnet18",
        module=module,
        task="classification",
        head_modules=("fc",),
        shard_units=("layer1", "layer2", "layer3", "layer4"),
        optimizer="sgd",
        num_classes=num_classes,
        image_size=image_size,
        in_channels=in_channels,
        options={
            "num_classes": num_classes,
            "small_input": small_input,
            "width": width,
            "in_channels": in_channels,
            "image_size": image_size,
        },
    )
