"""The one user-loop harness: a user's plain DDP (or FSDP2) loop, with one communication variant plugged in.

`python -m bench.study` trains every variant of a setting here; `python -m bench.userloop` (from the
repository root) runs one setting with a few variants and prints their rows, e.g.

    python -m bench.userloop --setting heldout --variants fp32,sign-ef,profile
    python -m bench.userloop --setting heldout --variants route:2d=bq3 --steps 100 --world-size 2

The study judges nfab where a user meets it: a hand-written loop (`DistributedDataParallel`,
an optimizer at a constant learning rate, `loss.backward()`, `opt.step()`), on W gloo ranks
started here. The variant decides only what the loop registers on DDP:

| variant | what DDP communicates |
|---|---|
| `fp32` | plain DDP (no hook) |
| `bf16` | PyTorch's `bf16_compress_hook` (bf16 DDP: the honest baseline) |
| `fp16` | PyTorch's `fp16_compress_hook` |
| `powersgd-r2`, `powersgd-r8` | PyTorch's `powerSGD_hook`, rank 2 / 8, ONE bucket (it aborts on gloo with several) |
| `sign` | `nfab.attach(route="sign", optimizer=opt)`: error feedback "auto" (off under Adam-style optimizers) |
| `sign-ef` | the same with `error_feedback=True` forced: what the health monitor must catch |
| `bq3` | `nfab.attach(route="bq3", optimizer=opt, noise_moment=False)`: block-scaled 3-bit qsum everywhere |
| `bl6`, `bl5` | the same with 6 and 5 levels (between bq3 and bq2 in bytes and in rounding error) |
| `bq2` | the same with 4 levels (base-13 digits at W=4: past 8x fewer bytes) |
| `profile` | `nfab.attach(profile, optimizer=opt)`: a calibrated profile as a user runs it ("auto" moment) |
| `bq2-nm`, `bl5-nm`, `profile-nm` | the same with `noise_moment=True` (rounding noise out of Adam's v) |
| `route:SPEC`, `route-ef:SPEC` | any static route (route grammar, or `2d=R`: R on the 2-D weights, rest fp32) |
| `auto` | `nfab.attach(model, "auto", optimizer=opt, total_steps=N, calibration_out=DIR)`: in-run calibration |
| `auto-rerun` | `nfab.attach(profile, optimizer=opt)` on the profile.json that `auto` wrote (list it after `auto`) |

`route-ef:` forces error feedback on.

`auto` calibrates inside the run (DDP, or FSDP2 with `--parallel fsdp`): windows of 2% of the steps
(at least 4) at steps 0, N/3 and 2N/3, where every rank samples its own gradient and one all-gather
per step (per FSDP2 module) shares the samples (its bytes
are in `wire_mb`). Its row adds `calibration`: the fitted routes per phase (`rt.profile.phases` at
the end of the run), the window steps, the all-gather's MB and their share of FP32's bytes, and the
folder of calibration.parquet and profile.json (`--calibration-out DIR`, else the run's temporary
folder, deleted afterwards). `auto-rerun` attaches that profile.json to a fresh run of the same seed
(its row's `calibration` names the routes it ran and the file).

The static block routes pass `noise_moment=False` (attach's "auto" would turn it on under
Adam) so that they measure the route itself; `-nm` measures the correction on top.

Every nfab variant hands `attach` the optimizer, as docs/api.md tells users to: nfab then
knows the optimizer family (error feedback) and its second moment (the drift monitor).

nfab variants run with `cost_model=None`: on loopback a measured cost model finds FP32
cheaper and would route every bucket to FP32; the study measures quality and bytes.

Bytes are what each rank sends per step under the collective's algorithm (ring all-reduce
sends 2(W-1)/W of its payload): FP32, bf16 and fp16 from the gradient size, PowerSGD from its
state's public `compression_stats()` (P, Q and the uncompressed tensors), nfab from its
runtime's `step_stats()`.

`--parallel fsdp` (a setting's `parallel`) runs the same loop under FSDP2 instead of DDP:
`fully_shard` on every block of the model's `nn.ModuleList`s, then on the root; accumulation
with `set_requires_gradient_sync(False)` on all but the last micro-batch; `clip_grad_norm_` on
the DTensor gradients; evaluation on the full weights gathered to every rank. There `fp32` is
plain FSDP2 and `fp32_mb` its FP32 reduce-scatter (each rank sends (W-1)/W of every padded
group), nfab variants attach to the FSDP2 root (`route:fp32`, `profile`, block routes, `sign`),
and each row carries rank 0's per-step training loss (`train_losses`):

    python -m bench.userloop --setting recipe-gpt --parallel fsdp --variants fp32,route:fp32,profile
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.studyspec import (
    FSDP_VARIANTS,
    NOISE_MOMENT,
    PARALLEL,
    ROUTE_EF_VARIANT,
    ROUTE_VARIANT,
    SETTINGS,
    VARIANTS,
    RunResult,
    Setting,
)
from nfab.bench.variants import bf16_hook
from nfab.data import build_dataset, make_loader
from nfab.data.loader import make_eval_loader
from nfab.distributed import start_method
from nfab.errors import NfabError
from nfab.models import build_model
from nfab.wire.registry import allreduce_factor

TWO_D_REGIONS = ("linear", "embedding", "head", "other")
"""Regions that hold the 2-D weights of a Transformer (norms, biases and small tensors stay fp32)."""

POWERSGD_BUCKET_MB = 1000.0
"""PowerSGD's single bucket on gloo (its second all-reduce is launched from a future callback)."""
COLLECTIVE_TIMEOUT_S = 300
"""A rank stuck in a collective this long fails the setting instead of hanging the study."""
POWERSGD_START_ITER = 2
"""PowerSGD runs vanilla all-reduce for this many steps first (its own warm-up)."""
AUTO, AUTO_RERUN = "auto", "auto-rerun"
AUTO_VARIANTS = (AUTO, AUTO_RERUN)
"""In-run calibration (`attach(model, "auto")`) and a second run on the profile it wrote (this harness only)."""


