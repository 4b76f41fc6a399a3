"""A GPT-style decoder-only Transformer, from a CPU-seconds `nano` to a GPT-3 XL-like `1.3b`.

Token and position `nn.Embedding`s, pre-norm blocks with causal attention through
`F.scaled_dot_product_attention`, a final `nn.LayerNorm` and an LM `head` whose weight
is tied to the token embedding (so `named_parameters` lists it once, as
`tok_emb.weight`). The large sizes exist to plan buckets and wire bytes at realistic
scale: build them on the `meta` device, where they take no memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from nfab.errors import ConfigError
from nfab.models.attention import SelfAttention
from nfab.models.spec import ModelSpec

BYTE_VOCAB = 256
GPT2_VOCAB = 50304  # GPT-2's 50,257 tokens padded to a multiple of 64, as nanoGPT does


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTSize:
    """Transformer shape of one named GPT size."""

    n_layer: int
    """Number of Transformer blocks."""
    d_model: int
    """Embedding width."""
    n_head: int
    """Attention heads (d_model must divide evenly)."""
    vocab_size: int
    """Default vocabulary size."""
    block_size: int
    """Default context length."""


GPT_SIZES: dict[str, GPTSize] = {
    "nano": GPTSize(n_layer=2, d_model=128, n_head=4, vocab_size=BYTE_VOCAB, block_size=64),
    "small": GPTSize(n_layer=6, d_model=384, n_head=6, vocab_size=BYTE_VOCAB, block_size=256),
    # GPT-3 paper shapes (Brown et al. 2020, table 2.1), context 2048.
    "125m": GPTSize(n_layer=12, d_model=768, n_head=12, vocab_size=GPT2_VOCAB, block_size=2048),
    "350m": GPTSize(n_layer=24, d_model=1024, n_head=16, vocab_size=GPT2_VOCAB, block_size=2048),
    "1.3b": GPTSize(n_layer=24, d_model=2048, n_head=16, vocab_size=GPT2_VOCAB, block_size=2048),
}


class MLP(nn.Module):
    """Two-layer GELU MLP, 4x wide."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_head, causal=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only LM: (B, T) int64 tokens -> (B, T, vocab) logits."""

    def __init__(self, *, n_layer: int, d_model: int, n_head: int, vocab_size: int, block_size: int):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_head) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying (Press & Wolf 2017)
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        # GPT-2's init: N(0, 0.02) everywhere, residual output projections scaled by
        # 1/sqrt(2 * n_layer) because each block adds two of them to the residual stream.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.blocks(self.tok_emb(idx) + self.pos_emb(pos))
        return self.head(self.ln_f(x))


def gpt(
    *,
    size: str = "nano",
    vocab_size: int | None = None,
    block_size: int | None = None,
) -> ModelSpec:
    """A GPT of a named size; `vocab_size` / `block_size` override the size's defaults."""
    if size not in GPT_SIZES:
        raise ConfigError(f"gpt: unknown size {size!r}; choose one of {list(GPT_SIZES)}")
    shape = GPT_SIZES[size]
    vocab = shape.vocab_size if vocab_size is None else vocab_size
    block = shape.block_size if block_size is None else block_size
    if vocab < 1 or block < 1:
        raise ConfigError(f"gpt: vocab_size and block_size must be >= 1, got {vocab}, {block}")
    module = GPT(
        n_layer=shape.n_layer,
        d_model=shape.d_model,
        n_head=shape.n_head,
        vocab_size=vocab,
        block_size=block,
    )
    return ModelSpec(
        name="gpt",
        module=module,
        task="lm",
        head_modules=("head",),
        shard_units=tuple(f"blocks.{i}" for i in range(shape.n_layer)),
        optimizer="adamw",
        vocab_size=vocab,
        block_size=block,
        options={"size": size, "vocab_size": vocab, "block_size": block},
    )
