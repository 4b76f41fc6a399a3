"""A tiny FSDP2 model and a user's loop for the FSDP2 front end's tests (importable by forked ranks)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import nfab
from nfab.profile.schema import Profile
from nfab.runtime.frontends.fsdp import NfabReduceScatter


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Tiny(nn.Module):
    """Two blocks, an embedding-like input layer and a head: 5 FSDP2 param groups' worth of regions."""

    def __init__(self, d: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(7, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def shard(model: Tiny, reduce_dtype: torch.dtype | None = None) -> Tiny:
    """`fully_shard` per block and on the root, as torchtitan does."""
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype is not None else MixedPrecisionPolicy()
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def grad_input(layout, rank: int, step: int) -> torch.Tensor:  # noqa: ANN001 - a ShardLayout
    """A reduce-scatter input as FSDP2 lays out a param group: random gradients where its real elements
    lie, zeros in its padding (every rank can make every rank's: the seed is the rank and step)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.zeros(layout.world_size, layout.chunk)
    for p in layout.params:
        for r in range(layout.world_size):
            n = p.real(r)
            x[r, p.offset : p.offset + n] = torch.randn(n, generator=g) * (1 + p.offset % 3)
    return x.reshape(-1)


def batch(rank: int, step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 7, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return x, y


def train(rank: int, steps: int, route: str | dict | None, *, accumulate: int = 1, clip: float | None = 1.0,
          reduce_dtype: torch.dtype | None = None, resume_at: int | None = None, inf_step: int | None = None,
          meta: bool = False, health: dict | None = None, cost_model: object = None) -> dict:
    """A user's FSDP2 loop: accumulation via set_requires_gradient_sync, clipping, AdamW. With
    `resume_at`, everything (model shards, optimizer, nfab) is saved there and a fresh copy continues;
    at `inf_step` rank 0's loss is infinite; `meta`: nfab's comms run with the meta device as default;
    `health`: the route attached as a profile with these health settings (e.g. probes every step);
    `cost_model`: what attach prices routes with (None: by bytes, as route= does)."""
    def build() -> tuple[Tiny, torch.optim.Optimizer, object]:
        torch.manual_seed(0)
        model = shard(Tiny(), reduce_dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        rt = None
        if route is not None and health is not None:
            prof = Profile.static(route)
            prof = prof.model_copy(update={"health": prof.health.model_copy(update=health)})
            rt = nfab.attach(model, prof, optimizer=opt, cost_model=cost_model, noise_moment=True)  # as route= does
        elif route is not None:
            rt = nfab.attach(model, route=route, optimizer=opt, cost_model=None)
        for comm in rt.comms if meta and rt is not None else ():
            comm.__class__ = MetaDefaultComm
        return model, opt, rt

    model, opt, rt = build()
    losses, stats = [], []
    for step in range(steps):
        if resume_at is not None and step == resume_at:
            saved = ({k: v.to_local().clone() for k, v in model.state_dict().items()},
                     _clone(opt.state_dict()), rt.state_dict() if rt is not None else None)
            model, opt, rt = build()
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.to_local().copy_(saved[0][k])
            opt.load_state_dict(saved[1])
            if rt is not None:
                rt.load_state_dict(saved[2])
        opt.zero_grad()
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            x, y = batch(rank, step * accumulate + micro)
            loss = nn.functional.cross_entropy(model(x), y) / accumulate
            if step == inf_step and rank == 0:
                loss = loss * float("inf")
            if rt is not None and micro == accumulate - 1:
                rt.observe_loss(loss)
            loss.backward()
        st = rt.step_stats() if rt is not None else None
        finite = all(p.grad is None or bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters())
        assert finite == (st is None or not st.skipped)  # a skipped step's shards are NaN, as plain FSDP2's
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if finite:  # what a loss scaler does
            opt.step()
        losses.append(loss.item())
        if st is not None:
            stats.append(st)
    params = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "params": params, "stats": stats}


class MetaDefaultComm(NfabReduceScatter):
    """nfab's comm run with the meta device as the default: an allocation that does not name the
    gradient's device fails (as a default-device allocation would on CUDA)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN201
        with torch.device("meta"):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _clone(obj):  # noqa: ANN001, ANN202 - an optimizer state dict, deep-copied (DTensors included)
    import copy

    return copy.deepcopy(obj)
