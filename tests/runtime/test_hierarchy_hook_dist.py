"""The hook with `hierarchy=` on real gloo DDP, 2 nodes x 2 ranks (torchrun's layout), no mocks.

The reference is computed here, in the test process, from every rank's own gradients
(taken before communication): sign is the majority of node sums times the mean over nodes
of each node's mean |node mean| per shard piece of a slice; FP32 slices are the plain mean.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import twins  # noqa: E402

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402
from nfab.errors import NfabError  # noqa: E402
from nfab.profile.schema import Profile  # noqa: E402
from nfab.runtime.frontends.ddp import Runtime, nfab_hook  # noqa: E402
from nfab.wire.registry import allreduce_factor  # noqa: E402

pytestmark = pytest.mark.world_size(4)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 48), nn.Tanh(), nn.Linear(48, 33), nn.Tanh(), nn.Linear(33, 5))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 40, generator=g), torch.randn(16, 5, generator=g)


def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((m(x) - y) ** 2).mean()




def _scenario(rank: int, route: str | dict, ef: bool, steps: int, hierarchy, cls=Runtime, bucket_mb=1.0) -> dict:
    m = model()
    ddp = DDP(m, bucket_cap_mb=bucket_mb)
    plain = DDP(copy.deepcopy(m), bucket_cap_mb=bucket_mb)
    names = {id(p): n for n, p in m.named_parameters()}
    rt = cls(ddp, Profile.static(route), explicit=True, cost_model=None, error_feedback=ef, hierarchy=hierarchy)
    layouts: list[list[list[str]]] = []

    def recording(state, bucket):  # noqa: ANN001, ANN202 - unannotated: DDP checks real annotations
        layouts[-1].append([names[id(p)] for p in bucket.parameters()])
        return nfab_hook(state, bucket)

    ddp.register_comm_hook(rt, recording)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out: dict = {"local": [], "reduced": [], "plain": [], "params": [], "stats": [], "layouts": layouts}
    for step in range(steps):
        x, y = batch(rank, step)
        grads = torch.autograd.grad(loss_fn(m, x, y), list(m.parameters()))  # this rank's own, no DDP
        out["local"].append({n: g.clone() for (n, _), g in zip(m.named_parameters(), grads, strict=True)})
        plain.module.load_state_dict(m.state_dict())
        plain.zero_grad()
        loss_fn(plain, x, y).backward()
        out["plain"].append({n: p.grad.clone() for n, p in plain.module.named_parameters()})
        layouts.append([])
        opt.zero_grad()
        loss_fn(ddp, x, y).backward()
        st = rt.step_stats()
        out["stats"].append((st.intra_node_bytes, st.inter_node_bytes, st.wire_bytes, st.baseline_wire_bytes,
                             dict(st.route_elements), st.fallback_reason))
        out["reduced"].append({n: p.grad.clone() for n, p in m.named_parameters()})
        opt.step()
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    out["residuals"] = {k: v.clone() for k, v in rt.residuals.items()}
    out["two_level"] = rt.two_level is not None
    out["regions"] = dict(rt.regions)
    return out


LINEAR = {"linear": "sign"}  # weights sign, biases (and nothing else) fp32: a mixed bucket


class LinearEfOff(Runtime):
    """As after the drift monitor's `ef_off` event for `linear`: its error feedback stays off."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.health.ef_off.add("linear")


def _all(rank: int, world: int) -> dict:
    res = {
        "sign": _scenario(rank, LINEAR, False, 3, "2x2"),
        "sign-meta": _scenario(rank, LINEAR, False, 3, "2x2", cls=twins.DefaultDeviceMeta),
        "q8-ef": _scenario(rank, {"linear": "q8", "bias": "sign"}, True, 3, 2, bucket_mb=0.005),
        "q8-ef-off": _scenario(rank, {"linear": "q8", "bias": "sign"}, True, 3, 2, cls=LinearEfOff, bucket_mb=0.005),
        "fp32": _scenario(rank, "fp32", True, 1, 2),
        "q2-two": _scenario(rank, {"linear": "q2"}, False, 1, nfab.Hierarchy(local_world=2)),
    }
    for spec in ("3", 3, "4x2", "2y"):
        try:
            nfab.attach(DDP(model()), route="sign", cost_model=None, hierarchy=spec)
        except NfabError as exc:
            res[f"bad-{spec!r}"] = str(exc)
    return res


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_all, 4, timeout_s=300)


