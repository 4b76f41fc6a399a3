"""A model nfab was never tuned on: a small GPT written the way a user would write it.

Judging nfab only on its own study models overfits the product to them. This module is
deliberately *not* in the model registry and does not use nfab's own attention or GPT
code: it is torch's `nn.MultiheadAttention`, pre-norm blocks, learned positions and a
head tied to the token embedding, as in a user's repository. Use it as a user model,
`nfab calibrate bench.heldout.gpt:user_gpt --dataset stdlib-text`, or build it directly.

Class attributes (read by nfab's model registry) tell nfab what a user model would declare: it is a language model
trained with AdamW over bytes (vocab 256).
"""

from __future__ import annotations

import torch
from torch import nn

task = "lm"
optimizer = "adamw"
vocab_size = 256
block_size = 64


class _Block(nn.Module):
    """Pre-norm Transformer block on `nn.MultiheadAttention` with a causal mask."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class UserGPT(nn.Module):
    """Byte-level decoder: token + learned position embeddings, `n_layer` blocks, tied head."""

    task = task
    optimizer = optimizer
    vocab_size = vocab_size
    block_size = block_size

    def __init__(self, n_layer: int = 2, d_model: int = 128, n_head: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight  # tied, as users do

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def user_gpt(n_layer: int = 2, d_model: int = 128, n_head: int = 4) -> UserGPT:
    """Factory for `module:factory` use (`bench.heldout.gpt:user_gpt`)."""
    return UserGPT(n_layer=n_layer, d_model=d_model, n_head=n_head)
