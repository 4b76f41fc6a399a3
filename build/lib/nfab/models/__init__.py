"""Model families (`resnet18`, `vit`, `gpt`) and user models, described by a `ModelSpec`."""

from nfab.models.registry import MODELS, build_model, load_factory, model_signature
from nfab.models.spec import ModelSpec, OptimizerFamily, Task

__all__ = [
    "MODELS",
    "ModelSpec",
    "OptimizerFamily",
    "Task",
    "build_model",
    "load_factory",
    "model_signature",
]
