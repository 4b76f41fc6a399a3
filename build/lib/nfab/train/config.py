"""Typed training config: YAML file (path or shipped name) + dotted `key=value` overrides -> `TrainConfig`.

The types live in `nfab.config` (shared with `nfab calibrate`); this module is the
training layer's door to them.
"""

from __future__ import annotations

from nfab.config.files import apply_overrides, config_from_dict, load_config, merge, parse_override, read_yaml
from nfab.config.run import (
    DDP_BUCKET_MB,
    NFAB_BUCKET_MB,
    CommConfig,
    DataConfig,
    LaunchConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
)

__all__ = [
    "DDP_BUCKET_MB",
    "NFAB_BUCKET_MB",
    "CommConfig",
    "DataConfig",
    "LaunchConfig",
    "ModelConfig",
    "OptimConfig",
    "ScheduleConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "merge",
    "parse_override",
    "read_yaml",
]
