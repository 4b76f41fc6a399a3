"""A nanoGPT-style recipe model nfab was never tuned on (issue 31's first recipe).

Written as nanoGPT writes its GPT: bias-free LayerNorm, one fused qkv projection,
`F.scaled_dot_product_attention` with `is_causal`, learned positions, GELU MLP, and the
token embedding tied to the head. The recipe it trains under (`bench.recipeloop`) is
nanoGPT's too: AdamW betas (0.9, 0.95), decay on matrices only, warm-up + cosine,
gradient accumulation with `no_sync`, `clip_grad_norm_(1.0)`.

    PYTHONPATH=. nfab calibrate bench.heldout.recipe_gpt:recipe_gpt --config bench/heldout/recipe_gpt.yaml
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

task = "lm"
optimizer = "adamw"
vocab_size = 256
block_size = 64


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's: PyTorch's has no bias=False before 2.1)."""

    def __init__(self, d: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _Attention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d, bias=False)  # fused q, k, v
        self.c_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(d)
        self.attn = _Attention(d, n_head)
        self.ln_2 = LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.c_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class RecipeGPT(nn.Module):
    """Byte-level GPT: `n_layer` pre-norm blocks, tied head, nanoGPT's scaled init of residual projections."""

    task = task
    optimizer = optimizer
    vocab_size = vocab_size
    block_size = block_size

    def __init__(self, n_layer: int = 3, d_model: int = 64, n_head: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.h = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / (2 * n_layer) ** 0.5 if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def recipe_gpt(n_layer: int = 3, d_model: int = 64, n_head: int = 4) -> RecipeGPT:
    """Factory for `module:factory` use (`bench.heldout.recipe_gpt:recipe_gpt`)."""
    return RecipeGPT(n_layer=n_layer, d_model=d_model, n_head=n_head)
