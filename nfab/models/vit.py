"""A small Vision Transformer (ViT-Tiny / ViT-Small shapes, any image and patch size).

Pre-norm blocks with plain `nn.LayerNorm`, `nn.Linear` and a `nn.Conv2d` patch
embedding, so the runtime bindings can classify every parameter by module type; the
classifier is named `head`. Attention goes through `F.scaled_dot_product_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nfab.errors import ConfigError
from nfab.models.attention import SelfAttention
from nfab.models.spec import ModelSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class ViTSize:
    """Transformer shape of one named ViT size."""

    depth: int
    """Number of Transformer blocks."""
    dim: int
    """Embedding width."""
    heads: int
    """Attention heads (dim must divide evenly)."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of dim."""


VIT_SIZES: dict[str, ViTSize] = {
    # nano is not a published size: 2 blocks that train in seconds on a CPU.
    "nano": ViTSize(depth=2, dim=64, heads=4),
    "tiny": ViTSize(depth=12, dim=192, heads=3),  # ViT-Ti/16: 5.7M params at 224px
    "small": ViTSize(depth=12, dim=384, heads=6),  # ViT-S/16: 22M params at 224px
}


class MLP(nn.Module):
    """Two-layer GELU MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch embedding + class token + learned positions + blocks + `head` on the class token."""

    def __init__(
        self,
        size: ViTSize,
        *,
        image_size: int,
        patch_size: int,
        num_classes: int,
        in_channels: int,
    ) -> None:
        super().__init__()
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, size.dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, size.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, size.dim))
        self.blocks = nn.Sequential(*(Block(size.dim, size.heads, size.mlp_ratio) for _ in range(size.depth)))
        self.norm = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # timm's recipe: truncated-normal(0.02) positions, class token and Linears, zero biases.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit(
    *,
    size: str = "tiny",
    image_size: int = 32,
    patch_size: int = 4,
    num_classes: int = 10,
    in_channels: int = 3,
) -> ModelSpec:
    """A ViT of a named size (`nano`, `tiny`, `small`) for `image_size` square inputs."""
    if size not in VIT_SIZES:
        raise ConfigError(f"vit: unknown size {size!r}; choose one of {sorted(VIT_SIZES)}")
    for key, value in (
        ("image_size", image_size),
        ("patch_size", patch_size),
        ("num_classes", num_classes),
        ("in_channels", in_channels),
    ):
        if value < 1:
            raise ConfigError(f"vit: {key} must be >= 1, got {value}")
    if image_size % patch_size:
        raise ConfigError(f"vit: image_size {image_size} is not a multiple of patch_size {patch_size}")
    module = ViT(
        VIT_SIZES[size],
        image_size=image_size,
        patch_size=patch_size,
        num_classes=num_classes,
        in_channels=in_channels,
    )
    return ModelSpec(
        name="vit",
        module=module,
        task="classification",
        head_modules=("head",),
        shard_units=tuple(f"blocks.{i}" for i in range(VIT_SIZES[size].depth)),
        optimizer="adamw",
        num_classes=num_classes,
        image_size=image_size,
        in_channels=in_channels,
        options={
            "size": size,
            "image_size": image_size,
            "patch_size": patch_size,
            "num_classes": num_classes,
            "in_channels": in_channels,
        },
    )