@dataclasses.dataclass(slots=True)
class AutoRunResult(RunResult):
    """An `auto` / `auto-rerun` row: a RunResult and what the in-run calibration decided."""

    calibration: dict[str, Any] | None = None
    """`phases` (name, start, routes), `window_steps`, `window_mb` (the samples' all-gather),
    `window_wire_mb` (all bytes of the window steps), `window_share` (window_mb / fp32_mb), `out`."""


def _result(row: dict[str, Any]) -> RunResult:
    return AutoRunResult(**row) if "calibration" in row else RunResult(**row)


def parse_route(text: str) -> str | dict[str, str]:
    """`R` (every region), `2d=R`, or `region=R,region=R` (the regions not named stay fp32)."""
    if "=" not in text:
        return text
    out: dict[str, str] = {}
    for part in text.split(","):
        key, _, route = part.partition("=")
        out.update({r: route for r in TWO_D_REGIONS} if key == "2d" else {key: route})
    return out


def _custom_route(variant: str) -> tuple[str | dict[str, str], bool] | None:
    """`route:SPEC` / `route-ef:SPEC`: the parsed route and whether error feedback is forced on."""
    for prefix, ef in ((ROUTE_VARIANT, False), (ROUTE_EF_VARIANT, True)):
        if variant.startswith(prefix) and variant[len(prefix):]:
            return parse_route(variant[len(prefix):]), ef
    return None


