"""Held-out user models: written the way a user writes one, never in nfab's model registry.

Recipe-style models (issue 31), each with its calibration config beside it and trained by
`bench.recipeloop` under its recipe (clipping, accumulation, warm-up + cosine):
- `bench.heldout.recipe_gpt:recipe_gpt`: nanoGPT-style, bias-free LayerNorm, fused qkv, SDPA, tied head (AdamW);
- `bench.heldout.recipe_cnn:recipe_cnn`: ResNet-style with BatchNorm on digits (SGD momentum);
- `bench.heldout.recipe_vit:recipe_vit`: a small ViT on digits (AdamW).

From the repository root: `PYTHONPATH=. nfab calibrate bench.heldout.recipe_gpt:recipe_gpt
--config bench/heldout/recipe_gpt.yaml --steps 100`.
"""
