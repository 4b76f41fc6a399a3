"""The user's yardstick on the held-out user projects (bench/projects): calibrate each through
`nfab.calibrate`, then train it in the user's own DDP loop at W gloo ranks with FP32, bf16 and the profile.

    python -m bench.userprojects                       # all six, W=4, 300 steps
    python -m bench.userprojects --projects cnn,denoiser --steps 100 --json /tmp/p.json

Each project is what its user would have: a model factory, data (a file kind or a factory), a loss
(the user's, or the one the model's output carries) and an optimizer. The loop is the user's: plain
`DistributedDataParallel`, the optimizer, nfab's cosine schedule (the one calibration assumed),
`loss.backward()`, `opt.step()`; the variant decides only what DDP communicates:

| variant | what DDP communicates |
|---|---|
| `fp32` | plain DDP |
| `bf16` | PyTorch's `bf16_compress_hook` (a bf16 all-reduce: the sum accumulates in bf16) |
| `bf16-acc32` | bf16 on the wire, summed in fp32: an all-gather of every rank's bf16 gradient (W-1 payloads sent) |
| `profile` | `nfab.attach(profile, optimizer=opt, cost_model=None)`: the calibrated profile |
| `route:R` (`--routes bq2,sign`) | `nfab.attach(route=R, optimizer=opt, cost_model=None)`: a static route |

Every variant starts from the same seed and sees the same batches (`--seeds 0,1,2`: each seed its own
calibration and runs). The held-out loss is the project's
own loss over its whole held-out split (the noise a loss draws is seeded per batch, so variants are
paired). Bytes are what a rank sends per step on a ring (2(W-1)/W of the payload), nfab's from
`step_stats()`. The figures and the command that produced them are in docs/calibrate-your-own.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from bench.projects import autoencoder, cnn, contrastive, denoiser, files, hf_gpt2, nanogpt
from nfab.bench.variants import bf16_hook
from nfab.config.optim import lr_factor
from nfab.config.run import ScheduleConfig
from nfab.data import build_dataset
from nfab.data.loader import make_eval_loader, make_loader
from nfab.data.user import resolve_collate
from nfab.loss import batch_size_of, resolve_loss
from nfab.models import build_model
from nfab.train.loop import replicas_identical


@dataclass(frozen=True)
class Project:
    name: str
    model: str
    data: str
    loss: str | None
    optimizer: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)


def projects(data_dir: Path) -> dict[str, Project]:
    """The six projects, their data files written under `data_dir` (digits and stdlib sources: no download)."""
    adamw = {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01}
    return {p.name: p for p in (
        Project("cnn-npz", f"{cnn.__name__}:build", f"npz:{files.digits_npz(data_dir / 'digits.npz')}", None,
                {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}),
        Project("autoencoder-mse", f"{autoencoder.__name__}:build",
                f"npy:{files.digits_rows_npy(data_dir / 'rows.npy')}", f"{autoencoder.__name__}:mse", adamw),
        Project("denoiser", f"{denoiser.__name__}:build", f"{denoiser.__name__}:data", f"{denoiser.__name__}:loss",
                adamw),
        Project("contrastive", f"{contrastive.__name__}:build", f"{contrastive.__name__}:data",
                f"{contrastive.__name__}:info_nce", adamw),
        Project("nanogpt-tokens", f"{nanogpt.__name__}:build",
                f"tokens:{files.nanogpt_dir(data_dir / 'chars', chars=200_000)}", None, adamw,
                {"block_size": 32}),
        Project("gpt2-modeloutput", f"{hf_gpt2.__name__}:build", f"{hf_gpt2.__name__}:data", None, adamw),
    )}


VARIANTS = ("fp32", "bf16", "bf16-acc32", "profile")


def bf16_fp32_sum_hook(state, bucket):  # noqa: ANN001, ANN201 - DDP checks real annotations, not strings
    """bf16 on the wire, the mean taken in fp32: every rank's bf16 bucket all-gathered, then summed."""
    grad = bucket.buffer()
    world = dist.get_world_size()
    out = torch.empty(world * grad.numel(), dtype=torch.bfloat16)
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # renamed in torch 2.12
    fut = gather(out, grad.to(torch.bfloat16), async_op=True).get_future()

    def mean(f: torch.futures.Future) -> torch.Tensor:
        grad.copy_(out.view(world, -1).float().sum(0).div_(world))
        return grad

    return fut.then(mean)