def _check_variant(variant: str, parallel: str) -> None:
    """One line for a variant this harness cannot run (here, before any rank is spawned)."""
    if variant not in VARIANTS and variant not in AUTO_VARIANTS and _custom_route(variant) is None:
        raise ValueError(f"unknown variant {variant!r} (known: {', '.join(VARIANTS + AUTO_VARIANTS)}, route:SPEC, "
                         "route-ef:SPEC)")
    if parallel == "fsdp" and variant not in (*FSDP_VARIANTS, *AUTO_VARIANTS) and not variant.startswith(ROUTE_VARIANT):
        raise ValueError(f"variant {variant!r} does not run under FSDP2 (known: {', '.join(FSDP_VARIANTS)}, "
                         "route:SPEC)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_variants(setting: Setting, variants: tuple[str, ...], *, seed: int = 0,
                 root: Path | None = None, calibration_out: Path | None = None) -> list[RunResult]:
    """Spawn W gloo ranks once; they train `setting` with each variant in turn (a fresh model,
    optimizer and DDP each time, same seed). One result per variant, as rank 0 saw it.
    `calibration_out`: where `auto` writes calibration.parquet and profile.json (default: the
    run's temporary folder)."""
    for v in variants:
        _check_variant(v, setting.parallel)
    results: dict[str, RunResult] = {}
    profile = None
    with_profile = [v for v in variants if v.removesuffix(NOISE_MOMENT) == "profile"]
    if with_profile:
        profile = str((root or Path.cwd()) / setting.profile) if setting.profile else None
        if profile is None or not Path(profile).is_file():
            for v in with_profile:
                results[v] = RunResult(setting.name, v, ok=False, seed=seed,
                                       error=f"profile {setting.profile} not found")
    if AUTO_RERUN in variants and AUTO not in variants[:variants.index(AUTO_RERUN)]:
        results[AUTO_RERUN] = RunResult(setting.name, AUTO_RERUN, ok=False, seed=seed,
                                        error="auto-rerun attaches the profile `auto` writes: list auto before it")
    todo = tuple(v for v in variants if v not in results)
    with tempfile.TemporaryDirectory(prefix="nfab-study-") as tmp:
        out = Path(tmp)
        cal = str(calibration_out or out / "auto")
        try:
            # spawn (a fresh interpreter per rank), or the rank server's fork under the test suite
            mp.start_processes(_worker, args=(setting, todo, profile, seed, _free_port(), str(out), cal),
                               nprocs=setting.world_size, join=True, start_method=start_method())
        except Exception as exc:  # a rank failed: its last line; variants that finished keep their result
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            error = lines[-1] if lines else type(exc).__name__
        else:
            error = ""
        for v in todo:
            f = out / f"{v}.json"
            results[v] = (_result(json.loads(f.read_text())) if f.exists()
                          else RunResult(setting.name, v, ok=False, seed=seed, error=error or "no result"))
    return [results[v] for v in variants]


def _optimizer(setting: Setting, model: torch.nn.Module) -> torch.optim.Optimizer:
    params: Any = [p for p in model.parameters() if p.requires_grad]
    if setting.decay_matrices_only:  # as nanoGPT's configure_optimizers: no decay on norms, biases, tokens
        params = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": setting.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if setting.optimizer == "sgd":
        return torch.optim.SGD(params, lr=setting.lr, momentum=setting.momentum, weight_decay=setting.weight_decay)
    return torch.optim.AdamW(params, lr=setting.lr, betas=setting.betas, weight_decay=setting.weight_decay)


def _batches(loader: Any) -> Any:
    """The loader's batches, epoch after epoch (each epoch its own seeded order)."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one: every child of the model's `nn.ModuleList`s (a
    Transformer's layers), as torchtitan shards `model.layers`; the root takes the rest."""
    return [block for m in model.modules() if isinstance(m, torch.nn.ModuleList) for block in m]