def _flat(grads: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([grads[n].reshape(-1) for n in names])


def reference_sign(per_rank: list[dict[str, torch.Tensor]], names: list[str], local_world: int) -> torch.Tensor:
    """Majority of node sums, times the mean over nodes of mean |node mean| per shard piece of each slice."""
    xs = torch.stack([_flat(g, names) for g in per_rank])
    nodes = xs.shape[0] // local_world
    node_mean = xs.view(nodes, local_world, -1).sum(1) / local_world
    vote = torch.sign(torch.sign(node_mean).sum(0))
    numel = xs.shape[1]
    shard = -(-numel // local_world)
    bounds = sorted({0, numel, *range(shard, numel, shard)}
                    | set(torch.tensor([per_rank[0][n].numel() for n in names]).cumsum(0).tolist()))
    scale = torch.empty(numel)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        scale[lo:hi] = node_mean[:, lo:hi].abs().mean(1).mean()
    return vote * scale


def _check_replicas(res: list[dict], key: str) -> None:
    for r in res[1:]:
        for a, b in zip(res[0][key]["params"], r[key]["params"], strict=True):
            assert torch.equal(a, b)  # every step, bit for bit


@pytest.mark.parametrize("key", ["sign", "sign-meta"])
def test_sign_is_the_majority_of_node_sums_and_replicas_stay_identical(runs, key):
    assert all(r[key]["two_level"] for r in runs)
    _check_replicas(runs, key)
    for step in range(3):
        locals_ = [r[key]["local"][step] for r in runs]
        got = runs[0][key]["reduced"][step]
        (bucket,) = runs[0][key]["layouts"][step]  # one bucket: weights (sign) and biases (fp32)
        regions = runs[0][key]["regions"]
        weights = [n for n in bucket if regions[n] == "linear"]
        want = reference_sign(locals_, weights, 2)
        flat = _flat(got, weights)
        assert torch.equal(torch.sign(flat), torch.sign(want)), step
        torch.testing.assert_close(flat, want, rtol=1e-5, atol=0)
        for n in bucket:
            if n not in weights:  # fp32 slices (biases, the small last layer): the plain mean over all 4 ranks
                torch.testing.assert_close(got[n], runs[0][key]["plain"][step][n], rtol=1e-6, atol=1e-8)
        intra, inter, wire, baseline, elements, _ = runs[0][key]["stats"][step]
        numel = sum(locals_[0][n].numel() for n in bucket)
        assert baseline == round(allreduce_factor(4) * numel * 4)  # plain DDP's bytes at W=4
        assert 0 < inter < intra < wire
        assert elements["signgather"] == sum(locals_[0][n].numel() for n in weights)
    # the meta-default run allocates every tensor on the gradient's device: the same bits
    if key == "sign-meta":
        for a, b in zip(runs[0]["sign"]["params"], runs[0]["sign-meta"]["params"], strict=True):
            assert torch.equal(a, b)


def test_error_feedback_lives_on_each_ranks_shard_and_replicas_stay_identical(runs):
    _check_replicas(runs, "q8-ef")
    for r in runs:  # several buckets (5 KB cap); every rank owes something on its own shards
        assert any(bool(v.abs().sum() > 0) for v in r["q8-ef"]["residuals"].values())
    # the two ranks of a node hold disjoint parts: their supports never overlap
    for node in (0, 1):
        a, b = runs[2 * node]["q8-ef"]["residuals"], runs[2 * node + 1]["q8-ef"]["residuals"]
        for n in a:
            assert not ((a[n] != 0) & (b[n] != 0)).any(), n
    assert runs[0]["q8-ef"]["stats"][-1][4].get("q8", 0) > 0


def test_error_feedback_switched_off_by_the_monitor_stays_off_on_the_two_level_path(runs):
    _check_replicas(runs, "q8-ef-off")
    for r in runs:
        regions, owed = r["q8-ef-off"]["regions"], r["q8-ef-off"]["residuals"]
        assert not any(regions[n] == "linear" for n in owed)  # neither added nor staged again
        assert any(regions[n] == "bias" for n in owed)  # the other lossy region keeps its own


def test_fp32_route_with_a_hierarchy_is_plain_ddp(runs):
    for r in runs:
        got, plain = r["fp32"]["reduced"][0], r["fp32"]["plain"][0]
        assert all(torch.equal(got[n], plain[n]) for n in got)
        intra, inter, *_ = r["fp32"]["stats"][0]
        assert intra == inter == 0  # nothing lossy: no two-level traffic


def test_capacity_is_checked_at_w_nodes(runs):
    """q2 leaves fewer than 2 levels per rank at W=4 (flat: over capacity), 2 levels at W = 2 nodes."""
    from nfab.wire.registry import REDUCERS

    assert not REDUCERS["qsum-q2"].capacity(4).ok and REDUCERS["qsum-q2"].capacity(2).ok
    _, inter, _, _, elements, reason = runs[0]["q2-two"]["stats"][0]
    assert elements.get("q2", 0) > 0 and "capacity" not in reason and inter > 0
    _check_replicas(runs, "q2-two")


def test_a_bad_hierarchy_is_refused_at_attach_with_one_line(runs):
    for r in runs:
        assert "3 ranks per node do not divide the world size 4" in r["bad-'3'"]
        assert "3 ranks per node do not divide the world size 4" in r["bad-3"]
        assert "4 nodes x 2 ranks is not the world size 4" in r["bad-'4x2'"]
        assert "NODESxLOCAL" in r["bad-'2y'"]
        assert all("\n" not in v for k, v in r.items() if k.startswith("bad-"))
