"""Device hygiene: nfab imported fresh under a non-CPU default device still trains on the CPU.

Module-level tensors are made at import and take the caller's default device unless they
name one. A program that set `torch.set_default_device("meta")` (or imported nfab and
attached inside `with torch.device("meta")`) and trained on CPU failed in blockq's
`scale_codes` (`SCALES.numpy()` on a meta tensor), reached from the cost model's codec
measurement at attach. Each rank here forgets every nfab module it holds and imports nfab
again under the meta default, so every module-level statement runs under it (a fresh
interpreter per rank would pay torch's and DDP's import, 20-40 s on this machine, to test
the same thing).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch

from nfab.distributed import run_ranks

PACKAGE = Path(__file__).resolve().parents[2] / "nfab"
FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "linspace", "logspace", "eye",
             "randn", "rand", "randint", "randperm"}
ROUTES = {"linear": "bq3", "bias": "sign", "head": "q8"}  # block-scaled (SCALES), sign votes, exact qsum
CPU = torch.device("cpu")


def test_no_module_level_tensor_without_a_device():
    """Every torch factory call that runs at import (a module-level statement) names its device."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for stmt in ast.parse(path.read_text()).body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # bodies run when called, not at import
            for node in ast.walk(stmt):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "torch" and "device" not in {k.arg for k in node.keywords}):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, "module-level tensors without a device: " + ", ".join(found)


def _fresh_nfab():
    """nfab imported again from scratch: every nfab module this process holds forgotten first."""
    for name in [m for m in sys.modules if m == "nfab" or m.startswith("nfab.")]:
        del sys.modules[name]
    return importlib.import_module("nfab")


def _train(nfab, meta_attach: bool, cost_model) -> tuple[torch.Tensor, object]:
    """Three SGD steps of a small MLP on CPU under nfab's hook; (final parameters, the cost model)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, device=CPU), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8, device=CPU))
    ddp = DDP(model)
    with torch.device("meta" if meta_attach else "cpu"):
        rt = nfab.attach(ddp, route=ROUTES, head_modules=("2",), cost_model=cost_model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator(device=CPU).manual_seed(100 + torch.distributed.get_rank())
    for _ in range(3):
        x = torch.randn(16, 32, generator=g, device=CPU)
        y = torch.randint(0, 8, (16,), generator=g, device=CPU)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), rt.controller.cost_model


def _rank(rank: int, world_size: int) -> dict:
    """Rank 0: `set_default_device("meta")` before importing nfab; rank 1: the import and the
    first attach inside `with torch.device("meta")`. Then the same run under the CPU default."""
    if rank == 0:
        torch.set_default_device("meta")
        nfab = _fresh_nfab()
    else:
        with torch.device("meta"):
            nfab = _fresh_nfab()
    try:
        meta, cm = _train(nfab, meta_attach=rank == 1, cost_model="measure")  # codecs timed at attach
    finally:
        torch.set_default_device(None)
    plain, _ = _train(nfab, meta_attach=False, cost_model=cm)
    return {"meta": meta, "plain": plain, "measured": cm is not None}


@pytest.mark.world_size(2)
def test_fresh_import_under_a_meta_default_device_trains_on_cpu():
    """bq3, sign and q8 routes with the measured cost model: the replicas are bit-identical to
    each other and to the same run under the CPU default device."""
    runs = run_ranks(_rank, 2, timeout_s=240)
    for r in runs:
        assert r["measured"] and r["meta"].device == CPU and torch.isfinite(r["meta"]).all()
        assert torch.equal(r["meta"], r["plain"])  # the default device changed nothing
    assert torch.equal(runs[0]["meta"], runs[1]["meta"])  # replicas bit-identical
