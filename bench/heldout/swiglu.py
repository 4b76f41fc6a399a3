"""A third model nfab was never tuned on, written after the noise-corrected second moment landed.

The moment correction was worked out on `encoder.py` (its learning-rate evidence), so that model
no longer counts as unseen. This one was written afterwards and nothing was chosen on it: a
byte-level GPT the way a user who follows recent recipes writes one -- its own attention
through `F.scaled_dot_product_attention`, RMSNorm (`nn.RMSNorm`), a SwiGLU MLP without biases,
four layers at d=64, and a head tied to the token embedding -- trained with plain Adam
(β2 = 0.999, no weight decay), not the AdamW (β2 = 0.95) of the other settings. It is not in
the model registry: `nfab calibrate bench.heldout.swiglu:user_swiglu --dataset stdlib-text`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

task = "lm"
optimizer = "adamw"
vocab_size = 256
block_size = 64


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + swiglu(norm(x))."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.attn_norm = nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.mlp_norm = nn.RMSNorm(d_model)
        hidden = 8 * d_model // 3
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class UserSwiGLU(nn.Module):
    """Token + learned position embeddings -> blocks -> RMSNorm -> head tied to the embedding."""

    task = task
    optimizer = optimizer
    vocab_size = vocab_size
    block_size = block_size

    def __init__(self, n_layer: int = 4, d_model: int = 64, n_head: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.position = nn.Parameter(torch.randn(block_size, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.position[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()


def user_swiglu(n_layer: int = 4, d_model: int = 64, n_head: int = 4) -> UserSwiGLU:
    """Factory for `module:factory` use (`bench.heldout.swiglu:user_swiglu`)."""
    return UserSwiGLU(n_layer=n_layer, d_model=d_model, n_head=n_head)