def _fully_shard(model: torch.nn.Module, world_size: int, head_modules: tuple[str, ...] | None) -> float:
    """`fully_shard` each block, then the root; returns FSDP2's FP32 reduce-scatter bytes per rank
    per step (what nfab's runtime reports as `baseline_wire_bytes`), counted from the layouts."""
    from torch.distributed.fsdp import fully_shard

    from nfab.profile.schema import Profile
    from nfab.runtime.frontends import fsdp_layout

    units = _shard_units(model)
    layouts = fsdp_layout.plan_layouts(model, units, world_size, head_modules)
    for block in units:
        fully_shard(block)
    fully_shard(model)
    return fsdp_layout.step_wire_bytes(layouts, Profile.static("fp32")).fsdp_fp32


def _accumulating(model: torch.nn.Module, last: bool) -> Any:
    """The context of one micro-batch's backward: only the last one communicates (DDP's `no_sync`,
    FSDP2's `set_requires_gradient_sync`)."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last)  # type: ignore[operator]
    return contextlib.nullcontext()


def _unsharded(model: torch.nn.Module, setting: Setting, seed: int) -> torch.nn.Module:
    """A plain copy of an FSDP2 model's full weights on every rank (each DTensor all-gathered), so
    that evaluation needs no collective per batch (the ranks' eval shards differ in batch count)."""
    from torch.distributed.tensor import DTensor

    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    copy = build_model(setting.model, seed=seed, **setting.model_options).module
    copy.load_state_dict(full)
    return copy


def _loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if task == "lm":
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    return torch.nn.functional.cross_entropy(out, y)


def _worker(rank: int, setting: Setting, variants: tuple[str, ...], profile: str | None, seed: int, port: int,
            out: str, calibration_out: str | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=setting.world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        for variant in variants:
            t0 = time.perf_counter()
            if variant == AUTO_RERUN:
                dist.barrier()  # rank 0 wrote auto's profile.json before every rank reads it
            result = _train(rank, setting, variant, profile, seed, calibration_out)
            result.wall_s = time.perf_counter() - t0
            if rank == 0:
                Path(out, f"{variant}.json").write_text(json.dumps(asdict(result)))
        dist.barrier()  # every rank reaches the teardown: under torch 2.4 a rank alone in destroy hung
    finally:
        dist.destroy_process_group()


def _train(rank: int, setting: Setting, variant: str, profile: str | None, seed: int,
           calibration_out: str | None = None) -> RunResult:
    import nfab

    w = setting.world_size
    base, noise_moment = variant.removesuffix(NOISE_MOMENT), variant.endswith(NOISE_MOMENT)
    spec = build_model(setting.model, seed=seed, **setting.model_options)
    data_opts = dict(setting.data_options)
    if spec.task == "lm" and "block_size" not in data_opts:
        data_opts["block_size"] = spec.block_size
    train = build_dataset(setting.dataset, split="train", seed=seed, **data_opts)
    test = build_dataset(setting.dataset, split="test", seed=seed, **data_opts)
    loader = make_loader(train, batch_size=setting.batch_size, rank=rank, world_size=w, seed=seed)
    model = spec.module
    fsdp = setting.parallel == "fsdp"
    if fsdp:  # the user's FSDP2 model: nfab attaches to it as to a DDP model
        fp32_step = _fully_shard(model, w, spec.head_modules)
        ddp: torch.nn.Module = model
    else:
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        fp32_step = allreduce_factor(w) * 4 * numel
        bucket = POWERSGD_BUCKET_MB if variant.startswith("powersgd") else None
        ddp = DDP(model, **({"bucket_cap_mb": bucket} if bucket else {}))
    runtime = state = None
    opt = _optimizer(setting, model)  # before attach: nfab reads its family and second moment
    if variant == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif variant == "bf16":  # torch's bf16_compress_hook (DDP refuses its own name without NCCL)
        ddp.register_comm_hook(None, bf16_hook)
    elif variant.startswith("powersgd"):
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(variant.split("-r")[1]),
                                   start_powerSGD_iter=POWERSGD_START_ITER, random_seed=seed)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    elif base == "profile":
        prof = nfab.Profile.load(profile)
        if setting.routes_only:
            prof = prof.model_copy(update={"model": prof.model.model_copy(update={"signature": None})})
        runtime = nfab.attach(ddp, prof, optimizer=opt, cost_model=None, seed=seed, total_steps=setting.steps,
                              head_modules=spec.head_modules, noise_moment=True if noise_moment else "auto")
    elif variant == AUTO:  # in-run calibration, as a user writes it
        runtime = nfab.attach(ddp, "auto", optimizer=opt, cost_model=None, seed=seed, total_steps=setting.steps,
                              head_modules=spec.head_modules, calibration_out=Path(calibration_out or "auto"))
    elif variant == AUTO_RERUN:  # the profile auto wrote, attached as the `profile` variant attaches one
        prof = nfab.Profile.load(Path(calibration_out or "auto") / "profile.json")
        runtime = nfab.attach(ddp, prof, optimizer=opt, cost_model=None, seed=seed, total_steps=setting.steps,
                              head_modules=spec.head_modules)
    elif (custom := _custom_route(variant)) is not None:  # any static route, as a user writes it
        runtime = nfab.attach(ddp, route=custom[0], optimizer=opt, error_feedback=True if custom[1] else "auto",
                              cost_model=None, seed=seed, total_steps=setting.steps, head_modules=spec.head_modules)
    elif base != "fp32":  # a static route everywhere
        runtime = nfab.attach(ddp, route=base.removesuffix("-ef"), optimizer=opt,
                              error_feedback=True if base == "sign-ef" else "auto", cost_model=None, seed=seed,
                              total_steps=setting.steps, head_modules=spec.head_modules, noise_moment=noise_moment)
    wire = probe = shadow = window_bytes = window_wire = 0.0
    fallback_steps = window_steps = 0
    losses: list[float] = []
    events: list[str] = []
    after_prev = 0
    batches = _batches(loader)
    accum = setting.accum_steps
    for step in range(setting.steps):
        for group in opt.param_groups:
            group["lr"] = setting.lr_at(step)
        step_loss = 0.0
        for micro in range(accum):  # every micro-batch but the last accumulates locally (no all-reduce)
            x, y = next(batches)
            with _accumulating(ddp, micro == accum - 1):
                loss = _loss(spec.task, ddp(x), y)
                if runtime is not None and micro == accum - 1:
                    runtime.observe_loss(loss)  # before backward: FSDP2's first reduce-scatter carries it
                (loss / accum).backward()
            step_loss += float(loss.detach()) / accum if fsdp else 0.0
        if fsdp:
            losses.append(step_loss)
        if runtime is not None:
            stats = runtime.step_stats()
            wire += stats.wire_bytes
            probe += stats.probe_wire_bytes
            shadow += stats.shadow_wire_bytes
            fallback_steps += int(stats.fallback)
            if stats.calibrating:  # an in-run calibration window's step
                window_steps += 1
                window_bytes += stats.calibration_wire_bytes
                window_wire += stats.wire_bytes
            events += [f"{step}:{e}" for e in stats.events]
        elif state is not None:
            after = state.compression_stats()[2]
            wire += allreduce_factor(w) * 4 * (after - after_prev) if step >= POWERSGD_START_ITER else fp32_step
            after_prev = after
        else:
            wire += fp32_step / 2 if variant in ("fp16", "bf16") else fp32_step
        if setting.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), setting.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    evaluated = _unsharded(model, setting, seed) if fsdp else model
    loss_sum, correct, count = _evaluate(evaluated, test, spec.task, setting, rank)
    fp32_total = fp32_step * setting.steps
    extra: dict[str, Any] = {}
    if variant in AUTO_VARIANTS and runtime is not None:
        extra["calibration"] = {
            "phases": [{"name": p.name, "start": p.start.model_dump(exclude_none=True), "routes": dict(p.routes)}
                       for p in runtime.profile.phases],
            "window_steps": window_steps, "window_mb": window_bytes / 1e6, "window_wire_mb": window_wire / 1e6,
            "window_share": window_bytes / fp32_total if fp32_total else None,
            "out": str(calibration_out)}
    return (AutoRunResult if extra else RunResult)(
        setting=setting.name, variant=variant, ok=math.isfinite(loss_sum / count), seed=seed, steps=setting.steps,
        world_size=w,
        eval_loss=loss_sum / count, eval_accuracy=correct / count if spec.task == "classification" else None,
        wire_mb=wire / 1e6, fp32_mb=fp32_total / 1e6, ratio=fp32_total / wire if wire else None,
        fallback_steps=fallback_steps if runtime is not None else None, health_events=events[:20],
        probe_mb=probe / 1e6 if runtime is not None else None,
        shadow_mb=shadow / 1e6 if runtime is not None else None,
        alarms=runtime.health.alarms if runtime is not None else None,
        false_alarms=runtime.health.false_alarms if runtime is not None else None,
        train_losses=losses if fsdp else None, **extra)


