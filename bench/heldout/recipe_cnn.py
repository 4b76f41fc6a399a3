"""A ResNet-style CNN with BatchNorm, written as a user would, for sklearn's 8x8 digits.

The second recipe of issue 31: a convolutional family with BatchNorm (whose running
statistics DDP broadcasts, and whose 1-D weights carry little of the bytes), trained with
SGD momentum, warm-up + cosine, decay on matrices only and gradient clipping.

    PYTHONPATH=. nfab calibrate bench.heldout.recipe_cnn:recipe_cnn --config bench/heldout/recipe_cnn.yaml
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

task = "classification"
optimizer = "sgd"


class _Basic(nn.Module):
    """conv-BN-ReLU-conv-BN plus a (1x1 conv-BN when the shape changes) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                      if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class RecipeCNN(nn.Module):
    """Stem, two stages of basic blocks (8x8 -> 4x4), global average pool, linear classifier."""

    task = task
    optimizer = optimizer

    def __init__(self, width: int = 32, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(_Basic(width, width, 1), _Basic(width, width, 1))
        self.layer2 = nn.Sequential(_Basic(width, 2 * width, 2), _Basic(2 * width, 2 * width, 1))
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def recipe_cnn(width: int = 32, num_classes: int = 10, in_channels: int = 1) -> RecipeCNN:
    """Factory for `module:factory` use (`bench.heldout.recipe_cnn:recipe_cnn`)."""
    return RecipeCNN(width=width, num_classes=num_classes, in_channels=in_channels)
