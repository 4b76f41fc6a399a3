"""Held-out user models: written the way a user writes one, never in nfab's model registry.

- `bench.heldout.gpt:user_gpt`: torch's `nn.MultiheadAttention`, tied head (AdamW);
- `bench.heldout.encoder:user_lm`: torch's `nn.TransformerEncoder`, untied head (AdamW);
- `bench.heldout.swiglu:user_swiglu`: RMSNorm, SwiGLU, SDPA attention, tied head (plain Adam).

From the repository root: `PYTHONPATH=. nfab calibrate bench.heldout.gpt:user_gpt --dataset stdlib-text`.
"""
