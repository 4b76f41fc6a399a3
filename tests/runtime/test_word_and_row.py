"""The control word and the coalesced row assembled on the host (numpy) are the bytes the torch
path builds on every other device; parts read back as views of the gathered rows (no copy),
the non-finite flag is the same on both paths, and groups carry their slice table."""

import math

import numpy as np
import pytest
import torch

from nfab.runtime.control import word as control
from nfab.runtime.control.controller import Group
from nfab.runtime.core import coalesce
from nfab.runtime.core.plan import Slice
from nfab.wire.dispatch import host_paths


def _both(fn):
    """fn() on the host path, and on the path every other device takes."""
    host = fn()
    with host_paths(False):
        device = fn()
    return host, device


def _word(bucket_sq, carried, loss, cosine, cols):
    b = control.Builder()
    placed = [b.add(c) for c in cols]
    return b.build(bucket_sq, carried, control.StepValues(loss, cosine)), placed


@pytest.mark.parametrize("loss", [None, torch.tensor(2.5), torch.tensor(1 / 3, dtype=torch.float64),
                                  torch.tensor(0.7, dtype=torch.bfloat16), torch.tensor(float("nan"))])
@pytest.mark.parametrize("carried", [None, torch.tensor(3.25)])
@pytest.mark.parametrize("cosine", [None, 0.123456789, torch.tensor(0.5)])
def test_host_word_is_the_device_word(loss, carried, cosine):
    cols = [torch.rand(5), torch.rand(2, 3, dtype=torch.float64), torch.tensor([float("inf"), -0.0])]
    bucket_sq = torch.tensor(float("nan")) if loss is None else torch.tensor(17.0)
    (host, placed), (device, placed_d) = _both(lambda: _word(bucket_sq, carried, loss, cosine, cols))
    assert placed == placed_d
    assert host.dtype == device.dtype == torch.float32
    assert torch.equal(host.view(torch.int32), device.view(torch.int32))
    table = torch.stack([host, host])
    assert torch.equal(placed[1].of(table)[0], cols[1].reshape(-1).float())


def test_nonfinite_is_the_same_flag_on_both_paths():
    for sq in (1.0, float("inf"), float("nan")):
        table = torch.tensor([[2.0] * control.HEAD_LEN, [2.0] * control.HEAD_LEN])
        table[1, control.Head.BUCKET_SQ] = sq
        host, device = _both(lambda t=table: control.nonfinite(t))
        assert isinstance(host, bool) and isinstance(device, torch.Tensor)
        assert host == bool(device) == (not math.isfinite(sq))


def _payloads():
    g = torch.Generator().manual_seed(0)
    return [torch.rand(13, generator=g),  # a control word: fp32, 52 bytes (not a multiple of 8)
            torch.randint(0, 256, (37,), dtype=torch.uint8, generator=g),
            torch.randint(-9, 9, (3,), dtype=torch.int64, generator=g),
            torch.rand(5, generator=g).to(torch.float16)]


def test_host_row_is_the_device_row():
    tensors = _payloads()
    (row, parts), (row_d, parts_d) = _both(lambda: coalesce.pack(tensors, torch.device("cpu")))
    assert parts == parts_d
    assert torch.equal(row, row_d) and row.numel() % coalesce.ALIGN == 0
    assert all(p.offset % coalesce.ALIGN == 0 for p in parts)
    assert row.tolist() == _row_by_hand(tensors)
    bf16 = [torch.rand(3).to(torch.bfloat16), torch.rand(2)]  # numpy has no bf16: the torch path on both
    assert coalesce.pack(bf16, torch.device("cpu"))[0].tolist() == _row_by_hand(bf16)


def _row_by_hand(tensors: list[torch.Tensor]) -> list[int]:
    """The row `coalesce.pack` documents, byte by byte: each tensor's bytes from an 8-byte boundary,
    zeros up to the next one."""
    out: list[int] = []
    for t in tensors:
        out += t.contiguous().view(torch.uint8).tolist()
        out += [0] * (-len(out) % 8)
    return out


@pytest.mark.parametrize("host", [True, False])
def test_parts_read_back_as_views_of_the_gathered_rows(host):
    tensors = _payloads()
    row, parts = coalesce.pack(tensors, torch.device("cpu"))
    rows = torch.stack([row, row.roll(0)])  # two ranks' rows (the same bytes)
    base = rows.data_ptr()
    with host_paths(host):
        for t, p in zip(tensors, parts, strict=True):
            got = p.rows(rows)
            assert got.shape == (2, t.numel()) and got.dtype == t.dtype
            assert torch.equal(got[1], t)
            start = got.data_ptr() - base  # a view into the rows, not a copy
            assert 0 <= start < rows.numel() and start == p.offset


def test_groups_carry_their_slice_table():
    slices = (Slice(4, 10, "a.weight", "conv"), Slice(20, 3, "a.bias", "bias"), Slice(30, 0, "b", "norm"))
    g = Group("qsum-q8", slices, False)
    assert g.lengths == (10, 3, 0) and g.numel == 13 and g.label == "q8" and g.lossy
    assert g.offsets.tolist() == [4, 20, 30] and g.offsets.dtype == np.int64
    with pytest.raises(ValueError):
        g.offsets[0] = 1  # shared by every step: read-only
    assert g == Group("qsum-q8", slices, False) and hash(g) == hash(Group("qsum-q8", slices, False))
    assert not Group("allreduce-fp32", slices, True).lossy
