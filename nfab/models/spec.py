"""`ModelSpec`: everything the rest of nfab needs to know about a built model.

Calibration, training and the runtime bindings never look inside a model family's
builder; they read the spec. That keeps the families free to differ (a CNN with a
torchvision-named `fc` head, a GPT whose head is tied to its token embedding) while
the layers above see one typed description.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from torch import nn

Task = Literal["classification", "lm"]
OptimizerFamily = Literal["sgd", "adamw"]

TASKS: tuple[str, ...] = get_args(Task)
OPTIMIZER_FAMILIES: tuple[str, ...] = get_args(OptimizerFamily)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A built model plus the facts about it that data, optimizer and bindings need."""

    name: str
    """Registry name (`"resnet18"`) or the user's `module.path:factory` string."""
    module: nn.Module
    """The model itself, on the device it was built on (possibly `meta`)."""
    task: Task
    """`"classification"` (images -> logits over classes) or `"lm"` (tokens -> next-token logits)."""
    head_modules: tuple[str, ...]
    """Module-name prefixes that form the classifier / LM head (region class `head`)."""
    optimizer: OptimizerFamily
    """Default optimizer family: `"sgd"` for CNNs, `"adamw"` for Transformers."""
    num_classes: int | None = None
    """Classification: number of output classes."""
    image_size: int | None = None
    """Classification: square input side in pixels the model was configured for, if fixed."""
    in_channels: int | None = None
    """Classification: input channels."""
    vocab_size: int | None = None
    """LM: vocabulary size (256 for byte-level text)."""
    block_size: int | None = None
    """LM: longest sequence the position embedding covers."""
    shard_units: tuple[str, ...] = ()
    """Module names `fully_shard` wraps one by one under FSDP, before the root (a Transformer's
    blocks: one block's parameters gathered at a time); empty: the root alone."""
    options: dict[str, object] = field(default_factory=dict)
    """The resolved builder options, recorded for provenance (profiles, run summaries)."""
    task_declared: bool = True
    """False for a user model that declared no task: it takes its data's (`nfab.config.pairing.adopt_task`)."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.optimizer not in OPTIMIZER_FAMILIES:
            raise ValueError(f"optimizer must be one of {OPTIMIZER_FAMILIES}, got {self.optimizer!r}")
        if not isinstance(self.head_modules, tuple) or not all(isinstance(h, str) for h in self.head_modules):
            raise ValueError(f"head_modules must be a tuple of str, got {self.head_modules!r}")
        if not isinstance(self.shard_units, tuple) or not all(isinstance(u, str) for u in self.shard_units):
            raise ValueError(f"shard_units must be a tuple of str, got {self.shard_units!r}")
        if self.task == "lm" and (self.vocab_size is None or self.block_size is None):
            raise ValueError("an lm ModelSpec needs vocab_size and block_size")

    @property
    def num_parameters(self) -> int:
        """Distinct parameters (a tied weight counts once), as `named_parameters` lists them."""
        return sum(p.numel() for p in self.module.parameters())

    def is_head(self, module_name: str) -> bool:
        """Whether a module (dotted name from `named_modules`) belongs to the head."""
        return any(module_name == h or module_name.startswith(h + ".") for h in self.head_modules)
