"""A small ViT recipe for sklearn's 8x8 digits, written as a user would (issue 31's third recipe).

2x2 patches (16 tokens) by a strided conv, a class token, learned positions, pre-norm
blocks on `nn.MultiheadAttention`, a linear head; trained with AdamW betas (0.9, 0.95),
decay on matrices only, warm-up + cosine and clipping.

    PYTHONPATH=. nfab calibrate bench.heldout.recipe_vit:recipe_vit --config bench/heldout/recipe_vit.yaml
"""

from __future__ import annotations

import torch
from torch import nn

task = "classification"
optimizer = "adamw"


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class RecipeViT(nn.Module):
    """Patch embedding, class token, `depth` blocks, LayerNorm, linear head on the class token."""

    task = task
    optimizer = optimizer

    def __init__(self, d_model: int = 64, depth: int = 2, n_head: int = 4, patch: int = 2, image_size: int = 8,
                 in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(in_channels, d_model, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.randn(1, 1 + (image_size // patch) ** 2, d_model) * 0.02)
        self.blocks = nn.ModuleList(_Block(d_model, n_head) for _ in range(depth))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def recipe_vit(d_model: int = 64, depth: int = 2, n_head: int = 4, image_size: int = 8, in_channels: int = 1,
               num_classes: int = 10) -> RecipeViT:
    """Factory for `module:factory` use (`bench.heldout.recipe_vit:recipe_vit`)."""
    return RecipeViT(d_model=d_model, depth=depth, n_head=n_head, image_size=image_size, in_channels=in_channels,
                     num_classes=num_classes)
