"""Per-rank data loaders: `make_loader` for training, `make_eval_loader` for evaluation.

Training uses `DistributedSampler` with explicit `rank` / `num_replicas`, so it needs no
initialised process group (calibration replays W virtual ranks in one process). Every
rank gets the same number of batches — DDP issues one collective set per step, and a
rank with an extra batch would hang the others. With `drop_last=False` the sampler
pads by repeating up to W-1 samples to achieve that. Evaluation instead wants every
sample exactly once: `make_eval_loader` gives disjoint strided shards without padding
(lengths differ by at most one), so reduce sums and counts across ranks, not means.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from nfab.errors import ConfigError


def _check_rank(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in a world of size {world_size}")


def make_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    shuffle: bool = True,
    drop_last: bool = True,
) -> DataLoader:
    """This rank's shard in seeded order; call `loader.sampler.set_epoch(e)` each epoch.

    `batch_size` is per rank (global batch = batch_size * world_size). `drop_last`
    applies to both the sampler (drop the tail that does not divide by W instead of
    padding) and the loader (drop the last partial batch).
    """
    _check_rank(batch_size, rank, world_size)
    sampler = DistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    if drop_last and len(sampler) < batch_size:
        raise ConfigError(
            f"{len(dataset)} samples give each of {world_size} ranks {len(sampler)}, "  # type: ignore[arg-type]
            f"fewer than one batch of {batch_size}"
        )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last)


def make_eval_loader(dataset: Dataset, *, batch_size: int, rank: int, world_size: int,
                     collate: Callable[[list[Any]], Any] | None = None) -> DataLoader:
    """This rank's disjoint strided shard (indices rank, rank+W, ...), in order, unpadded."""
    _check_rank(batch_size, rank, world_size)
    indices = list(range(rank, len(dataset), world_size))  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=batch_size, sampler=indices, drop_last=False, collate_fn=collate)