@torch.no_grad()
def _evaluate(module: torch.nn.Module, test: Any, task: str, setting: Setting, rank: int) -> tuple[float, float, float]:
    """Loss sum, correct predictions and count over the first `eval_samples` test samples (all ranks)."""
    module.eval()
    n = min(setting.eval_samples, len(test))
    subset = torch.utils.data.Subset(test, range(n))
    loader = make_eval_loader(subset, batch_size=64, rank=rank, world_size=setting.world_size)
    sums = torch.zeros(3, dtype=torch.float64, device="cpu")
    for x, y in loader:
        logits = module(x)
        k = y.numel()
        sums[0] += _loss(task, logits, y).double() * k
        if task == "classification":
            sums[1] += (logits.argmax(-1) == y).sum().double()
        sums[2] += k
    dist.all_reduce(sums)
    return float(sums[0]), float(sums[1]), max(float(sums[2]), 1.0)


def main(argv: list[str] | None = None) -> int:
    """Run a few variants of one study setting and print one JSON row per variant."""
    ap = argparse.ArgumentParser(prog="python -m bench.userloop", description=main.__doc__)
    ap.add_argument("--setting", default="heldout", help=f"one of {', '.join(SETTINGS)}")
    ap.add_argument("--variants", default="fp32", help="comma-separated: " + ", ".join(VARIANTS + AUTO_VARIANTS)
                    + ", route:SPEC or route-ef:SPEC")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", choices=PARALLEL, default=None,
                    help="ddp or fsdp (FSDP2, fully_shard per block; default: the setting's)")
    ap.add_argument("--profile", default=None,
                    help="the profile the `profile` variants attach (default: the setting's)")
    ap.add_argument("--calibration-out", default=None,
                    help="where `auto` writes calibration.parquet and profile.json (default: a temporary folder)")
    a = ap.parse_args(argv)
    try:
        if a.setting not in SETTINGS:
            raise ValueError(f"unknown study setting {a.setting!r} (known: {', '.join(SETTINGS)})")
        changes = {k: v for k, v in (("steps", a.steps), ("world_size", a.world_size), ("profile", a.profile),
                                                    ("parallel", a.parallel))
                   if v is not None}
        setting = dataclasses.replace(SETTINGS[a.setting], **changes)
        variants = tuple(v.strip() for v in a.variants.split(",") if v.strip())
        for v in variants:
            _check_variant(v, setting.parallel)
            custom = _custom_route(v)
            if custom is not None:
                import nfab

                nfab.Profile.static(custom[0])  # an unknown route or region: one line here, not one per rank
    except (ValueError, TypeError, NfabError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cal = Path(a.calibration_out) if a.calibration_out else None
    for row in run_variants(setting, variants, seed=a.seed, calibration_out=cal):
        print(json.dumps(asdict(row)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
