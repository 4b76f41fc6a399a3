"""Sharding across ranks: complete, disjoint (up to sampler padding), seeded, equal length."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import TensorDataset

from nfab.data import build_dataset, make_eval_loader, make_loader
from nfab.errors import ConfigError


def rank_indices(n: int, world_size: int, **kwargs: object) -> list[list[int]]:
    ds = TensorDataset(torch.arange(n))
    return [
        [int(i) for (batch,) in make_loader(ds, batch_size=4, rank=r, world_size=world_size, **kwargs) for i in batch]
        for r in range(world_size)
    ]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("n", [48, 37])
def test_shards_complete_and_disjoint_without_drop_last(world_size: int, n: int) -> None:
    shards = rank_indices(n, world_size, seed=0, drop_last=False)
    assert len({len(s) for s in shards}) == 1, "every rank must run the same number of samples"
    counts = Counter(i for s in shards for i in s)
    assert set(counts) == set(range(n)), "complete"
    padding = len(shards[0]) * world_size - n
    assert 0 <= padding < world_size
    assert sum(c - 1 for c in counts.values()) == padding, "disjoint apart from the sampler's padding"
    if n % world_size == 0:
        assert all(c == 1 for c in counts.values())


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shards_disjoint_with_drop_last(world_size: int) -> None:
    shards = rank_indices(37, world_size, seed=0)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat))
    assert all(len(s) == (37 // world_size) // 4 * 4 for s in shards)


def test_order_is_seeded_and_changes_per_epoch() -> None:
    assert rank_indices(40, 2, seed=1) == rank_indices(40, 2, seed=1)
    assert rank_indices(40, 2, seed=1) != rank_indices(40, 2, seed=2)
    loader = make_loader(TensorDataset(torch.arange(40)), batch_size=4, rank=0, world_size=2, seed=1)
    first = [int(i) for (b,) in loader for i in b]
    loader.sampler.set_epoch(1)  # type: ignore[union-attr]
    assert first != [int(i) for (b,) in loader for i in b]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_eval_loader_exactly_once(world_size: int) -> None:
    ds = TensorDataset(torch.arange(37))
    seen = [
        int(i)
        for r in range(world_size)
        for (b,) in make_eval_loader(ds, batch_size=5, rank=r, world_size=world_size)
        for i in b
    ]
    assert sorted(seen) == list(range(37))


def test_real_dataset_batches() -> None:
    ds = build_dataset("digits", split="train", seed=0)
    x, y = next(iter(make_loader(ds, batch_size=16, rank=1, world_size=4, seed=0)))
    assert x.shape == (16, 1, 8, 8) and y.shape == (16,) and y.dtype == torch.int64
    lm = build_dataset("stdlib-text", split="test", seed=0, block_size=16, max_bytes=50_000)
    x, y = next(iter(make_loader(lm, batch_size=8, rank=0, world_size=2, seed=0)))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64


def test_loader_errors() -> None:
    ds = TensorDataset(torch.arange(10))
    with pytest.raises(ConfigError, match="rank 2 is not in a world of size 2"):
        make_loader(ds, batch_size=2, rank=2, world_size=2, seed=0)
    with pytest.raises(ConfigError, match="fewer than one batch"):
        make_loader(ds, batch_size=8, rank=0, world_size=2, seed=0)
    with pytest.raises(ConfigError, match="batch_size"):
        make_eval_loader(ds, batch_size=0, rank=0, world_size=1)