@dataclass
class Row:
    project: str
    variant: str
    eval_loss: float = math.nan
    bytes_per_step: float = math.nan
    replicas_identical: bool = True
    seconds: float = math.nan


def _optimizer(model: torch.nn.Module, spec: dict[str, Any]) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if spec["name"] == "sgd":
        return torch.optim.SGD(params, lr=spec["lr"], momentum=spec["momentum"], weight_decay=spec["weight_decay"])
    return torch.optim.AdamW(params, lr=spec["lr"], weight_decay=spec["weight_decay"], betas=(0.9, 0.95))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, loss: Any, loader: Any) -> tuple[float, float]:
    """(sum of batch loss x samples, samples) over this rank's shard, each batch's draws seeded by its index."""
    model.eval()
    total, n = 0.0, 0
    for i, batch in enumerate(loader):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(10_000 + i)
            k = batch_size_of(batch)
            total += float(loss(model, batch)) * k
            n += k
    model.train()
    return total, n


def _worker(rank: int, world: int, project: Project, profile: str, steps: int, batch_size: int, port: int,
            out: str, variants: tuple[str, ...], seed: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    options = dict(project.options)
    window = {k: v for k, v in options.items() if k == "block_size"}  # the data's option too
    train = build_dataset(project.data, split="train", seed=0, **window)
    test = build_dataset(project.data, split="test", seed=0, **window)
    if project.data.startswith("tokens:"):
        options["vocab_size"] = train.spec.vocab_size
    loss = resolve_loss(project.loss)
    collate = resolve_collate(None)
    schedule = ScheduleConfig()
    rows = []
    for variant in variants:
        module = build_model(project.model, seed=seed, **options).module
        model = DDP(module)
        opt = _optimizer(module, project.optimizer)
        runtime = None
        if variant == "bf16":
            model.register_comm_hook(dist.group.WORLD, bf16_hook)
        elif variant == "bf16-acc32":
            model.register_comm_hook(None, bf16_fp32_sum_hook)
        elif variant == "profile":
            runtime = nfab.attach(model, profile, optimizer=opt, total_steps=steps, cost_model=None)
        elif variant.startswith("route:"):
            runtime = nfab.attach(model, route=variant.removeprefix("route:"), optimizer=opt, total_steps=steps,
                                  cost_model=None)
        loader = make_loader(train, batch_size=batch_size, rank=rank, world_size=world, seed=seed)
        sent, epoch, t0 = 0.0, 0, time.perf_counter()
        numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
        batches = iter(loader)
        torch.manual_seed(1 + rank + 1000 * seed)  # the loss's own draws (noise levels): the same per variant
        for step in range(steps):
            try:
                batch = next(batches)
            except StopIteration:
                epoch += 1
                loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
                batches = iter(loader)
                batch = next(batches)
            for group in opt.param_groups:
                group["lr"] = project.optimizer["lr"] * lr_factor(step, steps, schedule)
            value = loss(model, batch)
            if runtime is not None:
                runtime.observe_loss(value)
            value.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ring = 2 * (world - 1) / world
            if runtime is not None:
                sent += runtime.step_stats().wire_bytes
            elif variant == "bf16-acc32":
                sent += (world - 1) * numel * 2
            else:
                sent += ring * numel * (2 if variant == "bf16" else 4)
        identical = replicas_identical(module, torch.device("cpu"))  # a SHA-256 of every parameter, all ranks
        eval_loader = make_eval_loader(test, batch_size=64, rank=rank, world_size=world, collate=collate)
        total, n = held_out_loss(module, loss, eval_loader)
        sums = torch.tensor([total, float(n)], dtype=torch.float64)
        dist.all_reduce(sums)
        rows.append(Row(project.name, variant, float(sums[0] / sums[1]), sent / steps, identical,
                        time.perf_counter() - t0))
    if rank == 0:
        Path(out).write_text(json.dumps([asdict(r) for r in rows]))
    dist.destroy_process_group()


def run_project(project: Project, cal_root: Path, steps: int, world: int, batch_size: int,
                budget: float, routes: tuple[str, ...] = (), seed: int = 0) -> dict[str, Any]:
    out = cal_root / (project.name if seed == 0 else f"{project.name}-seed{seed}")
    t0 = time.perf_counter()
    result = nfab.calibrate(project.model, project.data, loss=project.loss, optimizer=project.optimizer,
                            world_size=world, steps=steps, batch_size=batch_size, out=out, overwrite=True,
                            budget=budget, seed=seed, **project.options)
    calibration_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "rows.json"
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        variants = VARIANTS + tuple(f"route:{r}" for r in routes)
        mp.start_processes(_worker, args=(world, project, str(result.profile_path), steps, batch_size, port,
                                          str(target), variants, seed), nprocs=world, join=True,
                           start_method="spawn")
        rows = json.loads(target.read_text())
    by = {r["variant"]: r for r in rows}
    fp32, bf16, acc32, prof = by["fp32"], by["bf16"], by["bf16-acc32"], by["profile"]
    return {
        "project": project.name, "seed": seed, "calibration_s": round(calibration_s, 1),
        "validation_passed": result.passed,
        "validation_gap": None if result.validation is None else result.validation.to_evidence()["gap"],
        "fp32_loss": fp32["eval_loss"], "bf16_loss": bf16["eval_loss"], "profile_loss": prof["eval_loss"],
        "gap_vs_fp32": prof["eval_loss"] / fp32["eval_loss"] - 1,
        "bf16_gap_vs_fp32": bf16["eval_loss"] / fp32["eval_loss"] - 1,
        "bf16_acc32_loss": acc32["eval_loss"], "bf16_acc32_gap_vs_fp32": acc32["eval_loss"] / fp32["eval_loss"] - 1,
        "x_fewer_than_fp32": fp32["bytes_per_step"] / prof["bytes_per_step"],
        "x_fewer_than_bf16": bf16["bytes_per_step"] / prof["bytes_per_step"],
        "replicas_identical": all(r["replicas_identical"] for r in rows),
        "routes": [p.routes for p in result.profile.phases],
        "static": {v.removeprefix("route:"): {"gap_vs_fp32": r["eval_loss"] / fp32["eval_loss"] - 1,
                                             "x_fewer_than_fp32": fp32["bytes_per_step"] / r["bytes_per_step"]}
                   for v, r in by.items() if v.startswith("route:")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--projects", default="", help="comma-separated names (default: all)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--calibrations", default="bench/calibrations/projects")
    parser.add_argument("--budget", type=float, default=3.0, help="nfab calibrate --budget (reference runs)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (model init, data order, calibration)")
    parser.add_argument("--routes", default="", help="static routes to run beside the profile (bq2,sign)")
    parser.add_argument("--json", default=None, help="write the rows here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as data_dir:
        todo = projects(Path(data_dir))
        names = [n for n in args.projects.split(",") if n] or list(todo)
        rows = []
        for name, seed in [(n, int(s)) for n in names for s in args.seeds.split(",")]:
            row = run_project(todo[name], Path(args.calibrations), args.steps, args.world_size, args.batch_size,
                              args.budget, tuple(r for r in args.routes.split(",") if r), seed)
            rows.append(row)
            print(f"{name:18} seed {seed} cal {row['calibration_s']:6.1f} s  validation {row['validation_passed']}  "
                  f"fp32 {row['fp32_loss']:.4f}  bf16 {row['bf16_loss']:.4f} ({row['bf16_gap_vs_fp32']:+.2%})  "
                  f"profile {row['profile_loss']:.4f} ({row['gap_vs_fp32']:+.2%})  "
                  f"{row['x_fewer_than_fp32']:.1f}x < fp32, {row['x_fewer_than_bf16']:.1f}x < bf16  "
                  f"replicas {'identical' if row['replicas_identical'] else 'DIFFER'}"
                  + "".join(f"  {r} {v['gap_vs_fp32']:+.2%} at {v['x_fewer_than_fp32']:.1f}x"
                            for r, v in row["static"].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
