"""Held-out user models: written the way a user writes one, never in nfab's model registry.

- `bench.heldout.gpt:user_gpt`: torch's `nn.MultiheadAttention`, tied head (AdamW);
- `bench.heldout.encoder:user_lm`: torch's `nn.TransformerEncoder`, untied head (AdamW);
- `bench.heldout.swiglu:user_swiglu`: RMSNorm, SwiGLU, SDPA attention, tied head (plain Adam).

From the repository root: `PYTHONPATH=. nfab calibrate bench.heldout.gpt:user_gpt --dataset stdlib-text`.

Recipe-style models (issue 31), each with its calibration config beside it (`recipe_*.yaml`)
and trained by `bench.recipeloop` under its recipe (clipping, accumulation with `no_sync`,
warm-up + cosine, decay on matrices only):
- `bench.heldout.recipe_gpt:recipe_gpt`: nanoGPT-style, bias-free LayerNorm, fused qkv, SDPA, tied head (AdamW);
- `bench.heldout.recipe_cnn:recipe_cnn`: ResNet-style with BatchNorm on digits (SGD momentum);
- `bench.heldout.recipe_vit:recipe_vit`: a small ViT on digits (AdamW).
"""
