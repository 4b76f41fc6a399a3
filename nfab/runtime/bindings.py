"""Bindings: every parameter gets a region class from its module type and name.

A norm layer's scale is not a conv kernel: regions let a profile route them apart.
Classes: conv, linear, embedding, head, norm, bias, other; tensors below a size
threshold are `small`. Precedence: norm, then bias, then small, then head, then the
module type.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from nfab.heads import default_heads

SMALL_NUMEL = 1024
"""Parameters with fewer elements than this are their own region class, `small`."""

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


@dataclass(frozen=True, slots=True)
class Binding:
    """One parameter's name, size and region class."""

    name: str
    numel: int
    region: str


def _module_region(module: nn.Module) -> str:
    if isinstance(module, _NORMS) or type(module).__name__.lower().endswith("norm"):
        return "norm"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return "embedding"
    if isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and _matrix(module)):
        return "linear"  # Conv1D: Transformers' GPT-2 family's linear layer (weight transposed), not a conv
    return "other"


def _matrix(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 2


def trained_module(module: nn.Module) -> nn.Module:
    """The user's model under `torch.compile`'s wrapper (`OptimizedModule._orig_mod`, as in
    `DDP(torch.compile(model))`): the same parameter objects, named as the model names them
    (without `_orig_mod.`), so a profile's signature, its globs and the regions match either way."""
    while isinstance(inner := getattr(module, "_orig_mod", None), nn.Module):
        module = inner
    return module


def classify(
    model: nn.Module,
    head_modules: Iterable[str] | None = None,
    small_numel: int = SMALL_NUMEL,
) -> dict[str, Binding]:
    """Region class for every trainable parameter, keyed by its (first) qualified name.

    Tied weights appear once, under the name `named_parameters` gives them first.
    `head_modules` are module-name prefixes that form the output head (default: `default_heads`).
    """
    heads = tuple(head_modules) if head_modules is not None else default_heads(model)
    out: dict[str, Binding] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        is_head = any(mod_name == h or mod_name.startswith(h + ".") for h in heads)
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            kind = _module_region(module)
            if kind == "norm":
                region = "norm"
            elif p_name == "bias" or p_name.endswith("_bias"):
                region = "bias"
            elif param.numel() < small_numel:
                region = "small"
            elif is_head:
                region = "head"
            else:
                region = kind
            out[full] = Binding(full, param.numel(), region)
    return out
