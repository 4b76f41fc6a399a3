"""A second model nfab was never tuned on, written after the first profile work had landed.

`gpt.py` was the model the control work was measured on, so by now nfab is partly tuned
to it. This one is a check no route or threshold was chosen on: a byte-level language model
built from torch's own `nn.TransformerEncoder` (pre-norm layers with their fused attention,
three of them, d=96, GELU), a causal mask, learned positions and an *untied* head, the way a
user who reaches for torch's stock layers writes one. It is not in the model registry:
`nfab calibrate bench.heldout.encoder:user_lm --dataset stdlib-text`.

Class attributes (read by nfab's model registry) declare what a user model would: a language
model over bytes (vocab 256) trained with AdamW.
"""

from __future__ import annotations

import torch
from torch import nn

task = "lm"
optimizer = "adamw"
vocab_size = 256
block_size = 64


class UserLM(nn.Module):
    """Token + learned position embeddings -> `nn.TransformerEncoder` (causal) -> LayerNorm -> head."""

    task = task
    optimizer = optimizer
    vocab_size = vocab_size
    block_size = block_size

    def __init__(self, n_layer: int = 3, d_model: int = 96, n_head: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.position = nn.Parameter(torch.zeros(block_size, d_model))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_head, dim_feedforward=4 * d_model, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx) + self.position[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device, dtype=x.dtype)
        return self.head(self.norm(self.encoder(x, mask=mask, is_causal=True)))


def user_lm(n_layer: int = 3, d_model: int = 96, n_head: int = 4) -> UserLM:
    """Factory for `module:factory` use (`bench.heldout.encoder:user_lm`)."""
    return UserLM(n_layer=n_layer, d_model=d_model, n_head=n_head)
