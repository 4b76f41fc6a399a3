"""Data sets (digits, stdlib text, generated images, CIFAR-10 and text from disk) and loaders."""

from nfab.data.loader import make_eval_loader, make_loader
from nfab.data.registry import DATASETS, PATH_DATASETS, build_dataset
from nfab.data.spec import DataSpec, SpecDataset, Split

__all__ = [
    "DATASETS",
    "PATH_DATASETS",
    "DataSpec",
    "SpecDataset",
    "Split",
    "build_dataset",
    "make_eval_loader",
    "make_loader",
]
